"""``parallelize``'s loader: a model's parameters from a checkpoint (or rank 0's model), checked first.

Before anything changes, every rank opens the checkpoint (or rank 0 alone, with ``weights="rank0"``) and
the ranks agree: the same files (a fingerprint of headers, sizes, sampled bytes), every name and shape
fitting the model. Then the model's parameters become storage-less facades, and the backend
``parallelize`` runs reads each one through the loader (``dynashard_backend(..., source=loader)``): this
rank's pieces of a cut weight, all of a weight read whole; the ranks compare digests of what they read
whole. A failed load restores the model as it was.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dynashard import _torch as private
from dynashard.comm.protocol import agreed
from dynashard.comm.transport import deal_from_first
from dynashard.errors import UsageError
from dynashard.load import adapters
from dynashard.load.checkpoint import Beside, TensorsCheckpoint, open_checkpoint, owning
from dynashard.load.integrity import digest, disagreement
from dynashard.load.loader_quantized import is_quantized, mismatch, saved_keys, with_facades
from dynashard.weights.freed import mark_storage_less
from dynashard.weights.store import STORE, ShardSpec


class Loader:
    """Values for a model's parameters from a checkpoint, checked against the model before anything
    changes, then read a piece at a time (the ``source`` parallelize hands its backend).

    With ``weights="rank0"`` only rank 0 reads -- its checkpoint, or the weights its own model holds
    -- and deals every rank its pieces (``transport.deal_from_first``); every parameter becomes a
    facade on every rank, and the persistent buffers rank 0 has are sent whole.
    """

    def __init__(self, model: nn.Module, path: Any, device: torch.device, group: dist.ProcessGroup,
                 from_first: bool) -> None:
        self.model, self.device, self.group, self.from_first = model, device, group, from_first
        self.rank = dist.get_rank(group)
        reads = not from_first or self.rank == 0
        self.ck, table, identity = None, None, ""
        self.whole: dict[str, str] = {}  # name -> digest of each tensor this rank read whole (every rank reads it)
        with agreed(group, "opening the checkpoint") as point:
            try:
                if reads and path is not None:
                    self.ck = open_checkpoint(path)
                    identity = self.ck.fingerprint()
                elif reads:  # weights="rank0", rank 0 holding the model: its own tensors are the source
                    named = [*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)]
                    self.ck = TensorsCheckpoint(dict(named), "rank 0's model")
                if self.ck is not None:
                    table = {k: (tuple(self.ck.shape(k)), self.ck.dtype(k)) for k in self.ck.keys()}
                if reads and from_first and path is not None and adapters.is_peft_model(model):  # (dealt too)
                    table = self._beside(adapters.initial_adapters(model, torch.initial_seed() % 2**63), table)
            except OSError as e:
                raise UsageError(f"dynashard.parallelize: reading {path}: {e}") from e
            point.payload = (table, identity, torch.initial_seed())
        everyone = point.everyone
        if path is not None and not from_first and adapters.is_peft_model(model):  # (built on meta: adapters to make)
            with agreed(group, "initialising the LoRA adapters the checkpoint does not hold"):
                made = adapters.initial_adapters(model, everyone[0][2] % 2**63)  # (rank 0's seed: alike everywhere)
            table = self._beside(made, table)
        table = everyone[0][0] if from_first else table
        self.where = self.ck.path if self.ck is not None else "rank 0's checkpoint"
        differ = None if from_first else disagreement([e[1] for e in everyone], "read a checkpoint")
        if differ:  # (the same on every rank: every rank raises)
            raise UsageError(
                f"dynashard.parallelize: {differ} (their files' sizes, headers or data differ; digests per rank: "
                f"{[e[1] for e in everyone]}), from {self.where} on this rank. Expected the same checkpoint on "
                "every rank (a stale copy on one node?). Nothing was changed.")
        self.names: dict[int, str] = {}  # parameter or buffer id -> its name in the checkpoint
        with agreed(group, "checking the checkpoint against the model"):
            self._match(table)
        unused = sorted(set(table) - set(self.names.values()))
        if unused and self.rank == 0 and path is not None:
            warnings.warn(f"dynashard.parallelize: {len(unused)} tensor(s) in {self.where} are not in the model "
                          f"and were not read: {unused[:5]}", UserWarning, stacklevel=3)

    def _beside(self, made: dict[str, torch.Tensor], table: dict) -> dict:
        """The checkpoint read with ``made`` beside it (PEFT's initial adapters), those it does not hold itself;
        ``table`` with them."""
        made = {k: v for k, v in made.items() if k not in table}
        if not made:
            return table
        self.ck = Beside(self.ck, TensorsCheckpoint(made, "PEFT's initial adapters"))
        return {**table, **{k: (tuple(v.shape), v.dtype) for k, v in made.items()}}

    def _match(self, table: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Which checkpoint tensor each parameter (and buffer to fill) reads; every mismatch at once."""
        model = self.model
        persistent = set(model.state_dict().keys())
        problems: list[str] = []
        tensors = [(n, t) for n, t in model.named_parameters(remove_duplicate=False)]
        tensors += [(n, t) for n, t in model.named_buffers(remove_duplicate=False)
                    if t.is_meta or (self.from_first and n in table)]
        for name, t in tensors:
            if id(t) in self.names:
                continue
            if is_quantized(t):  # (torchao's: its inner tensors, saved flattened: loader_quantized.py)
                problems += self._match_quantized(name, t, table)
                continue
            owners = [n for n, u in tensors if u is t]
            found = next((n for n in owners if n in table), None)
            if found is None:  # a PEFT model's base parameter, as its base model's checkpoint names it
                found = next((b for n in owners if (b := adapters.base_name(n)) in table), None)
            if found is None:
                if not any(n in persistent for n in owners):
                    problems.append(f"{name!r} is a non-persistent buffer left on the meta device (build the model "
                                    "under dynashard.empty_weights(), which puts only parameters on meta)")
                else:
                    problems.append(f"{name!r} is not in the checkpoint")
                continue
            shape, dtype = table[found]
            if tuple(shape) != tuple(t.shape):
                problems.append(f"{name!r} is saved with shape {list(shape)}, the model has {list(t.shape)}")
            elif dtype.is_floating_point != t.dtype.is_floating_point:
                problems.append(f"{name!r} is saved as {dtype}, the model has {t.dtype}")
            else:
                self.names[id(t)] = found
        if problems:
            more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
            raise UsageError(f"dynashard.parallelize: the checkpoint {self.where} does not fit the model: "
                             f"{'; '.join(problems[:5])}{more}. Expected a checkpoint saved from this model's "
                             "architecture and config. Nothing was changed.")

    def _match_quantized(self, name: str, t: torch.Tensor, table: dict) -> list[str]:
        if self.from_first:
            return [f"{name!r} is a quantized {type(t).__name__}, which weights='rank0' does not deal (rank 0 would "
                    "send plain tensors); save the quantized model with save_pretrained and pass checkpoint=DIR on "
                    "every rank with the default weights='replicated'"]
        if not any(key in table for _, key in saved_keys(name, t)) and adapters.base_name(name) is not None:
            name = adapters.base_name(name)  # (a PEFT model's quantized base, as its base model's checkpoint names it)
        found = [(inner, key) for inner, key in saved_keys(name, t) if key in table]
        if not found:
            return [f"{name!r} is a quantized {type(t).__name__} in the model, and the checkpoint holds none of "
                    f"{[k for _, k in saved_keys(name, t)]}: quantize the model as the checkpoint was (HF's "
                    "TorchAoConfig leaves lm_head and the embeddings float: quantize_(..., filter_fn=...)), or save "
                    "a float checkpoint quantized with TorchAoConfig and save_pretrained"]
        problems = [f"{name!r}'s {inner} is not in the checkpoint (expected {key!r})"
                    for inner, key in saved_keys(name, t) if key not in table]
        for inner, key in found:
            shape, dtype = table[key]
            mine = getattr(t, inner)
            if tuple(shape) != tuple(mine.shape) or dtype != mine.dtype:
                problems.append(f"{key!r} is saved as {dtype} {list(shape)}, the model's {name}.{inner} is "
                                f"{mine.dtype} {list(mine.shape)} (quantized with another config?)")
        why = mismatch(name, t, self.ck.metadata)
        problems += [why] if why is not None else []
        if not problems:
            for inner, key in found:
                self.names[id(getattr(t, inner))] = key
            self.names[id(t)] = name
        return problems

    def make_facades(self) -> None:
        """Parameters to load become storage-less tensors on the device (what a graph traces and the
        store keys shards by); buffers to load are read whole."""
        made: dict[int, torch.Tensor] = {}
        trusted: list[torch.Tensor] = []
        self.replaced: list[tuple[dict, str, torch.Tensor]] = []  # (module's dict, name, tensor it held)
        for module in self.model.modules():
            for attr, p in list(private.parameter_slots(module).items()):
                if p is None or not (p.is_meta or self.from_first):
                    continue
                self.replaced.append((private.parameter_slots(module), attr, p))
                if id(p) not in made and is_quantized(p):  # (its inner tensors the facades: loader_quantized.py)
                    made[id(p)], inner = with_facades(p, self._storage_less)
                    for facade, meta in inner:
                        mark_storage_less(facade)
                        self.names[id(facade)] = self.names[id(meta)]
                        trusted.append(facade)
                if id(p) not in made:
                    facade = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                          requires_grad=p.requires_grad)
                    facade.untyped_storage().resize_(0)  # (empty: its pages were never touched)
                    mark_storage_less(facade)
                    self.names[id(facade)] = self.names[id(p)]
                    made[id(p)] = facade
                private.parameter_slots(module)[attr] = made[id(p)]
            for attr, b in list(private.buffer_slots(module).items()):
                if b is not None and id(b) in self.names:
                    self.replaced.append((private.buffer_slots(module), attr, b))
                    private.buffer_slots(module)[attr] = self(b, None)
        STORE.trust([*made.values(), *trusted])  # every rank has the same values (one file, or rank 0's)

    def _storage_less(self, t: torch.Tensor) -> torch.Tensor:
        """An empty tensor of ``t``'s shape and dtype on the device, no bytes (its pages never touched)."""
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        out.untyped_storage().resize_(0)
        return out

    def agree_on_what_was_read_whole(self) -> None:
        """Every rank read the tensors it holds whole (norms, biases, whatever stays replicated) with the
        same bytes; raised on every rank otherwise (the checkpoint changed under one of them)."""
        if self.from_first:
            return
        with agreed(self.group, "comparing what was read") as point:
            point.payload = sorted(self.whole.items())
        everyone = point.everyone
        differ = disagreement(everyone, "read tensors")
        if differ:
            first = dict(everyone[0])
            names = sorted({n for per in everyone[1:] for n, d in per if first.get(n) != d})
            raise UsageError(f"dynashard.parallelize: {differ} from {self.where} ({names[:5]}): the checkpoint differs "
                             "across ranks. Expected the same checkpoint on every rank. The model was put back.")

    def restore(self) -> None:
        """The tensors the model held back in place, after a failed run (its shards are dropped)."""
        for where, attr, meta in reversed(getattr(self, "replaced", [])):
            where[attr] = meta

    def __call__(self, t: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
        """``t``'s pieces for this rank under ``spec`` (all of it when None), from the checkpoint."""
        name = self.names[id(t)]
        shape = list(t.shape)
        # (a meta buffer lands where the facades are; under rank 0's deal every tensor does, buffers too)
        device = self.device if t.is_meta or self.from_first else t.device
        if spec is not None:
            shape[spec.dim] = sum(length for _, length in spec.split.pieces(spec.world, spec.rank))

        def read(rank: int | None) -> torch.Tensor:
            try:
                if spec is None:
                    return self.ck.read(name, dtype=t.dtype, device=device)
                return self.ck.read(name, spec.dim, spec.split.pieces(spec.world, rank), dtype=t.dtype, device=device)
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - an I/O error, a file changed under us
                raise UsageError(f"dynashard.parallelize: reading {name!r} from {self.where} failed: "
                                 f"{type(e).__name__}: {e}. Expected a readable, complete checkpoint; nothing "
                                 "was changed: fix it and call parallelize again.") from e

        with private.real_tensors():  # (called inside the backend, where Dynamo's fake mode is on)
            if not self.from_first:
                value = read(None if spec is None else spec.rank)
                if spec is None:
                    self.whole[name] = digest(value)
            else:
                value = deal_from_first(read, shape, t.dtype, device, self.group,
                                        f"reading {name!r} from {self.where}", whole=spec is None)
            return owning(value.to(device))  # (exactly its bytes, whatever the reader returned)
