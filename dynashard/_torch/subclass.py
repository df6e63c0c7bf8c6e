"""Private torch APIs for tensor-subclass inputs (torchao's quantized weights): which tensors are
traceable wrapper subclasses, and what Dynamo's placeholders say of where an input comes from.

(``_torch/__init__.py`` holds the rest: Dynamo, AOTAutograd, Inductor, process groups.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx


def is_traceable_subclass(t: Any) -> bool:
    """A tensor subclass that AOTAutograd desugars into its inner tensors (``__tensor_flatten__`` /
    ``__tensor_unflatten__``: torchao's ``Int8Tensor``, ``Int4Tensor``, ...).

    NOTE: ``torch.utils._python_dispatch.is_traceable_wrapper_subclass`` (torch 2.13)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t)


def copy_placeholder_origin(src: torch.fx.Node, dst: torch.fx.Node, path: str) -> None:
    """Give ``dst`` (a placeholder for the inner tensor ``path`` of ``src``'s subclass) what Dynamo recorded
    of where ``src``'s value comes from: its grapharg (source: the parameter's FQN), whether it is a static
    input (``tensor_dict["_dynamo_static_input_type"]``), and as its ``_dynamo_source`` (read by
    ``carry_dynamo_inputs``) the attribute ``path`` of ``src``'s: AOTAutograd refuses two inputs of one
    source ("already in seen_sources", measured under Inductor).

    NOTE: node meta keys and the ``_dynamo_source`` attribute Dynamo 2.13 sets on its placeholders;
    ``torch._dynamo.source.AttrSource``."""
    from torch._dynamo.source import AttrSource

    for key in ("grapharg", "tensor_dict"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]
    source = getattr(src, "_dynamo_source", None)
    if source is not None:
        for name in path.split("."):
            source = AttrSource(source, name)
        dst._dynamo_source = source
