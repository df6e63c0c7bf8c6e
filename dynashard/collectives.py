"""The one module that talks to torch.distributed: graph collectives (funcol) and compile-time ones.

Graph collectives are plain functions over ``torch.distributed._functional_collectives``; the
rewrite calls them while tracing, so the graph holds ``_c10d_functional.*`` + ``wait_tensor``
with symbolic batch sizes. Compile-time collectives (checksums, rank-0 weights) use c10d
directly: they run once, outside any trace.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return funcol.all_reduce(x, "sum", group_name)


def all_gather_last_dim(x: torch.Tensor, size: int, chunk: int, world: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's ``torch.chunk``-like shard of the last dim back to ``size``.

    Shards shorter than ``chunk`` (the tail of an uneven split) are padded first: padding then
    lands past ``size`` only, so one narrow removes it.
    """
    if x.shape[-1] != chunk:
        x = F.pad(x, (0, chunk - x.shape[-1]))
    gathered = funcol.all_gather_single(x.contiguous(), 0, group_name)  # [world * d0, ...]
    if x.dim() > 1:
        gathered = gathered.view(world, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], world * chunk)
    if world * chunk != size:
        gathered = gathered.narrow(-1, 0, size)
    return gathered


def group_name(group: dist.ProcessGroup) -> str:
    return group.group_name


def all_gather_objects(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` in place with the group's first rank's values."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)
