"""Replicated weights compared across ranks before they are cut: a checksum tolerant of summation
order but not of values moved (a row swapped)."""

from __future__ import annotations

import functools

import torch


def checksum(t: torch.Tensor) -> tuple[float, float, float]:
    """Sum, absolute sum and a position-weighted sum of ``t``, in float64.

    Each element is weighted by a hash of its flat index, the same on every rank, so moving values
    (two rows swapped, a permuted head) changes the third sum. A plain strided sum (the seed's) is
    blind to swapped rows whose length is a multiple of the stride. Chunked, so the float64 copy
    stays small for a large weight; about the cost of the two plain sums.
    """
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:  # (a mask buffer: abs has no bool kernel)
        flat = flat.to(torch.int64)
    total = absolute = weighted = 0.0
    for k, start in enumerate(range(0, flat.numel(), _CHUNK)):
        part = flat[start : start + _CHUNK].to(torch.float64)
        mix = _mix(part.device)[: part.numel()]
        if k:  # another chunk, other weights (else swapping i and i + _CHUNK would cancel)
            mix = torch.frac(mix + k * 0.6180339887498949)
        total += float(part.sum())
        absolute += float(part.abs().sum())
        weighted += float(torch.dot(part, mix))
    return total, absolute, weighted


_CHUNK = 1 << 20


@functools.lru_cache(maxsize=2)
def _mix(device: torch.device) -> torch.Tensor:
    """Knuth's multiplicative hash of 0.._CHUNK-1, scaled to [0, 1)."""
    index = torch.arange(_CHUNK, dtype=torch.int64, device=device)
    return ((index * 2654435761) % 4294967296).to(torch.float64) / 4294967296.0


def close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    # Same data summed with another thread count may differ in the last bits only.
    return all(abs(x - y) <= 1e-12 * max(1.0, abs(x), abs(y)) for x, y in zip(a, b))
