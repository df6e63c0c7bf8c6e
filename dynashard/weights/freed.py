"""Storages dynashard frees and fills: a cut weight's full tensor made a facade, and back.

Before: a full-shape tensor whose storage dynashard freed (a cut weight: :func:`free`), never filled (a
parameter ``parallelize`` reads later) or made for a shard a program allocated (:func:`hold`). After
:func:`mark_storage_less`: a facade (facades.py), whose ``copy.deepcopy`` and ``torch.save`` raise a
UsageError naming the fix. :func:`materialize` fills one a graph reads whole and makes it a plain tensor.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dynashard import _torch as private
from dynashard.errors import UsageError
from dynashard.weights.facades import SAVE_REFUSED, become, is_facade, storage_less, unbecome
from dynashard.weights.store import STORE, ShardSpec, Source, is_storage_less

log = logging.getLogger(__name__)
FREED = "_dynashard_freed"  # set on the (preserved) Python object of a storage dynashard freed
_SAVE_REFUSAL: list[bool] = []  # the tagger refusing such storages is registered (on the first one, not on import)


def mark_storage_less(t: torch.Tensor) -> None:
    """Make copying or saving ``t``, a full-shape tensor whose storage dynashard freed (or never
    filled), raise a UsageError naming the fix: ``copy.deepcopy`` of it kills the process (pytorch's
    C++ reads the missing bytes), and ``torch.save`` (``model.state_dict()``'s detached views, pickle)
    would write an empty storage without a word, a file that fails only when loaded. The copy is
    refused by ``t`` itself; the save by its storage, which every view and ``detach()`` shares, through
    a storage tagger registered here the first time (``torch.serialization``'s are process-wide). Eager
    math on ``t`` cannot be refused this way (the table in docs/facades.md)."""
    become(t)  # a Facade: eager use answered
    if not is_facade(t):  # (a subclass of the model's own keeps its class: copies and saves refused at least)
        t.__deepcopy__ = _refuse_deepcopy
    setattr(t.untyped_storage(), FREED, True)
    if not _SAVE_REFUSAL:
        torch.serialization.register_package(-100, _refuse_saving, _no_location)
        _SAVE_REFUSAL.append(True)


def _refuse_saving(storage: Any) -> None:
    """A ``torch.serialization`` location tagger, asked first for every storage ``torch.save`` writes:
    refuses a storage dynashard freed, passes every other on (None: the next tagger names its device)."""
    if getattr(storage, FREED, False) and storage.nbytes() == 0:
        raise UsageError(SAVE_REFUSED)


def _no_location(storage: Any, location: str) -> None:
    return None  # (loading: never ours, the next deserializer restores it)


def _refuse_deepcopy(memo: dict) -> None:
    raise UsageError(
        "dynashard: cannot copy this model: dynashard sharded its weights and freed their full values (copying "
        "a tensor without storage would kill the process). Expected the copy made before torch.compile or "
        "dynashard.parallelize, e.g. reference = copy.deepcopy(model) first.")


def free(params: list[torch.Tensor], keep: list[torch.Tensor]) -> int:
    """Release the storage of sharded ``params`` unless something in ``keep`` shares it."""
    kept = {t.untyped_storage().data_ptr() for t in keep}
    freed = 0
    for p in params:
        storage = p.untyped_storage()
        if storage.nbytes() == 0:
            mark_storage_less(p)  # (a facade made storage-less by parallelize)
            continue
        if storage.data_ptr() in kept:
            log.debug("not freeing a sharded weight: its storage is shared with an unsharded tensor")
            continue
        freed += storage.nbytes()
        if storage.resizable():
            storage.resize_(0)
        else:  # memory-mapped (HF from_pretrained maps safetensors files): let go of the mapping instead
            with private.real_tensors():
                empty = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
            empty.untyped_storage().resize_(0)  # (its pages never touched)
            p.data = empty  # the same Parameter object (Dynamo's guards, the user's references), no storage
        mark_storage_less(p)
    return freed


def hold(local: torch.Tensor, shape: torch.Size, spec: ShardSpec, name: str) -> torch.Tensor:
    """A shard a compiled program made (a cache it allocated at this rank's size): a storage-less
    full-shape facade, by which later graphs find the shard as they find a cut weight's."""
    facade = storage_less(shape, local.dtype, local.device)
    mark_storage_less(facade)
    STORE.add_held(facade, spec, local, name)
    STORE.trust([facade])  # every rank made it by one program
    return facade


def materialize(params: list[torch.Tensor], source: Source) -> None:
    """Storage-less ``params`` a graph reads whole (replicated), filled from ``source``."""
    for p in params:
        if is_storage_less(p) and not STORE.is_sharded(p):
            value = source(p, None)
            p.untyped_storage().resize_(p.numel() * p.element_size())  # (a contiguous facade, offset 0)
            p.__dict__.pop("__deepcopy__", None)  # whole again: copies and saves like any tensor
            p.untyped_storage().__dict__.pop(FREED, None)
            unbecome(p)  # (first: a facade's copy_ writes into its shard, and this one has none)
            with torch.no_grad():
                p.copy_(value)
