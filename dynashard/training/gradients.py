"""Gradients of sharded parameters that norm as the whole gradient: ``clip_grad_norm_`` unchanged.

Before: a sharded parameter's ``.grad`` is this rank's part of the gradient; the norm of it is a
per-rank number, so ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` would clip
each rank by another factor and the ranks would drift apart (research/training.md 5: 4.55 / 5.13
against the unsharded 6.30).
After: once a gradient lands in a sharded parameter, its ``.grad`` is a :class:`ShardGrad`, a plain
tensor subclass (the same memory) whose ``torch.linalg.vector_norm`` / ``Tensor.norm`` is the norm of
the whole gradient: this rank's norm combined with every other rank's (one all_reduce). The shards
of a trainable layout never overlap (dynamo_backend.check_trainable refuses whole parts), so the
p-th powers add up; the infinity norm takes the max. Every other op sees a plain tensor.

``clip_grad_norm_`` takes the per-tensor path for a subclass (its foreach path is for plain tensors
only), so it asks each gradient for its norm: replicated parameters give their own (the same on
every rank), sharded ones the whole gradient's, and the total is the unsharded model's on every
rank. Every rank must clip the same parameters in the same order, as for any collective.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from dynashard import _torch as private
from dynashard.comm.protocol import peer_guard
from dynashard.errors import NotSupportedError


class ShardGrad(torch.Tensor):
    """A sharded parameter's gradient: its norm is the whole gradient's (see the module docstring), and
    ``dynashard.full_tensor`` of it is the whole gradient (it knows its parameter)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with private.plain_torch_functions():
            if func in _NORMS:
                return _global_norm(func, args, kwargs)
            return func(*args, **kwargs)


def _global_norm(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    grad, rest = args[0], args[1:]
    group = getattr(grad, "_dynashard_group", None)
    ord_ = rest[0] if rest else kwargs.get("ord", kwargs.get("p", 2))
    if kwargs.get("dim") is not None or (len(rest) > 1 and rest[1] is not None) or ord_ in ("fro", "nuc"):
        return func(*args, **kwargs)  # a norm along dims is per-rank by nature: left as it is
    ord_ = float(ord_)
    local = torch.linalg.vector_norm(grad.detach(), ord_, dtype=torch.float64 if grad.dtype == torch.float64
                                     else torch.float32)
    if ord_ == float("-inf") or ord_ == 0:
        return func(*args, **kwargs)  # (not used for clipping; no cross-rank meaning here)
    with peer_guard(group or dist.group.WORLD, "the whole gradient's norm (clip_grad_norm_)"):
        if ord_ == float("inf"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            total = local
        else:
            power = local.pow(ord_)
            dist.all_reduce(power, group=group)
            total = power.pow(1.0 / ord_)
    return total.to(grad.dtype)


_NORMS = {torch.linalg.vector_norm, torch.Tensor.norm, torch.norm}


def mark(param: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Make ``param``'s gradient a :class:`ShardGrad` whenever one lands in it."""
    if getattr(param, "_dynashard_grad_hook", False):
        return

    def as_shard_grad(p: torch.Tensor) -> None:
        # (a sparse gradient, of an embedding with sparse=True, stays as it is: torch's norms refuse
        # sparse tensors, unsharded too, and a subclass of one cannot be made)
        if p.grad is not None and not isinstance(p.grad, ShardGrad) and not p.grad.is_sparse:
            g = p.grad.as_subclass(ShardGrad)
            g._dynashard_group = group
            g._dynashard_param = weakref.ref(p)  # (dynashard.full_tensor(p.grad) gathers it by p's placement)
            p.grad = g

    param.register_post_accumulate_grad_hook(as_shard_grad)
    param._dynashard_grad_hook = True


def average_over_ranks(param: torch.Tensor, group: dist.ProcessGroup, sharded: bool) -> None:
    """``inputs="per_rank"`` training: ``param``'s gradient becomes the one of the mean of every
    rank's loss, as the unsharded model trained on the ranks' batches concatenated would get.

    Each rank differentiates its own loss, and the graph's collectives carry every rank's share
    (funcol's backwards: the sum of the ranks' losses). So a sharded parameter's gradient is already
    the sum's: it is divided by the world size. A replicated one holds only this rank's loss's (its
    rows), so it is summed over the ranks first -- one all_reduce per parameter per backward, as
    DDP does -- then divided. A tensor hook changes the gradient before it is accumulated, so
    gradient accumulation over micro-batches adds already-averaged gradients."""
    if getattr(param, "_dynashard_averaged", False):
        return
    world = dist.get_world_size(group)

    def average(grad: torch.Tensor) -> torch.Tensor:
        if sharded:
            return grad / world
        if grad.is_sparse:
            raise NotSupportedError(
                "dynashard: inputs='per_rank' sums a replicated parameter's gradient over the ranks, and this one "
                "is sparse (an embedding with sparse=True kept whole): expected sparse=False for it, or a plan "
                "that shards it ('rowwise': vocab-parallel).")
        total = grad.contiguous().clone()
        with peer_guard(group, "averaging a replicated gradient over the ranks (inputs='per_rank')"):
            dist.all_reduce(total, group=group)
        return total / world

    # A parameter frozen now may be unfrozen later: its hook is registered all the same (a hook outlives
    # requires_grad_ toggles), so the gradient it gets then is averaged too. (torch refuses a hook on a tensor
    # that does not require grad, hence the toggle.)
    frozen = not param.requires_grad
    if frozen:
        param.requires_grad_(True)
    try:
        param.register_hook(average)
    finally:
        if frozen:
            param.requires_grad_(False)
    param._dynashard_averaged = True
