"""Every private torch API dynashard uses is reached through ``dynashard/_torch_private*.py`` (Dynamo and
Inductor, aten graphs, process groups: STYLE 8), so a torch upgrade breaks those files only.

Read from the source's syntax tree (strings and comments, such as an error message naming
``torch._dynamo.config.optimize_ddp``, are not uses).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dynashard"
PRIVATE_MODULES = {"_torch_private.py", "_torch_private_aten.py", "_torch_private_c10d.py", "_torch_private_dtensor.py",
                   "_torch_private_subclass.py"}
# The functional collectives, underscore-named but the one way to emit them, are called from the module
# whose job that is (STYLE 1: "collectives (the one module that calls funcol)").
ALLOWED_IMPORTS = {("collectives.py", "torch.distributed._functional_collectives")}
# Underscore members of torch objects (ops, modules, frames) that are not torch's public API.
PRIVATE_MEMBERS = {"_schema", "_parameters", "_buffers", "_modules", "_C", "_getframe"}


def _private(dotted: str) -> bool:
    """``torch.<...>._x`` (ending in an underscore member; the chain is walked one attribute at a time)."""
    parts = dotted.split(".")
    return parts[0] == "torch" and len(parts) > 1 and parts[-1].startswith("_") and not parts[-1].startswith("__")


def _private_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(names)]) if isinstance(node, ast.Name) else None


def _uses(path: pathlib.Path) -> list[str]:
    name = path.relative_to(PACKAGE).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            modules = []
        found += [
            f"{name}:{node.lineno} imports {m}"
            for m in modules
            if _private_module(m) and (name, m) not in ALLOWED_IMPORTS
        ]
        if isinstance(node, ast.Attribute) and (node.attr in PRIVATE_MEMBERS or _private(_dotted(node) or "")):
            found.append(f"{name}:{node.lineno} reads {_dotted(node) or '...'}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            member = node.args[1] if len(node.args) > 1 else None
            if isinstance(member, ast.Constant) and member.value in PRIVATE_MEMBERS:
                found.append(f"{name}:{node.lineno} reads {member.value} by name")
    return found


def test_private_torch_apis_only_in_the_private_modules():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name not in PRIVATE_MODULES]
    assert len(files) > 30, files  # (the package was found)
    uses = [u for p in files for u in _uses(p)]
    assert uses == [], "\n".join(uses)
