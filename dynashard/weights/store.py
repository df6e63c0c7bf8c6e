"""Weights: agree across ranks, cut this rank's shards, and free the full tensors.

A sharded parameter keeps its metadata (Dynamo guards on size, stride and dtype and re-traces
it with fake tensors on a recompile) but its storage is resized to zero; the compiled program
reads this rank's shard from :data:`STORE` instead (see docs/design.md, "Parameters, guards and
memory"). Shards are keyed by parameter identity, so later graphs and recompiles reuse them.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dynashard import _torch as private
from dynashard.capture.subclass_inputs import inner_tensors
from dynashard.comm.protocol import exchange_status
from dynashard.comm.transport import broadcast_from_first, exchange_blocks
from dynashard.errors import PeerError, UsageError
from dynashard.layout import placement
from dynashard.layout.split import Split
from dynashard.weights.checksum import checksum, close


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    dim: int
    split: Split
    world: int
    rank: int
    group_name: str
    stacked: bool = False  # weights="per_rank": this rank's block of every rank's tensor, [world, *block]

    def same_cut(self, other: ShardSpec) -> bool:
        """The same elements on every rank, however the split is written (6 units of 8 = 48 of 1
        on 2 ranks): a recompile that describes the cut differently still fits the shard."""
        if dataclasses.replace(self, split=other.split) != other:
            return False
        return self.split == other.split or self.split.owned(self.world) == other.split.owned(other.world)


# dynashard.parallelize(checkpoint=... or weights="rank0"): where a storage-less parameter's values come
# from, passed down from parallelize to the backend it runs: this rank's pieces under a spec, all of it for None
Source = Callable[[torch.Tensor, "ShardSpec | None"], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class EarlierCuts:
    """What earlier compiles did to a graph's inputs, by input slot: the dim each cut one was split on and
    its split (later uses follow both: its full value is gone), and those a compiled program reads whole
    (cutting them would free what it reads). Handed to the planner, which reads no store."""

    split: dict[int, tuple[int, Split]] = dataclasses.field(default_factory=dict)
    whole: frozenset[int] = frozenset()


@dataclasses.dataclass
class _Entry:
    spec: ShardSpec
    shard: torch.Tensor
    fqn: str
    held: bool = False  # a shard a compiled program made (a cache it allocated), or one derived from such


def is_storage_less(t: torch.Tensor) -> bool:
    """A tensor with elements and no bytes: a facade, or a parameter parallelize has not read yet."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


