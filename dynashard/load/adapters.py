"""PEFT adapters of a parallelized model: saved whole, all of them cut, merged on the shards.

``save_pretrained`` gathers, rank 0 writes.

Before: after ``parallelize``, a PEFT model's ``state_dict()`` holds this rank's pieces of every cut
adapter weight (B of a colwise layer: its rows; A of a rowwise layer: its columns), and PEFT's
``save_pretrained`` writes them under the whole tensors' names on every main process: an adapter
that is wrong without a word (``lora_B`` ``[32, 4]`` for ``[64, 4]`` at world 2).
After: ``parallelize`` gives every PEFT model in the module tree its own ``save_pretrained``: called on
every rank (a collective, like HF's save under tensor parallelism), it gathers the whole value of each
cut tensor PEFT keeps (the adapters' weights, embedding layers it saves) and lets PEFT write them on
rank 0 (``is_main_process`` unless given). Every other tensor is written as PEFT writes it. Anything
PEFT would still write as a piece is refused before a file is written.

Several adapters: ``parallelize``'s example runs with every adapter of each PEFT model active
(:func:`every_adapter_active`), so each is planned, cut by its base layer and registered, whichever is
active later (an adapter no graph read would stay whole, and one a later compile cut would be held by no
parameter: its training refused); the active adapters and ``requires_grad`` are restored afterwards.

Merging after ``parallelize`` (:func:`_on_shards`): PEFT's own ``merge`` / ``unmerge`` / ``merge_and_unload`` run
with the layers' parameters read as this rank's shards, where each adapter is cut by its base (then ``B @ A`` of
the shards is this rank's part of the whole product); any other layout is refused before anything changes.

PEFT is not imported here unless a PEFT model is found (it is a test dependency only).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dynashard import state
from dynashard._torch.subclass import is_traceable_subclass
from dynashard.comm.protocol import peer_guard
from dynashard.errors import UsageError
from dynashard.layout import placement
from dynashard.load.registered import FACADES
from dynashard.weights.facades import full_tensor
from dynashard.weights.store import STORE

log = logging.getLogger(__name__)

_STAGE = ("saving a PEFT adapter: PeftModel.save_pretrained of a parallelized model gathers the cut adapter weights, "
          "so every rank calls it (rank 0 writes; is_main_process=rank == 0 by default)")


def is_peft_model(module: nn.Module) -> bool:
    """A ``PeftModel`` (its class defines ``save_pretrained``; PEFT's tuner models only forward it)."""
    return type(module).__module__.startswith("peft.") and isinstance(getattr(module, "peft_config", None), dict) \
        and callable(getattr(type(module), "save_pretrained", None))


_PEFT_PREFIX = "base_model.model."  # (a PeftModel's parameter names: its tuner model's ``model`` is the base)


def base_name(name: str) -> str | None:
    """The name a PEFT model's parameter ``name`` has in its base model's checkpoint (``base_model.model.`` off the
    front, ``.base_layer`` out: ``base_model.model.model.layers.0.q_proj.base_layer.weight`` ->
    ``model.layers.0.q_proj.weight``); None for a name of no PeftModel."""
    if not name.startswith(_PEFT_PREFIX):
        return None
    return name[len(_PEFT_PREFIX):].replace(".base_layer.", ".")


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT model built on meta (``get_peft_model`` under ``empty_weights``): each LoRA parameter on meta made
    on the CPU and initialised by PEFT's own ``reset_lora_parameters``, under a generator seeded with ``seed``
    (the same on every rank: the same values), by its name in ``model``. The meta parameters stay in place: the
    loader reads these values as a checkpoint's. Only initialisations that do not read the base weights
    (``init_lora_weights=True`` or ``"gaussian"``); any other is refused, naming the fix."""
    if not is_peft_model(model):
        return {}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    made: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in model.modules():
            if not (hasattr(layer, "lora_A") and callable(getattr(layer, "reset_lora_parameters", None))):
                continue
            for adapter in sorted({*layer.lora_A, *getattr(layer, "lora_embedding_A", {})}):
                slots = _adapter_slots(layer, adapter)
                if not any(getattr(holder, attr).is_meta for holder, attr in slots):
                    continue
                init = model.peft_config[adapter].init_lora_weights
                if getattr(layer, "use_dora", {}).get(adapter, False):
                    raise UsageError(
                        f"dynashard.parallelize: adapter {adapter!r} of this PEFT model is a DoRA adapter on the meta "
                        "device: its magnitude starts as the norm of the base weight's rows, which the base "
                        "checkpoint holds but the model does not yet. Expected a LoRA adapter (use_dora=False), or "
                        "the adapter's values loaded after parallelize (model.load_adapter(path, ...)).")
                if init is not True and init != "gaussian":
                    raise UsageError(
                        f"dynashard.parallelize: adapter {adapter!r} of this PEFT model is on the meta device with "
                        f"init_lora_weights={init!r}, which reads the base weights (or is left to nn.Linear); only "
                        "True and 'gaussian' are initialised here. Expected init_lora_weights=True or 'gaussian', or "
                        "the adapter's values loaded after parallelize (model.load_adapter(path, ...)).")
                metas = [(holder, attr, getattr(holder, attr)) for holder, attr in slots]
                try:
                    for holder, attr, meta in metas:  # (PEFT's init writes into real tensors, then put back)
                        setattr(holder, attr, nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype),
                                                           requires_grad=meta.requires_grad))
                    layer.reset_lora_parameters(adapter, init)
                    for holder, attr, meta in metas:
                        made[names[id(meta)]] = getattr(holder, attr).detach()
                finally:
                    for holder, attr, meta in metas:
                        setattr(holder, attr, meta)
    return made


def _adapter_slots(layer: nn.Module, adapter: str) -> list[tuple[Any, str]]:
    """(holder, attribute) of each parameter of ``adapter`` on a LoRA ``layer``."""
    slots: list[tuple[Any, str]] = []
    for table in ("lora_A", "lora_B"):
        module = getattr(layer, table)[adapter] if adapter in getattr(layer, table) else None
        slots += [(module, attr) for attr in ("weight", "bias")
                  if module is not None and getattr(module, attr, None) is not None]
    for table in ("lora_embedding_A", "lora_embedding_B"):
        if adapter in getattr(layer, table, {}):
            slots.append((getattr(layer, table), adapter))
    return slots


@contextlib.contextmanager
def every_adapter_active(model: nn.Module) -> Iterator[None]:
    """Every adapter of each PEFT model in ``model`` active inside the block (PEFT's tuner
    ``set_adapter([...])``: several active adapters chain their adds, each cut by its base); after
    it, each tuner's active adapters and every parameter's ``requires_grad`` as they were. A model
    whose adapters PEFT cannot activate together (``modules_to_save`` takes one) is left as it is."""
    grads = {p: p.requires_grad for p in model.parameters()}
    changed = []
    for tuner in (m.base_model for m in model.modules() if is_peft_model(m)):
        names, before = list(tuner.peft_config), getattr(tuner, "active_adapter", None)
        active = [before] if isinstance(before, str) else list(before or ())
        if set(active) >= set(names) or not callable(getattr(tuner, "set_adapter", None)):
            continue
        try:
            tuner.set_adapter(names)
        except ValueError as e:  # (PEFT's own refusal; the adapters that stay inactive stay whole)
            log.debug("dynashard: PEFT cannot activate the adapters %s together (%s); planning the active %s only",
                      names, e, active)
            tuner.set_adapter(before)
            continue
        changed.append((tuner, before))
    try:
        yield
    finally:
        for tuner, before in changed:
            tuner.set_adapter(before)
        for p, wanted in grads.items():
            p.requires_grad_(wanted)


def install(model: nn.Module, group: dist.ProcessGroup) -> list[nn.Module]:
    """Every PEFT model in ``model`` (itself included) saves whole adapters; returns them."""
    found = [m for m in model.modules() if is_peft_model(m)]
    for m in found:
        m.save_pretrained = _whole_saver(m, type(m).save_pretrained.__get__(m), group)
        m.base_model.merge_and_unload = _on_shards(type(m.base_model).merge_and_unload.__get__(m.base_model), None)
        for layer in m.modules():  # (merge_adapter, unmerge_adapter, merge_and_unload: each tuner layer's)
            if type(layer).__module__.startswith("peft.") and hasattr(layer, "get_delta_weight"):
                layer.merge = _on_shards(type(layer).merge.__get__(layer), layer)
                layer.unmerge = _on_shards(type(layer).unmerge.__get__(layer), layer)
    return found


def merging() -> bool:
    """Inside a merge of a parallelized model's LoRA layers: their parameters read as this rank's shards."""
    return getattr(state.MERGING, "on", False)


def _on_shards(original: Any, layer: nn.Module | None) -> Any:
    """PEFT's ``merge`` / ``unmerge`` (``layer``'s), or ``merge_and_unload``, run on this rank's shards: where each
    adapter is cut by its base (colwise: B's rows with the base's, A whole; rowwise: A's columns with the base's,
    B whole; or all whole), ``B @ A`` of the shards is the base shard's part of the whole ``B @ A``, so PEFT's own
    merge of the shards is the unsharded merge's, cut. Any other layout is refused before anything changes."""

    def run(*args: Any, **kwargs: Any) -> Any:
        layers = [layer] if layer is not None else [t for t in original.__self__.modules() if hasattr(t, "lora_A")
                                                    and hasattr(t, "get_delta_weight")]
        if original.__name__ == "unmerge":
            layers = [t for t in layers if t.merged]  # (nothing to unmerge: PEFT only warns)
        for t in layers:
            why = _unmergeable(t)
            if why is not None:
                raise UsageError(f"dynashard: merging the LoRA adapters of a parallelized layer: {why}. Expected "
                                 "merge_adapter() or merge_and_unload() before dynashard.parallelize (a merged adapter "
                                 "is a plain linear, cut like its base), or the adapters kept unmerged.")
        state.MERGING.on = True
        try:
            return original(*args, **kwargs)
        finally:
            state.MERGING.on = False

    return run


