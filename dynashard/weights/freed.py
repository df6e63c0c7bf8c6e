"""Storages dynashard freed: copies and saves of them refused (a facade answers everything else).

Before: a full-shape tensor whose storage dynashard freed (a cut weight) or never filled (a
parameter ``parallelize`` reads later). After :func:`mark_storage_less`: a facade, whose
``copy.deepcopy`` and ``torch.save`` raise a UsageError naming the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from dynashard.errors import UsageError


def is_storage_less(t: torch.Tensor) -> bool:
    """A tensor with elements and no bytes: a facade, or a parameter parallelize has not read yet."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


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
    from dynashard.weights.facades import become, is_facade

    become(t)  # a Facade: eager use answered
    if not is_facade(t):  # (a subclass of the model's own keeps its class: copies and saves refused at least)
        t.__deepcopy__ = _refuse_deepcopy
    setattr(t.untyped_storage(), FREED, True)
    if not _SAVE_REFUSAL:
        torch.serialization.register_package(-100, _refuse_saving, _no_location)
        _SAVE_REFUSAL.append(True)


SAVE_REFUSED = (
    "dynashard: cannot save this tensor: dynashard sharded it and freed its full values (this rank holds "
    "only its shard), so torch.save would write an empty storage. Expected a checkpoint of the shards: "
    "dynashard.parallelize(model, ...), then dcp.save(model.state_dict(), checkpoint_id=path) "
    "(torch.distributed.checkpoint, loadable at any world size); or the whole weights in one file with "
    "dynashard.export_safetensors(model, path), which works after a plain compile too.")


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