class WeightStore:
    """This process's shards, and which parameters were already checked across ranks."""

    def __init__(self) -> None:
        self._shards = private.weak_id_dict()
        self._agreed = private.weak_id_dict()
        # registered shard Parameter -> a weak reference to its full-shape facade (a strong one would keep the
        # facade, whose entry above keeps the shard, alive for the life of the process: a model never freed)
        self._facade_of = private.weak_id_dict()
        # parallelize(dtensor=True)'s facades -> (weak reference to the module holding the live parameter, its
        # attribute, its FQN, the local shape every call must find: a parameter FSDP has not gathered yet has
        # another; for a 1-D fused one held whole, (this rank's pieces, the tp group) to cut it by at every call,
        # else None): their values are the module's DTensor, not a shard here (training/fsdp.py)
        self.live = private.weak_id_dict()
        # parameters a compiled program reads whole: a later graph must not cut (and free) them
        self._read_whole = private.weak_id_dict()
        # a tensor given a shard's placement (a state_dict() value, an optimizer state) -> weak reference to the
        # facade whose pieces it holds: how DCP's full state dict gathers it (placed_facade)
        self._placed = private.weak_id_dict()

    def shard_of(self, param: torch.Tensor) -> torch.Tensor | None:
        entry = self._shards.get(param)
        return None if entry is None else entry.shard

    def entry(self, t: torch.Tensor) -> _Entry | None:
        return self._shards.get(t)

    def is_live(self, t: Any) -> bool:
        """A facade of parallelize(dtensor=True): its values are the module's DTensor parameter."""
        return isinstance(t, torch.Tensor) and t in self.live

    def add_held(self, facade: torch.Tensor, spec: ShardSpec, local: torch.Tensor, name: str) -> None:
        """``local``, a shard made by a program or derived from another, filed under its new ``facade``."""
        self._shards[facade] = _Entry(spec, local, name, held=True)

    def weight_of(self, t: torch.Tensor) -> str | None:
        """The FQN of the weight ``t`` is the facade of (None: not one, or a shard a program made, a cache)."""
        entry = self._shards.get(t)
        return None if entry is None or entry.held else entry.fqn

    def spec_of_any(self, t: torch.Tensor) -> ShardSpec | None:
        entry = self._shards.get(t)
        return None if entry is None else entry.spec

    # What a facade does eagerly (facades.py): on its shard, never a collective.

    def local_of(self, facade: torch.Tensor) -> torch.Tensor:
        entry = self._shards.get(facade)
        if entry is None:
            raise UsageError("dynashard: this tensor's storage was freed by dynashard, and its shard is gone (the "
                             "model that held it was deleted). Expected a tensor of a live compiled model.")
        return entry.shard

    def alias(self, new: torch.Tensor, facade: torch.Tensor) -> None:
        """``new`` (``facade.detach()``, ``facade.data``) stands for the same shard."""
        self._shards[new] = self.entry_of(facade)

    def rebind(self, facade: torch.Tensor, value: torch.Tensor) -> None:
        """``facade.data = value``: the shard takes the value's shard (a facade, ``model.to(...)``), or this
        rank's pieces of a full-size tensor. The shard object stays (an optimizer, parallelize hold it)."""
        entry = self.entry_of(facade)
        if value in self._shards:
            local = self._shards[value].shard
        elif list(value.shape) == list(facade.shape):
            local = self._cut_of(entry, value).clone(memory_format=torch.contiguous_format)
        else:
            raise UsageError(
                f"dynashard: {entry.fqn!r}.data = a tensor of shape {list(value.shape)}; expected the full shape "
                f"{list(facade.shape)} (this rank keeps its pieces) or a tensor dynashard cut alike.")
        entry.shard.data = local.detach()

    def copy_into(self, facade: torch.Tensor, src: Any, non_blocking: bool = False) -> None:
        """``facade.copy_(src)``: this rank's pieces of a full-size ``src`` (or a facade cut alike) into the shard."""
        entry = self.entry_of(facade)
        other = self._shards.get(src) if isinstance(src, torch.Tensor) else None
        if other is not None and other.spec.same_cut(entry.spec):
            piece = other.shard
        elif isinstance(src, torch.Tensor) and list(src.shape) == list(facade.shape) and other is None:
            piece = self._cut_of(entry, src)
        else:
            shape = list(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
            raise UsageError(
                f"dynashard: copy_ into {entry.fqn!r}, which dynashard sharded: expected a tensor of its full shape "
                f"{list(facade.shape)} (this rank copies its pieces) or one dynashard cut alike; found {shape}.")
        with torch.no_grad():
            entry.shard.copy_(piece, non_blocking=non_blocking)

    def _cut_of(self, entry: _Entry, full: torch.Tensor) -> torch.Tensor:
        spec = entry.spec
        if spec.stacked:
            raise UsageError(f"dynashard: {entry.fqn!r} holds a block of every rank's own weight "
                             "(weights='per_rank'); a full-size tensor has no single piece for it.")
        return cut(full.detach(), spec.dim, spec.split, spec.world, spec.rank)

    def entry_of(self, facade: torch.Tensor) -> _Entry:
        self.local_of(facade)  # (a clear error for an orphan)
        return self._shards[facade]

    def shard_for(self, param: torch.Tensor, spec: ShardSpec, fqn: str) -> torch.Tensor | None:
        """``param``'s shard if it was cut as ``spec``; None if it was never cut; an error if it was
        cut another way (by another compiled program that shares the weight)."""
        entry = self._shards.get(param)
        if entry is None:
            return None
        if not entry.spec.same_cut(spec):
            raise UsageError(
                f"dynashard: {fqn!r} was sharded as {entry.spec} by another compile, and this program "
                f"needs {spec}. Its full value was freed, so it cannot be re-split: expected every "
                "compile that reads a weight to split it the same way (same plan, group and model)."
            )
        return entry.shard

    def as_parameter(self, param: torch.Tensor) -> torch.nn.Parameter:
        """``param``'s shard as a Parameter (the same storage) that the store now holds, with DCP's
        checkpoint protocol describing its pieces of the global tensor (see dcp_planners.py)."""
        entry = self._shards[param]
        if not isinstance(entry.shard, torch.nn.Parameter):
            entry.shard = self.checkpointable(param, torch.nn.Parameter(entry.shard, requires_grad=param.requires_grad))
            self._facade_of[entry.shard] = weakref.ref(param)
        return entry.shard

    def facade_of(self, shard: torch.Tensor) -> torch.Tensor | None:
        """The full-shape parameter a registered shard stands for (None for any other tensor)."""
        ref = self._facade_of.get(shard)
        return None if ref is None else ref()

    def facade_sharing_memory(self, t: torch.Tensor) -> torch.Tensor | None:
        """The facade whose shard ``t`` is another handle of (``shard.detach()``, ``.data``, a ``state_dict()``
        value: the same memory, offset, shape and strides), else None. A tensor reading only part of a
        shard's memory raises: it is neither the shard nor a whole tensor."""
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return None
        overlapping = None  # (an entry whose shard shares the memory, but not as t reads it)
        for facade, entry in list(self._shards.items()):
            shard = entry.shard
            if shard.untyped_storage().nbytes() == 0 or shard.untyped_storage().data_ptr() != storage.data_ptr():
                continue
            if (shard.storage_offset(), shard.shape, shard.stride(), shard.dtype) == \
                    (t.storage_offset(), t.shape, t.stride(), t.dtype):
                return facade
            overlapping = overlapping or entry
        if overlapping is not None:
            raise UsageError(
                f"dynashard.full_tensor: this tensor (shape {list(t.shape)}) reads part of the memory of this rank's "
                f"shard of {overlapping.fqn!r} (shape {list(overlapping.shard.shape)}), so it has no whole value to "
                "gather. Expected the shard itself (named_parameters(), state_dict()), its facade, or a tensor of "
                "its own.")
        return None

    def checkpointable(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``local`` (``param``'s shard, a view of it, or a state of it of its shape) with DCP's checkpoint
        protocol (its pieces as chunks of ``param``'s global shape: dcp_planners.make_checkpointable) and
        its placement (placement.py), which torch.save keeps and a load checks."""
        from dynashard.weights.dcp_planners import make_checkpointable  # lazy: imports DCP, only to checkpoint

        spec = self._shards[param].spec
        pieces = spec.split.pieces(spec.world, spec.rank)
        where = None if spec.stacked else placement.describe(param.shape, spec.dim, pieces, spec.world, spec.rank)
        self._placed[local] = weakref.ref(param)
        return make_checkpointable(local, param.shape, spec.dim, pieces, where)

    def placed_facade(self, t: torch.Tensor) -> torch.Tensor | None:
        """The facade whose pieces ``t`` holds, if ``t`` was given its placement (checkpointable)."""
        ref = self._placed.get(t)
        return None if ref is None else ref()

    def placement(self, facade: torch.Tensor) -> dict:
        """This rank's placement of ``facade``'s pieces (placement.py)."""
        spec = self.entry_of(facade).spec
        return placement.describe(facade.shape, spec.dim, spec.split.pieces(spec.world, spec.rank), spec.world,
                                  spec.rank)

    def is_sharded(self, param: torch.Tensor) -> bool:
        return param in self._shards

    def note_read_whole(self, params: list[torch.Tensor]) -> None:
        """A compiled program reads these parameters whole (every call passes their full values)."""
        for p in params:
            if torch.is_tensor(p) and p not in self._shards:
                self._read_whole[p] = True

    def read_whole(self, param: torch.Tensor) -> bool:
        """Whether a compiled program reads ``param`` whole: cutting (and freeing) it would break it."""
        return param in self._read_whole

    def spec_of(self, param: torch.Tensor) -> ShardSpec | None:
        """How ``param`` was cut, if it was."""
        entry = self._shards.get(param)
        return None if entry is None else entry.spec

    def earlier_cuts(self, inputs: list[Any]) -> EarlierCuts:
        """What earlier compiles (or ``parallelize``) did to a graph's ``inputs``, by input slot."""
        split = {i: (self._shards[t].spec.dim, self._shards[t].spec.split) for i, t in enumerate(inputs)
                 if torch.is_tensor(t) and t in self._shards}
        whole = frozenset(i for i, t in enumerate(inputs) if torch.is_tensor(t) and t in self._read_whole)
        return EarlierCuts(split, whole)

    def shard(self, param: torch.Tensor, spec: ShardSpec, fqn: str, group: dist.ProcessGroup,
              source: Source | None = None) -> torch.Tensor:
        """This rank's shard of ``param`` (cut once; a second, different request is an error). A storage-less
        ``param`` with a ``source`` (``parallelize`` loading a checkpoint) is read from it, never whole.

        A stacked shard is a collective: every rank must ask for the same tensors in the same order.
        """
        entry = self._shards.get(param)
        if entry is not None:
            if not entry.spec.same_cut(spec):
                raise UsageError(
                    f"dynashard: {fqn!r} was sharded as {entry.spec} by dynashard.parallelize or an earlier "
                    f"compile, and this graph needs {spec}. Its full value was freed, so it cannot be re-split: "
                    "use the same plan and group for every compile of a model (and parallelize's options)."
                )
            return entry.shard
        if spec.stacked:
            (lengths,) = spec.split.lengths(spec.world)  # per_rank weights: one component
            shard = exchange_blocks(param, spec.dim, lengths, spec.rank, group)
        elif source is not None and is_storage_less(param):  # read from a checkpoint, never whole
            shard = source(param, spec)
        else:
            shard = cut(param.detach(), spec.dim, spec.split, spec.world, spec.rank)
            shard = shard.clone(memory_format=torch.contiguous_format)
        self._shards[param] = _Entry(spec, shard, fqn)
        return shard

    def trust(self, params: list[torch.Tensor]) -> None:
        """Values every rank read from one checkpoint: not compared across ranks again."""
        for p in params:
            self._agreed[p] = True

    def agree(
        self,
        named: list[tuple[str, torch.Tensor]],
        fingerprint: str,
        group: dist.ProcessGroup,
        mode: str,
        check_values: bool,
        error: BaseException | None = None,
    ) -> None:
        """One collective: every rank has the same plan and (for "replicated") the same weights.

        Raises the same error on every rank. With ``mode="rank0"`` the first rank's values then
        overwrite every other rank's, like DDP's initial broadcast. Values are only checked
        (``check_values``) when the graph shards something: a graph left whole computes each
        rank's own model, whatever its weights.
        """
        fresh = [(n, t) for n, t in named if t not in self._agreed and not self.is_sharded(t)]
        if (not check_values and mode == "replicated") or mode == "per_rank":
            fresh = []  # per_rank: every rank's weights are its own by design
        if error is not None:
            fresh = []
        sums = [(checksum(t), str(t.dtype).removeprefix("torch.")) for _, t in fresh] if mode == "replicated" else []
        everyone = exchange_status((fingerprint, sums), error, group, "planning")
        prints = [p for p, _ in everyone]
        if len(set(prints)) != 1:
            raise PeerError(
                "dynashard: ranks compiled different graphs or plans (plan fingerprints per rank: "
                f"{prints}). Every rank must run the same model on inputs of the same shapes and the "
                "same options; check for rank-dependent code or inputs."
            )
        if mode == "replicated":
            for i, (name, _) in enumerate(fresh):
                dtypes = [s[i][1] for _, s in everyone]
                if len(set(dtypes)) > 1:
                    found = ", ".join(f"{d} on rank {r}" for r, d in enumerate(dtypes))
                    raise UsageError(
                        f"dynashard: parameter {name!r} has dtype {found}. Expected the same dtype on every "
                        "rank with weights='replicated': convert the model the same way on every rank."
                    )
                per_rank = [s[i][0] for _, s in everyone]
                if any(not close(per_rank[0], s) for s in per_rank[1:]):
                    bad = [r for r, s in enumerate(per_rank) if not close(per_rank[0], s)]
                    raise UsageError(
                        f"dynashard: parameter {name!r} differs across ranks (ranks {bad} differ from "
                        "rank 0). Expected identical weights on every rank with weights='replicated'. "
                        "Seed every rank the same before building the model, load the same checkpoint, "
                        "or pass options={'weights': 'rank0'} to use rank 0's values."
                    )
        elif mode == "rank0":
            broadcast_from_first([t for _, t in fresh], group)
        for _, t in fresh:
            self._agreed[t] = True


def cut(full: torch.Tensor, dim: int, split: Split, world: int, rank: int) -> torch.Tensor:
    """Rank's pieces of ``full`` along ``dim``, side by side (a view when there is one piece)."""
    pieces = [full.narrow(dim, start, length) for start, length in split.pieces(world, rank)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


STORE = WeightStore()


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers that this rank holds.

    A weight dynashard sharded counts as its shard in :data:`STORE` (plus the full tensor, if its
    storage could not be freed because an unsharded tensor shares it); a DTensor counts as its
    local shard; a tensor subclass (torchao's quantized weights) as its inner tensors; anything else as
    its own bytes. Shared tensors are counted once.
    """
    from torch.distributed.tensor import DTensor

    total = 0
    # (a quantized weight, torchao's Int8Tensor: its inner int8 data and scales, each cut or whole)
    for t in [leaf for v in [*model.parameters(), *model.buffers()] for leaf in inner_tensors(v)]:
        if isinstance(t, DTensor):
            total += t.to_local().nbytes
            continue
        shard = STORE.shard_of(t)
        total += 0 if shard is None else shard.nbytes
        total += t.nbytes if t.untyped_storage().nbytes() else 0  # a freed weight's storage is empty
    return total
