"""Data moves between ranks outside the graph: the rank-0 deal, gathers to one rank or all, the
per-rank exchange of weight blocks. They run over the user's group on the tensors' device (NCCL
moves CUDA tensors); the agreement around them (rank 0's status before each send) is host-side,
in ``protocol``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dynashard.comm.collectives import rank_blocks
from dynashard.comm.protocol import first_rank_status, peer_guard
from dynashard.errors import UsageError


def exchange_blocks(t: torch.Tensor, dim: int, lengths: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """weights="per_rank": ``[world, *block]`` holding this rank's block of every rank's ``t``."""
    moved = t.detach().movedim(dim, -1)
    send = rank_blocks(moved, lengths).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.narrow(-1, 0, lengths[rank]).movedim(-1, dim + 1).contiguous()


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` in place with the group's first rank's values."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)


def deal_from_first(make: Any, shape: list[int], dtype: torch.dtype, device: Any, group: dist.ProcessGroup,
                    what: str, whole: bool = False) -> torch.Tensor:
    """Group rank 0 makes each rank's tensor, ``make(r)``, and sends it to rank ``r``; every rank
    returns its own on ``device`` (``shape``: this rank's; ``make`` is called on rank 0 only; NCCL sends
    only CUDA tensors). With ``whole``, one tensor, ``make(None)``, is the same for every rank (a
    broadcast). Rank 0 holds one rank's tensor at a time.

    Before each send every rank joins a one-element broadcast of rank 0's status, so a failure of
    ``make`` (a bad checkpoint) is raised on every rank at the same point, with rank 0's message,
    and no rank waits for a tensor that never comes.
    """
    with peer_guard(group, f"rank 0's deal ({what})"):
        return _deal(make, shape, dtype, torch.device(device), group, what, whole)


def _deal(make: Any, shape: list[int], dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup,
          what: str, whole: bool) -> torch.Tensor:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first = dist.get_global_rank(group, 0)
    whole = whole or world == 1
    mine: torch.Tensor | None = None
    for r in [0] if whole else range(world):
        value, error = None, None
        if rank == 0:
            try:
                value = make(None if whole else r).to(device).contiguous()
                if value.dtype != dtype or (whole or r == 0) and list(value.shape) != list(shape):
                    raise UsageError(f"dynashard: {what} gave {value.dtype}{list(value.shape)}; expected "
                                     f"{dtype}{list(shape)}")
            except Exception as e:  # noqa: BLE001 - every rank raises it below
                error = e
        first_rank_status(error, group, what)
        if whole:
            mine = value if rank == 0 else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(mine, src=first, group=group)
        elif r == 0:
            mine = value if rank == 0 else mine
        elif rank == 0:
            dist.send(value, group=group, group_dst=r)
        elif rank == r:
            mine = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(mine, group=group, group_src=0)
    assert mine is not None
    return mine


def gather_to_first(local: torch.Tensor, full_shape: list[int], dim: int, pieces: Any, group: dist.ProcessGroup
                    ) -> torch.Tensor | None:
    """The whole tensor on group rank 0 (None elsewhere), from every rank's ``local``: rank ``r``
    holds ``pieces(r)`` (``(start, length)`` along ``dim``) side by side. Rank 0 receives one rank's
    tensor at a time; pieces several ranks hold (whole K/V heads) are simply written again."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank != 0:
        dist.send(local.detach().contiguous(), group=group, group_dst=0)
        return None
    full = torch.empty(full_shape, dtype=local.dtype, device=local.device)
    for r in range(world):
        lengths = [length for _, length in pieces(r)]
        if r == 0:
            held = local.detach()
        else:
            shape = list(full_shape)
            shape[dim] = sum(lengths)
            held = torch.empty(shape, dtype=local.dtype, device=local.device)
            dist.recv(held, group=group, group_src=r)
        at = 0
        for start, length in pieces(r):
            full.narrow(dim, start, length).copy_(held.narrow(dim, at, length))
            at += length
    return full


def gather_pieces(local: torch.Tensor, full_shape: list[int], spec: Any, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor on every rank from every rank's ``local`` (its pieces under ``spec``, side by
    side along ``spec.dim``): one all_gather of the blocks, each padded to the longest rank's."""
    if local.dtype.is_floating_point and local.dtype.itemsize == 1:  # float8 (torchao's Float8Tensor qdata)
        # gloo's all_gather of float8 raises "Invalid scalar type"; a gather only moves bytes: as uint8
        return gather_pieces(local.view(torch.uint8), full_shape, spec, group).view(local.dtype)
    world, dim = spec.world, spec.dim % len(full_shape)
    lengths = [spec.split.local(world, r) for r in range(world)]
    longest = max(lengths)
    moved = local.movedim(dim, 0).contiguous()
    block = torch.zeros((longest, *moved.shape[1:]), dtype=local.dtype, device=local.device)
    block[: moved.shape[0]] = moved
    blocks = [torch.empty_like(block) for _ in range(world)]
    dist.all_gather(blocks, block, group=group)
    full = torch.empty([full_shape[dim], *moved.shape[1:]], dtype=local.dtype, device=local.device)
    for r in range(world):
        at = 0
        for start, length in spec.split.pieces(world, r):
            full[start:start + length] = blocks[r][at:at + length]
            at += length
    return full.movedim(0, dim)

