"""What a pass reads off an FX node: its fake value, static sizes, arguments, whether it writes in place.

Shared by the layout map, the rules, the matcher, the rewrite and the report; nothing here decides a
layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from dynashard._torch import aten as private_aten


def op_name(node: torch.fx.Node) -> str:
    return "output" if node.op == "output" else getattr(node.target, "__name__", str(node.target))


def val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


PARAMETER = "dynashard_parameter"  # placeholder meta: the input is a module's nn.Parameter (analysis.py)


def is_parameter(node: torch.fx.Node) -> bool:
    return node.op == "placeholder" and node.meta.get(PARAMETER, False)


def val_list(node: torch.fx.Node) -> list:
    v = node.meta.get("val")
    return list(v) if isinstance(v, (list, tuple)) else []


def size_at(node, dim: int = -1) -> int | None:
    """The static size of ``node``'s dim ``dim`` (counted from the end), if it has one."""
    v = val(node)
    if v is None or v.dim() < -dim or not isinstance(v.shape[dim], int):
        return None
    return v.shape[dim]


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) if val(a) is not None else None)
    return list(dict.fromkeys(found))


def all_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return list(dict.fromkeys(found))


def mutates_self(node: torch.fx.Node) -> bool:
    schema = private_aten.schema_of(node.target)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return bool(alias is not None and alias.is_write)


def written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The arguments ``node`` writes into: an in-place op's ``self``, an ``out=``."""
    schema = private_aten.schema_of(node.target) if node.op == "call_function" else None
    found = []
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.alias_info is not None and a.alias_info.is_write:
            value = node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name)
            found += [value] if isinstance(value, torch.fx.Node) else []
    return found


def norm_dim(d: int, ndim: int) -> int:
    """A dim argument counted from the left (``ndim`` 0: a scalar, dim 0)."""
    return d % ndim if ndim else 0


def is_one(d) -> bool:
    return isinstance(d, int) and d == 1


def is_size(a: Any, b: int) -> bool:
    return isinstance(a, int) and a == b
