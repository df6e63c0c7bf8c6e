"""Quantized checkpoints (torchao's, as HF's ``save_pretrained`` writes them) read a slice at a time.

Before: a model built on meta and quantized there (``quantize_(model, config)``: its weights are torchao
tensor subclasses whose inner tensors are on meta), and a checkpoint of the same model quantized with the same
config (HF ``TorchAoConfig`` + ``save_pretrained``, or torchao's ``flatten_tensor_state_dict`` + safetensors):
each subclass weight saved flattened, one plain tensor per inner tensor, with the subclass's class and
attributes as JSON in the file's metadata under the weight's own name::

    model.layers.0.mlp.up_proj._weight_qdata        int8 [out, in]
    model.layers.0.mlp.up_proj._weight_scale        f32  [out, in / g]      (per row: [out, 1])
    model.layers.0.mlp.up_proj._weight_zero_point   int8 [out, in / g]
    metadata["model.layers.0.mlp.up_proj.weight"] = {"_type": "IntxUnpackedToInt8Tensor", "_data": {block_size..}}
(torchao's Float8Tensor: ``_weight_qdata`` float8 [out, in] and ``_weight_scale`` f32 [out, 1] or [1, 1], no zero
point.)
After: each inner tensor a storage-less facade named for its key (the loader reads this rank's pieces of it,
as of any plain weight: the plan cuts qdata, scale and zero point alike, capture/match_quantized.py), the subclass
rebuilt around them by its own ``__tensor_unflatten__``.

Invariants: a weight is loaded only from one saved as the same class with the same attributes (block size,
target dtype, ...): another config's integers would dequantize to other values. Every mismatch is reported
with the rest of the checkpoint's, before anything changes.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.nn as nn

from dynashard._torch.subclass import is_traceable_subclass

METADATA_NAMES = "tensor_names"  # (torchao's key listing the flattened state dict's names: no tensor)


def is_quantized(t: torch.Tensor) -> bool:
    return is_traceable_subclass(t)


def saved_keys(name: str, param: torch.Tensor) -> list[tuple[str, str]]:
    """``(inner attribute, checkpoint key)`` of each inner tensor of subclass weight ``name``, as torchao's
    ``flatten_tensor_state_dict`` names them (``up._weight_qdata`` for ``up.weight``'s qdata)."""
    names, _ = param.__tensor_flatten__()
    module, _, attr = name.rpartition(".")
    return [(inner, f"{module}._{attr}_{inner}" if module else f"_{attr}_{inner}") for inner in names]


def _described(param: torch.Tensor) -> dict:
    """How torchao describes ``param`` in a checkpoint's metadata (its class and non-tensor attributes)."""
    from torchao.prototype.safetensors.safetensors_utils import TensorSubclassAttributeJSONEncoder  # lazy: optional

    return json.loads(json.dumps(param, cls=TensorSubclassAttributeJSONEncoder))


def mismatch(name: str, param: torch.Tensor, metadata: dict[str, str]) -> str | None:
    """Why the checkpoint's ``name`` is not ``param``'s quantization (None: it is)."""
    if name not in metadata:
        return (f"{name!r} is a {type(param).__name__} in the model, but the checkpoint's metadata does not describe "
                f"it (a checkpoint quantized by torchao, saved with save_pretrained, describes each quantized weight)")
    try:
        saved = json.loads(metadata[name])
    except json.JSONDecodeError:
        return f"{name!r}'s metadata in the checkpoint is no JSON: {metadata[name][:80]!r}"
    want = _described(param)
    if saved.get("_type") != want.get("_type"):
        return f"{name!r} is saved as {saved.get('_type', 'a plain tensor')}, the model has {want.get('_type')}"
    if saved.get("_data") != want.get("_data"):
        differ = sorted(k for k in {**saved.get("_data", {}), **want.get("_data", {})}
                        if saved.get("_data", {}).get(k) != want.get("_data", {}).get(k))
        return (f"{name!r} is saved quantized with {({k: saved.get('_data', {}).get(k) for k in differ})}, the model "
                f"with {({k: want.get('_data', {}).get(k) for k in differ})}")
    return None


def with_facades(param: torch.Tensor, empty: Callable[[torch.Tensor], torch.Tensor]
                 ) -> tuple[nn.Parameter, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``param`` rebuilt around ``empty(inner)`` of each of its inner tensors, as a parameter, and each inner
    tensor it holds with the one of ``param`` it stands for. (``nn.Parameter`` detaches the subclass, which
    makes new inner tensors: those are the ones the graph reads.)"""
    names, ctx = param.__tensor_flatten__()
    rebuilt = type(param).__tensor_unflatten__({n: empty(getattr(param, n)) for n in names}, ctx, param.size(),
                                               param.stride())
    made = nn.Parameter(rebuilt, requires_grad=False)
    return made, [(getattr(made, n), getattr(param, n)) for n in made.__tensor_flatten__()[0]]