def _unmergeable(layer: nn.Module) -> str | None:
    """Why ``layer``'s adapters cannot be merged shard by shard (None: they can)."""
    if getattr(layer, "fan_in_fan_out", False) or any(getattr(layer, "lora_variant", {}).values()) \
            or any(getattr(layer, "lora_bias", {}).values()):
        return "fan_in_fan_out, a LoRA variant (DoRA, ...) or lora_bias, whose merge is not a product of the shards"
    base = _cut(layer.get_base_layer())
    if base != (None,) and len(getattr(layer, "lora_embedding_A", {})):
        return ("an embedding's adapter, whose A and B are held whole (match_adapters.py): its merge is the whole "
                "[vocabulary, hidden] product, which a cut embedding holds only part of")
    weight = getattr(layer.get_base_layer(), "weight", None)
    if is_traceable_subclass(weight) and any((_cut(layer.lora_A[n]), _cut(layer.lora_B[n])) != ((None,), (None,))
                                             for n in layer.lora_A):
        return (f"its base's weight is quantized ({type(weight).__name__}): PEFT's merge dequantizes it, adds B @ A "
                "and quantizes again, and scales computed from this rank's part of the weight are not the "
                "unsharded merge's")
    for name in layer.lora_A:
        a, b = _cut(layer.lora_A[name]), _cut(layer.lora_B[name])
        if not (base == a == b == (None,) or (base[0] == 0 and (a, b) == ((None,), base))
                or (base[0] == 1 and (a, b) == (base, (None,)))):
            return f"adapter {name!r} is not cut by its base layer's style (base {base}, A {a}, B {b})"
    return None


