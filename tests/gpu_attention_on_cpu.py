"""CPU stand-ins for the CUDA kernels SDPA traces to (flash, memory-efficient, cuDNN), for tests.

On a GPU, ``F.scaled_dot_product_attention`` traces to ``_scaled_dot_product_flash_attention``,
``_scaled_dot_product_efficient_attention`` or ``_scaled_dot_product_cudnn_attention``; those ops
have fake/meta kernels (tracing works on any device) but no CPU kernel. Registering one here, by
the math path, lets a CPU machine trace, rewrite, run and ``explain(verify=True)`` graphs that call
them, exactly as dynashard receives them on a GPU: the rules are checked, the CUDA kernels are not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten
_LIB: list = []


def _math(q, k, v, bias, causal, scale):
    s = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * s
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if bias is not None:
        scores = scores + bias
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal, scale=scale), torch.logsumexp(
        scores, -1)


def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse = _math(q, k, v, None, is_causal, scale)
    empty = q.new_empty(0)
    rng = torch.zeros(2, dtype=torch.uint64)
    return out, lse, empty, empty, q.shape[-2], k.shape[-2], rng, torch.zeros((), dtype=torch.uint64), empty


def _efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    out, lse = _math(q, k, v, attn_bias, is_causal, scale)
    width = 32 * math.ceil(q.shape[-2] / 32) if compute_log_sumexp else 0
    padded = lse.new_zeros(*lse.shape[:-1], width)
    padded[..., : min(width, lse.shape[-1])] = lse[..., :width]
    seed = torch.zeros((), dtype=torch.int64)
    return out, padded, seed, seed.clone()


def _cudnn(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
           scale=None):
    out, lse = _math(q, k, v, attn_bias, is_causal, scale)
    empty, seed = q.new_empty(0), torch.zeros((), dtype=torch.int64)
    return out, lse.unsqueeze(-1), empty, empty, q.shape[-2], k.shape[-2], seed, seed.clone(), empty


def register() -> None:
    """Give the three CUDA attention ops a CPU kernel in this process (once)."""
    if _LIB:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", _flash, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention", _efficient, "CPU")
    lib.impl("_scaled_dot_product_cudnn_attention", _cudnn, "CPU")
    _LIB.append(lib)


class CudaKernelAttention(torch.nn.Module):
    """Attention calling one of the CUDA SDPA kernels directly, as a GPU trace of SDPA does;
    ``bias``: an additive per-head bias (ALiBi-like), for the kernels that take one."""

    def __init__(self, kernel: str, hidden: int = 64, heads: int = 4, bias: bool = False):
        super().__init__()
        self.kernel, self.h, self.with_bias = kernel, heads, bias
        self.q, self.k, self.v, self.o = (torch.nn.Linear(hidden, hidden) for _ in range(4))
        self.slopes = torch.nn.Parameter(torch.rand(heads, 1, 1))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (lin(x).view(b, t, self.h, d // self.h).transpose(1, 2) for lin in (self.q, self.k, self.v))
        bias = None
        if self.with_bias:
            pos = torch.arange(t, dtype=x.dtype)
            bias = (-(pos[None, :] - pos[:, None]).abs() * self.slopes).expand(b, self.h, t, t)
        if self.kernel == "flash":
            y = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        elif self.kernel == "efficient":
            y = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, bias is None)[0]
        else:
            y = aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, bias is None)[0]
        return self.o(y.transpose(1, 2).reshape(b, t, d))
