"""Every private torch API dynashard uses is reached through ``dynashard/_torch/`` (Dynamo and
Inductor, aten graphs, process groups: STYLE 8), so a torch upgrade breaks those files only; every torch
name dynashard reads exists on the running torch (``tools/compat.sh`` runs this on each supported release),
and what ``_torch/`` chooses by feature detection works on it.

Read from the source's syntax tree (strings and comments, such as an error message naming
``torch._dynamo.config.optimize_ddp``, are not uses).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest
import torch

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dynashard"
PRIVATE_PACKAGE = "_torch"  # dynashard/_torch/: the modules that may use them
# The functional collectives, underscore-named but the one way to emit them, are called from the module
# whose job that is (STYLE 1: "collectives (the one module that calls funcol)").
ALLOWED_IMPORTS = {("comm/collectives.py", "torch.distributed._functional_collectives")}
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
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != PRIVATE_PACKAGE]
    assert len(files) > 30, files  # (the package was found)
    uses = [u for p in files for u in _uses(p)]
    assert uses == [], "\n".join(uses)


# A name that some supported releases lack, read only when its replacement is missing (feature detection in
# ``_torch/``): required only where the replacement is. (replacement, then the older name)
ALTERNATIVES = {
    "torch.distributed._functional_collectives.all_gather_tensor": "torch.distributed._functional_collectives."
                                                                   "all_gather_single",
    "torch.distributed._functional_collectives.reduce_scatter_tensor": "torch.distributed._functional_collectives."
                                                                       "reduce_scatter_single",
}


def _torch_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every torch name the file imports or reads through an attribute chain rooted at
    ``torch`` or at a name it imported from torch (aliases included)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    found.append((node.lineno, a.name))
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                found.append((node.lineno, f"{node.module}.{a.name}"))
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        dotted = _dotted(node) if isinstance(node, ast.Attribute) else None
        root = dotted.split(".")[0] if dotted else None
        if root in aliases:
            found.append((node.lineno, aliases[root] + dotted[len(root):]))
    return found


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names something on the running torch (a submodule is imported on the way)."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if not inspect.ismodule(obj):
            return False
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except ImportError:
            return False
    return True


def test_every_torch_name_dynashard_reads_exists_on_this_torch():
    """A name a release lacks fails here, on that release, naming the file and line (torch 2.11 and 2.12 lack
    funcol's ``all_gather_single``, so ``_torch/funcol.py`` picks the name by feature detection rather than
    ``collectives.py`` calling it directly)."""
    # (every module imported first: its own ops, torch.ops.dynashard.*, and funcol's are registered on import)
    for path in sorted(PACKAGE.rglob("*.py")):
        importlib.import_module(".".join(("dynashard", *path.relative_to(PACKAGE).with_suffix("").parts)))
    names = {(p.relative_to(PACKAGE).as_posix(), line, name)
             for p in sorted(PACKAGE.rglob("*.py")) for line, name in _torch_names(p)}
    assert len({n for _, _, n in names}) > 100, names  # (the walk found dynashard's torch names)
    assert any(n.startswith("torch._") for _, _, n in names), names
    missing = sorted(f"{f}:{line} reads {n}, which torch {torch.__version__} does not have"
                     for f, line, n in names if not _resolves(n) and not _resolves(ALTERNATIVES.get(n, n)))
    assert missing == [], "\n".join(missing)


def test_the_functional_collectives_chosen_emit_the_same_ops_on_this_torch():
    """``_torch/funcol.py`` picks funcol's gather and reduce-scatter by name (2.13 renamed them); both
    names emit the ``_c10d_functional`` ops the graph goldens print, on the fake group of 2."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from dynashard import _torch as private
    from dynashard._torch import funcol as private_funcol

    private.init_fake_process_group(2)
    try:
        group = dist.group.WORLD.group_name

        def f(x):
            return private_funcol.all_gather_single(x, 0, group) + private_funcol.reduce_scatter_single(
                torch.cat([x, x, x, x]), "sum", 0, group)

        targets = [str(n.target) for n in make_fx(f)(torch.ones(2, 3)).graph.nodes if n.op == "call_function"]
    finally:
        dist.destroy_process_group()
    assert "_c10d_functional.all_gather_into_tensor.default" in targets, targets
    assert "_c10d_functional.reduce_scatter_tensor.default" in targets, targets


def test_compiling_is_true_in_dynamo_and_in_a_backend_and_false_when_compiled_code_runs():
    """``private.compiling()`` is what facades and parameters branch on: True while Dynamo traces and while a
    backend runs (dynashard's analysis and rewrite read facades as plain tensors there), False when the
    compiled code runs and in eager code. torch 2.11 and 2.12's ``torch.compiler.is_compiling()`` is False
    inside a backend: HF's recipe then failed at parallelize with "this tensor's storage was freed"."""
    from dynashard import _torch as private

    seen = {}

    def traced(x):
        seen["dynamo"] = private.compiling()
        return x + 1

    def backend(gm, example_inputs):
        seen["backend"] = private.compiling()

        def run(*args):
            seen["running"] = private.compiling()
            return gm(*args)
        return run

    torch._dynamo.reset()
    torch.compile(traced, backend=backend)(torch.ones(2))
    assert seen == {"dynamo": True, "backend": True, "running": False}, seen
    assert private.compiling() is False


def test_dynamo_generation_changes_with_a_reset_only():
    """``_torch/regions.dynamo_generation`` reads ``torch._dynamo.reset()`` from a message it keeps among those
    ``warn_once`` has shown, which a reset clears on this torch; a ``warn_once`` between resets keeps it."""
    from torch._dynamo.utils import warn_once

    from dynashard._torch import regions as private_regions

    first = private_regions.dynamo_generation()
    warn_once("dynashard test: a warning shown once")
    assert private_regions.dynamo_generation() == first
    torch._dynamo.reset()
    after = private_regions.dynamo_generation()
    assert after != first and private_regions.dynamo_generation() == after
