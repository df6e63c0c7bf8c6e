"""Optimizers over what dynashard cut: one over freed weights refused, a shard's state checkpointable.

One process-wide step pre-hook (``register_optimizer_step_pre_hook``), registered when dynashard frees a
weight and removed when the last weight it freed is gone (:class:`FreedWeights`), so no optimizer pays
for it outside that lifetime. At an optimizer's step it

- refuses an optimizer that holds a full-size parameter dynashard cut and freed: the gradients go to
  this rank's shard, so that optimizer would train nothing, silently (pytorch/examples #1324);
- gives an optimizer that holds shards (the parameters ``parallelize`` registered) a state_dict
  pre-hook of its own, once: the state of a shard (``exp_avg``, momentum: tensors of its shape) is this
  rank's pieces of the global state, and gets the shard's DCP protocol whenever the state is read
  (``optimizer.state_dict()``, DCP's ``get_state_dict``), so ``dcp.save`` writes it at its global offsets.

NOTE: torch 2.13 has no hook on an optimizer's construction, and dynashard is never handed the
optimizer; the process-wide step pre-hook is the one place it sees one, before its first update.
It lives only while a freed weight does, and then costs an optimizer one lookup per parameter per step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dynashard import _torch as private
from dynashard.errors import UsageError
from dynashard.layout import placement
from dynashard.training import fsdp
from dynashard.weights.store import STORE


class FreedWeights:
    """The weights dynashard freed that are still alive, and the step hook that lives while one is."""

    def __init__(self) -> None:
        self._alive = private.weak_id_dict()  # freed weight -> True
        self._count = 0  # of those alive: finalizers count down (a weak dictionary's len lags behind)
        self._hook: Any = None  # the process-wide step pre-hook's handle, while registered
        self._described: weakref.WeakSet = weakref.WeakSet()  # optimizers given their state_dict hook

    @property
    def hooked(self) -> bool:
        return self._hook is not None

    def add(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if p in self._alive:
                continue
            self._alive[p] = True
            self._count += 1
            weakref.finalize(p, self._gone).atexit = False
        if self._count and self._hook is None:
            self._hook = register_optimizer_step_pre_hook(self._at_step)

    def _gone(self) -> None:
        self._count -= 1
        if self._count == 0 and self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _at_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        holds_shards = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if STORE.is_sharded(p) and p.untyped_storage().nbytes() == 0:
                    raise UsageError(
                        f"dynashard: {type(optimizer).__name__} holds a full-size parameter of shape {list(p.shape)} "
                        "that dynashard sharded and freed; its gradients go to this rank's shard, so this "
                        "optimizer would train nothing. Expected the optimizer built after "
                        "dynashard.parallelize(model, example_inputs), over model.parameters() (the shards); "
                        "layers added after parallelize (PEFT's get_peft_model or load_adapter) are cut by the "
                        "compile but not registered: attach adapters before parallelize to train them."
                    )
                facade = STORE.facade_of(p)
                if facade is not None:
                    _check_state(optimizer, p, facade)
                holds_shards = holds_shards or facade is not None or fsdp.is_fused(p)
        if holds_shards and optimizer not in self._described:
            optimizer.register_state_dict_pre_hook(describe_state)
            self._described.add(optimizer)


def _check_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, facade: torch.Tensor) -> None:
    """The state of shard ``p`` holds this rank's pieces: one loaded from another rank's
    ``optimizer.state_dict()`` carries that rank's placement, and is refused before it updates anything."""
    mine = None
    for key, value in optimizer.state.get(p, {}).items():
        placed = placement.of(value)
        if placed is None:
            continue
        mine = mine or STORE.placement(facade)
        if [placed[k] for k in ("shape", "dim", "pieces")] != [mine[k] for k in ("shape", "dim", "pieces")]:
            raise UsageError(
                f"dynashard: {type(optimizer).__name__}'s state {key!r} of a shard holds {placement.words(placed)}, "
                f"and this rank holds {placement.words(mine)}: an optimizer.state_dict() saved on another rank "
                f"(or at another world size) was loaded. Nothing was updated. Expected get_state_dict(model, "
                f"optimizer, options=StateDictOptions(full_state_dict=True)) saved on one rank and loaded with "
                f"set_state_dict(..., options=StateDictOptions(full_state_dict=True)), dcp.save / dcp.load of "
                f"get_state_dict(model, optimizer), or each rank's own file.")


def describe_state(optimizer: torch.optim.Optimizer) -> None:
    """Each shard's optimizer state gets the shard's DCP protocol (a plain local tensor would be saved
    as if it were the whole state)."""
    for p, state in optimizer.state.items():
        if fsdp.is_fused(p):  # (parallelize(dtensor=True): exp_avg is a DTensor of the parameter's layout)
            for value in state.values():
                fsdp.checkpointable(value)
            continue
        facade = STORE.facade_of(p)
        if facade is None:
            continue
        for value in state.values():
            if (
                isinstance(value, torch.Tensor)
                and value.shape == p.shape
                and not hasattr(value, "__create_chunk_list__")
            ):
                STORE.checkpointable(facade, value)


FREED = FreedWeights()