def _cut(module: nn.Module) -> tuple:
    """``(dim, each rank's ranges)`` of ``module.weight``'s cut, ``(None,)`` where it is held whole."""
    facade = module.__dict__.get(FACADES, {}).get("weight")
    spec = None if facade is None else STORE.spec_of(facade)
    if spec is None:
        return (None,)
    return spec.dim % facade.dim(), tuple(map(tuple, spec.split.owned(spec.world)))


def _whole_saver(model: nn.Module, original: Any, group: dist.ProcessGroup) -> Any:
    def save_pretrained(save_directory: str, *args: Any, **kwargs: Any) -> Any:
        """PEFT's ``save_pretrained`` with every cut tensor it keeps gathered whole (on every rank: a
        collective); written by rank 0 unless ``is_main_process`` is given."""
        kwargs.setdefault("is_main_process", dist.get_rank(group) == 0)
        if kwargs.get("state_dict") is None:
            with peer_guard(group, _STAGE):
                kwargs["state_dict"] = whole_adapter_state(model, kwargs.get("selected_adapters"),
                                                           kwargs.get("save_embedding_layers", "auto"))
        return original(save_directory, *args, **kwargs)

    save_pretrained.__doc__ = (save_pretrained.__doc__ or "") + "\n\n" + (original.__doc__ or "")
    return save_pretrained


def whole_adapter_state(model: nn.Module, selected: list[str] | None = None,
                        save_embedding_layers: Any = "auto") -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with the whole value of each cut tensor PEFT would save (every rank
    calls it, in the same order: the gathers are collectives). Raises, before anything is written,
    if PEFT would still save a piece of a tensor."""
    from peft.utils import get_peft_model_state_dict

    state = model.state_dict()
    adapters = list(selected or model.peft_config)

    def kept(sd: dict) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name in adapters:
            out.update(get_peft_model_state_dict(model, state_dict=sd, adapter_name=name,
                                                 save_embedding_layers=save_embedding_layers))
        return out

    wanted = {id(t) for t in kept(state).values() if isinstance(t, torch.Tensor)}
    whole = {k: full_tensor(v) if id(v) in wanted and placement.of(v) is not None else v for k, v in state.items()}
    pieces = sorted(k for k, v in kept(whole).items() if placement.of(v) is not None)
    if pieces:
        raise UsageError(
            f"dynashard: PEFT's save_pretrained would write {pieces[:3]} as this rank's pieces (found no whole value "
            "for them). Expected adapter tensors PEFT keeps by their state_dict() names; save with "
            "dynashard.export_safetensors(model, path) or dcp.save(model.state_dict(), checkpoint_id=path) instead.")
    return whole
