"""DCP's planner protocol, both ways, for tensors that are one rank's pieces of a global tensor.

Save: :func:`make_checkpointable` puts DTensor's ``_Checkpointable`` protocol on a plain shard, so
``dcp.save(model.state_dict())`` writes each rank's pieces at their global offsets::

    shard [4096, 1024] = rows [4096, 8192) of w [16384, 1024]
        -> WriteItem(MetadataIndex("w", (4096, 0)), chunk offsets (4096, 0), sizes (4096, 1024))

Load: :class:`LoadPlanner` (``dcp.load(..., planner=dynashard.LoadPlanner())``) shows DCP such a
shard's global size, so the default plan reads exactly its chunks into it, from a checkpoint
saved at any world size; :class:`SlicePlanner` reads chunks of one saved tensor into plain
buffers (what :class:`~dynashard.load.checkpoint.DCPCheckpoint` reads a slice with).

Invariants: a shard's chunks are the pieces it holds, no more; DCP's default planner does
everything else (the classes only change what it is shown); nothing here runs a collective.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from dynashard.layout import placement


def _slice_planner_base():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    return DefaultLoadPlanner


class SlicePlanner(_slice_planner_base()):
    """Reads chunks ``(offsets, sizes)`` of one tensor into plain buffers (no DTensor): the plan
    asks for exactly those chunks, and each read item lands in a view of its buffer."""

    def __init__(self, fqn: str, md, wanted: list[tuple[list[int], list[int], torch.Tensor]]) -> None:
        super().__init__()
        self._fqn, self._md, self._wanted = fqn, md, wanted

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        items = []
        for i, (offsets, sizes, _) in enumerate(self._wanted):
            for item in create_read_items_for_chunk_list(
                    self._fqn, self._md, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))]):
                # one chunk per call: its items name chunk 0; tag them with this buffer's number instead
                items.append(dataclasses.replace(item, dest_index=dataclasses.replace(item.dest_index, index=i)))
        return LoadPlan(items)

    def lookup_tensor(self, index) -> torch.Tensor:
        return self._wanted[index.index][2]


def make_checkpointable(local: torch.Tensor, full_shape: torch.Size, dim: int,
                        pieces: list[tuple[int, int]], placed: dict | None = None) -> torch.Tensor:
    """``local`` (this rank's ``pieces`` of ``dim``, side by side) saved by DCP at their global offsets.

    DCP asks a state-dict value for DTensor's ``_Checkpointable`` protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``: torch/distributed/checkpoint/planner_helpers.py);
    set on the tensor itself they describe any layout dynashard cuts, including fused components and
    whole ones (the same chunk on every rank, which the save planner deduplicates). Measured:
    tools/proto_dcp_shards.py. Loading goes through :class:`~dynashard.load.checkpoint.DCPCheckpoint` (DCP's default
    load planner compares a plain tensor's own size with the saved one). ``placed``: the placement
    (placement.py) ``local`` carries, in memory and through torch.save.
    """
    runs = [[(0, n)] for n in full_shape]
    runs[dim] = list(pieces)
    if placed is not None:
        setattr(local, placement.KEY, placed)
    return make_checkpointable_blocks(local, full_shape, runs)


def make_checkpointable_blocks(local: torch.Tensor, full_shape: torch.Size,
                               runs: list[list[tuple[int, int]]]) -> torch.Tensor:
    """``local`` saved and loaded by DCP as the blocks it holds: along each dim ``d`` it holds the ranges
    ``runs[d]`` (``(global start, length)``, side by side in this order), and a chunk is one range of every
    dim. Set on a DTensor's local tensor, DTensor's protocol answers with it (it asks its local tensor
    first), so DCP's default planners save and load a fused layout's pieces at their true offsets: a 2-D
    ``(Shard(1), _StridedShard(0, 3))`` parameter holds 3 chunks, one per component."""
    from itertools import product

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    per_dim = []  # per dim: (global start, length, local start) of each non-empty range
    for ranges in runs:
        at, kept = 0, []
        for start, length in ranges:
            if length:
                kept.append((start, length, at))
            at += length
        per_dim.append(kept)
    chunks, by_offset = [], {}
    for block in product(*per_dim):
        chunk = ChunkStorageMetadata(torch.Size([b[0] for b in block]), torch.Size([b[1] for b in block]))
        chunks.append(chunk)
        by_offset[chunk.offsets] = [(b[2], b[1]) for b in block]
    # The functions below are attributes of ``local`` and hold it weakly (DCP calls them on the live
    # tensor): a strong reference back makes a cycle through the tensor's __dict__ that the collector does
    # not break for a registered shard (measured: a parallelized model's shards outlive it).
    held = weakref.ref(local)

    def write_items(fqn: str, _obj: Any) -> list:
        props = TensorProperties.create_from_tensor(held())
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=torch.Size(full_shape)))
                for c in chunks]

    def tensor_shard(index: Any) -> torch.Tensor:
        view = held().detach()
        for d, (at, length) in enumerate(by_offset[index.offset]):
            view = view.narrow(d, at, length)
        return view

    def reduce_ex(protocol: int) -> Any:
        # torch.save / pickle: the shard as the plain tensor (or Parameter) it is, without these closures,
        # with its placement (plain data: torch.load(weights_only=True) reads it back)
        this = held()
        plain = this.detach()
        if isinstance(this, torch.nn.Parameter):
            plain = torch.nn.Parameter(plain, requires_grad=this.requires_grad)
        if placement.of(this) is not None:
            setattr(plain, placement.KEY, placement.of(this))
        return plain.__reduce_ex__(protocol)

    local.__create_write_items__ = write_items
    local.__create_chunk_list__ = lambda: list(chunks)
    local.__get_tensor_shard__ = tensor_shard
    local.__reduce_ex__ = reduce_ex
    local._dynashard_global_shape = torch.Size(full_shape)  # (read by LoadPlanner)
    return local


def _load_planner_base():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    return DefaultLoadPlanner


class LoadPlanner(_load_planner_base()):
    """``dcp.load(state, checkpoint_id=..., planner=dynashard.LoadPlanner())`` into live shards: the
    state of a parallelized model and its optimizer (``get_state_dict(model, optimizer)``), from a
    checkpoint saved at any world size or unsharded. Each shard asks for its pieces of the saved
    tensors (its checkpoint protocol's chunks) and is filled in place.

    DCP's default planner first compares each tensor's own size with the saved one, which a shard's
    local size fails; this planner shows DCP the global size of tensors that carry a shard's protocol
    and leaves everything else to the default planner.
    """

    def create_local_plan(self):
        real = self.state_dict
        self.state_dict = {k: _GlobalSized(v) if hasattr(v, "_dynashard_global_shape") else v for k, v in real.items()}
        try:
            return super().create_local_plan()
        finally:
            self.state_dict = real


class _GlobalSized:
    """What the default load plan reads of a shard: its global size and its chunks."""

    def __init__(self, shard: torch.Tensor) -> None:
        self._shard = shard

    def size(self) -> torch.Size:
        return self._shard._dynashard_global_shape

    def __create_chunk_list__(self) -> list:
        return self._shard.__create_chunk_list__()
