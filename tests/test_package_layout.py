"""The package's shape (docs/layout.md), read from the source with ``ast``; nothing is imported.

- no import circle among dynashard's modules (module-level imports: what runs when a module loads);
- an import of a dynashard module inside a function says why on its line (``# lazy: <reason>``), so
  none hides a circle;
- private torch APIs (``torch._*``, ``torch.distributed._*``, a ``_name`` from any torch module) are
  imported under ``dynashard/_torch/`` only; ``comm/collectives.py`` calls the public functions of
  ``torch.distributed._functional_collectives`` (the two renamed between releases come through
  ``_torch/funcol.py``);
- no module or folder right under ``dynashard/`` takes a name ``dynashard/__init__.py`` exports:
  importing it would replace the public function (``dynashard.explain``) on the package;
- a module imports no private name (``_name``) from a module of another folder: one stage reaches another
  through its public seam (``report/simulate.py`` drives ``rewrite.interpreter.Sharder``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dynashard"
FUNCOL = "torch.distributed._functional_collectives"
FUNCOL_USERS = {"dynashard.comm.collectives"}


def modules(root: pathlib.Path = PACKAGE) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _known(name: str, mods: dict) -> str:
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports(mods: dict) -> list[tuple[str, str, int, bool, str]]:
    """(importer, imported dynashard module or torch module, line, at module level, the line's text)."""
    found = []
    for module, (path, is_package) in mods.items():
        source = path.read_text()
        lines = source.splitlines()

        def walk(node: ast.AST, top: bool, module=module, is_package=is_package, lines=lines) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    walk(child, False)
                elif isinstance(child, ast.Import):
                    for alias in child.names:
                        name = alias.name
                        if name.split(".")[0] == "dynashard":
                            name = _known(name, mods)
                        found.append((module, name, child.lineno, top, lines[child.lineno - 1]))
                elif isinstance(child, ast.ImportFrom):
                    base = _base(module, is_package, child)
                    for alias in child.names:
                        # (``from pkg import name``: the submodule pkg.name when there is one)
                        name = f"{base}.{alias.name}"
                        if base.split(".")[0] == "dynashard":
                            name = _known(name, mods)
                        elif not base.startswith("torch"):
                            name = base
                        found.append((module, name, child.lineno, top, lines[child.lineno - 1]))
                else:
                    walk(child, top)

        walk(ast.parse(source), True)
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def graph(mods: dict) -> dict[str, set[str]]:
    """Module-level edges: each import, and the packages it loads on the way (their ``__init__``), less
    the importer's own packages (already loading when it runs)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for importer, imported, _, top, _ in imports(mods):
        if not top or imported not in mods:
            continue
        own = set(_ancestors(importer))
        for target in [*_ancestors(imported), imported]:
            if target != importer and target not in own and target in mods:
                edges[importer].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    found = cycles(graph(modules()))
    assert not found, f"import circles among dynashard modules (each a set of modules that import each other): {found}"


def test_a_function_level_import_of_dynashard_says_why():
    bare = [f"{module} line {line}: {text.strip()}" for module, name, line, top, text in imports(modules())
            if not top and name.split(".")[0] == "dynashard" and "# lazy:" not in text]
    assert not bare, ("imports of dynashard modules inside functions, without a `# lazy: <reason>` comment on the "
                      f"line (a circle is fixed by moving the shared piece down, not by a lazy import): {bare}")


def test_private_torch_apis_only_under_underscore_torch():
    def private(name: str) -> bool:  # (torch._dynamo, torch.distributed._tensor, torch.x._name)
        parts = name.split(".")
        return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])

    outside = [f"{module} line {line}: {text.strip()}" for module, name, line, _, text in imports(modules())
               if private(name) and module != "dynashard._torch" and not module.startswith("dynashard._torch.")
               and not (name.startswith(FUNCOL) and module in FUNCOL_USERS)]
    assert not outside, f"private torch APIs imported outside dynashard/_torch/: {outside}"


def test_no_top_level_module_shadows_a_public_name():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    public = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))
    children = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
                if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    assert not set(public) & children, f"dynashard/{sorted(set(public) & children)} would replace a public name"


def private_imports_across_folders(mods: dict) -> list[str]:
    """``from dynashard.<folder>.<module> import _name`` in a module of another folder (``dynashard._torch``
    is the private-API folder itself: its modules are named privately, their functions are not)."""
    found = []
    for module, (path, is_package) in mods.items():
        own = module if is_package else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _base(module, is_package, node)
            source = _known(base, mods)
            if source.split(".")[0] != "dynashard" or source == own or source.rsplit(".", 1)[0] == own:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") \
                        and f"{base}.{alias.name}" not in mods:
                    found.append(f"{module} line {node.lineno}: {alias.name} from {base}")
    return found


def test_no_private_name_is_imported_across_folders():
    found = private_imports_across_folders(modules())
    assert not found, ("private names imported from another folder's module (expected a public seam between "
                       f"stages: give the name a public, documented form): {found}")


def test_the_checks_see_a_circle_and_a_bare_lazy_import(tmp_path):
    """The checks can fail: a two-module circle through a package's ``__init__`` and a relative import,
    and a function-level import without its reason."""
    root = tmp_path / "dynashard"
    (root / "a").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("from dynashard.b import thing\n")
    (root / "a" / "one.py").write_text("X = 1\n")
    (root / "b.py").write_text("from .a import one\nthing = 1\n\ndef f():\n    from dynashard import a\n")
    mods = modules(root)
    assert cycles(graph(mods)) == [["dynashard.a", "dynashard.b"]]
    assert [(m, n, top) for m, n, _, top, _ in imports(mods) if not top] == [("dynashard.b", "dynashard.a", False)]


def test_the_check_sees_a_private_import_across_folders(tmp_path):
    """The check can fail: report/ importing the interpreter's private class, as simulate.py once did; the
    same import within rewrite/ and a public name across folders pass."""
    root = tmp_path / "dynashard"
    for folder in ("rewrite", "report"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "rewrite" / "interpreter.py").write_text("class _Sharder: ...\nclass Sharder: ...\n")
    (root / "rewrite" / "lowerings.py").write_text("from dynashard.rewrite.interpreter import _Sharder\n")
    (root / "report" / "simulate.py").write_text(
        "from dynashard.rewrite.interpreter import Sharder\nfrom ..rewrite.interpreter import _Sharder\n")
    assert private_imports_across_folders(modules(root)) == [
        "dynashard.report.simulate line 2: _Sharder from dynashard.rewrite.interpreter"]
