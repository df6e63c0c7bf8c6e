"""What dynashard leaves in the process ("state passed, not shared"): hooks and tables live
as long as what they serve, and nothing acts on another thread's work.

One process, torch's fake process group at world 2 (collectives move no data: only which tensors
live, and where, is read here).
"""

from __future__ import annotations

import ast
import gc
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch

import dynashard
from tests import models
from tests.multiproc import SUBPROCESS_DEADLINE_S

pytestmark = pytest.mark.unit

EAGER = {"min_shard_numel": 0, "compiler": "eager"}

# In a fresh interpreter, where no earlier test's model can still hold freed weights: the process-wide
# optimizer hooks, counted in torch's table of them (private: read here only), at each stage.
LIFETIME = textwrap.dedent(
    """
    import gc, json, torch
    import torch.optim.optimizer as optimizer_hooks
    import dynashard
    from dynashard import _torch as private
    from tests import models

    def hooks():
        return len(optimizer_hooks._global_optimizer_pre_hooks) + len(optimizer_hooks._global_optimizer_post_hooks)

    private.init_fake_process_group(2, 0)
    options, x, seen = {"min_shard_numel": 0, "compiler": "eager"}, torch.randn(4, 32), {"start": hooks()}
    model = models.MLP(32, 96)
    with torch.no_grad():
        torch.compile(model, backend=dynashard.backend(**options))(x)
    seen["compiled"] = hooks()
    late = torch.optim.SGD(model.parameters(), lr=0.1)  # over the freed full-size weights
    try:
        late.step()
        seen["refused"] = "ran"
    except Exception as e:
        seen["refused"] = str(e)
    del model, late
    torch._dynamo.reset(); gc.collect()
    seen["model gone"] = hooks()
    model = dynashard.parallelize(models.MLP(32, 96), x, options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # over the shards
    torch.compile(model, backend=dynashard.backend(**options))(x).sum().backward()
    opt.step()
    seen["training"] = hooks()
    del model
    torch._dynamo.reset(); gc.collect()
    seen["parallelized model gone, its optimizer alive"] = hooks()
    print(json.dumps(seen))
    """
)


def test_the_optimizer_hook_lives_while_freed_weights_do():
    """An optimizer over the full-size weights dynashard freed (here by an inference compile) would train
    nothing: its step raises. The one process-wide hook that sees it exists only while such weights do."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-c", LIFETIME],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=SUBPROCESS_DEADLINE_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "holds a full-size parameter" in seen.pop("refused"), seen
    assert seen == {
        "start": 0,
        "compiled": 1,
        "model gone": 0,
        "training": 1,
        "parallelized model gone, its optimizer alive": 0,
    }, seen


def test_a_shards_optimizer_state_is_described_when_read_and_the_model_dies_whole(fake_group):
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    model = dynashard.parallelize(models.MLP(32, 96), x, options=EAGER)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.compile(model, backend=dynashard.backend(**EAGER))(x).sum().backward()
    opt.step()
    state = opt.state_dict()["state"]  # (by index, in model.parameters() order: up.weight, up.bias, ...)
    described = [hasattr(s["exp_avg"], "__create_chunk_list__") for s in state.values()]
    assert described == [True, True, True, False], described  # down.bias is whole
    facade, shard = weakref.ref(model.up.weight), weakref.ref(dict(model.named_parameters())["up.weight"])
    assert facade() is not shard() and facade().shape == (96, 32) and shard().shape == (48, 32)
    del model, opt, state
    torch._dynamo.reset()
    gc.collect()
    assert facade() is None and shard() is None, "a parallelized model's facade and shard outlived it"


def test_empty_weights_acts_on_this_thread_only():
    """A thread building a model while another is inside ``empty_weights`` gets real weights."""
    inside, built, out = threading.Event(), threading.Event(), {}

    def other_thread():
        inside.wait(timeout=60)
        out["other"] = torch.nn.Linear(3, 4)
        built.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with dynashard.empty_weights():
        with dynashard.empty_weights():  # (nested)
            out["inner"] = torch.nn.Linear(3, 4)
        inside.set()
        built.wait(timeout=60)
        out["mine"] = torch.nn.Linear(3, 4)
        out["mine"].register_buffer("table", torch.ones(2))
    worker.join(timeout=60)
    out["after"] = torch.nn.Linear(3, 4)
    devices = {k: (m.weight.device.type, m.bias.device.type) for k, m in out.items()}
    assert devices == {
        "inner": ("meta", "meta"),
        "mine": ("meta", "meta"),
        "other": ("cpu", "cpu"),
        "after": ("cpu", "cpu"),
    }, devices
    assert out["mine"].table.device.type == "cpu" and isinstance(out["mine"].weight, torch.nn.Parameter)


# ---- dynashard/state.py lists every piece of process-wide state (read from the source with ast) ----

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dynashard"
# calls whose result cannot change: a binding to one is a constant, not state
_IMMUTABLE_CALLS = {"frozenset", "tuple", "object", "range", "re.compile", "torch.Size", "logging.getLogger", "getattr",
                    "TypeVar", "int", "float", "str"}
# process-wide registrations (by the called name's last part), besides register_module_*, atexit.register and
# torch.library.*
_REGISTRARS = {"register_package", "register_optimizer_step_pre_hook", "register_optimizer_step_post_hook",
               "skip_code", "never_a_frame", "never_a_frame_of_its_own", "custom_op", "register_backend"}
_MUTATORS = {"add", "append", "extend", "update", "setdefault", "pop", "popitem", "clear", "discard", "remove",
             "insert"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    return "?"


def _mutable(value: ast.AST) -> bool:
    """A top-level value that can change: a container, an object a call built, or an attribute of another
    module's state (``STORE.live``)."""
    if isinstance(value, (ast.Dict, ast.DictComp, ast.List, ast.ListComp, ast.Set, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        return _dotted(value.func) not in _IMMUTABLE_CALLS
    if isinstance(value, ast.Attribute):
        root = _dotted(value).split(".")[0]
        return root.isupper()
    return False


def _registration(node: ast.AST) -> str | None:
    name = _dotted(node)
    last = name.rsplit(".", 1)[-1]
    if last in _REGISTRARS or last.startswith("register_module_") or name == "atexit.register":
        return "atexit.register" if name == "atexit.register" else last
    if name.startswith("torch.library."):
        return last
    return None


def scan_state() -> tuple[set[str], set[str]]:
    """(``module.NAME`` of each top-level mutable binding or ``global`` rebinding, ``module: what`` of each
    process-wide registration, patch of an imported module's attribute, or class swap) in the package."""
    state, hooks = set(), set()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text())
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
            for target in targets:
                if isinstance(target, ast.Name) and _mutable(node.value):
                    state.add(f"{module}.{target.id}")
        modules = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                state.update(f"{module}.{name}" for name in node.names)
            elif isinstance(node, ast.Call) and (what := _registration(node.func)):
                hooks.add(f"{module}: {what}")
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                for decorator in node.decorator_list:
                    if not isinstance(decorator, ast.Call) and (what := _registration(decorator)):
                        hooks.add(f"{module}: {what}")
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and target.attr == "__class__":
                        hooks.add(f"{module}: __class__ =")
                    elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                            target.value.id in modules:
                        hooks.add(f"{module}: {_dotted(target)} =")
    return state, hooks


def _written(module: str, name: str) -> list[int]:
    """Lines of ``module`` that write into its top-level ``name`` (an item set or deleted, a mutating call)."""
    parts = module.split(".")[1:]
    path = PACKAGE.joinpath(*parts, "__init__.py") if PACKAGE.joinpath(*parts).is_dir() else \
        PACKAGE.joinpath(*parts[:-1], parts[-1] + ".py")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            found += [node.lineno for t in targets if isinstance(t, ast.Subscript) and _dotted(t.value) == name]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in _MUTATORS and _dotted(node.func.value) == name:
            found.append(node.lineno)
    return found


def test_state_py_lists_every_piece_of_process_wide_state():
    """A new module-level table, counter or handle, a ``global`` rebinding, a process-wide hook, a patch of
    another module or a class swap fails here until ``dynashard/state.py`` names it with its lifetime; a
    listed one that is gone fails too (the list stays the truth)."""
    from dynashard import state as listed

    state, hooks = scan_state()
    assert state - set(listed.STATE) - listed.TABLES == set(), "add these to dynashard/state.py's STATE (or TABLES)"
    assert hooks - set(listed.HOOKS) == set(), "add these to dynashard/state.py's HOOKS"
    assert set(listed.STATE) - state == set() and set(listed.HOOKS) - hooks == set(), "gone: drop from state.py"
    assert listed.TABLES - state == set(), "gone (or no longer a mutable binding): drop from state.py's TABLES"
    assert not set(listed.STATE) & listed.TABLES
    writes = {name: lines for name in listed.TABLES if (lines := _written(*name.rsplit(".", 1)))}
    assert writes == {}, f"written after import: state, not a table (move to STATE): {writes}"


def test_a_compiles_conversions_are_its_own_and_go_with_it(fake_group, monkeypatch):
    """A training compile traces each conversion (Megatron's f and g here) as a ``dynashard::tp_conversion``
    marker keyed in a process-wide registry, then binds each marker to its conversion. The keys name the
    compile that traced them, so two models' never meet, and the registry holds none of them once the
    compile is done (the graph calls the conversions itself), nor after the models are gone."""
    from dynashard import state
    from dynashard.comm import collectives

    keys, bind = [], collectives.bind_conversions

    def recording(gm):  # the marker keys of each compile's graph, as bound
        keys.append({n.args[1] for n in gm.graph.nodes if n.target is torch.ops.dynashard.tp_conversion.default})
        return bind(gm)

    monkeypatch.setattr(collectives, "bind_conversions", recording)
    x, models_alive = torch.randn(2, 5, 32), []
    for hidden in (80, 96):  # (another size: Dynamo compiles again, a second program)
        torch.manual_seed(0)
        model = models.ResidualBlock(32, hidden)  # the same conversions (f, g on one group), each compile its own
        compiled = torch.compile(model, backend=dynashard.backend(**EAGER))
        compiled(x).pow(2).mean().backward()
        models_alive.append((model, compiled))
        assert state.CONVERSIONS == {}, "a finished compile's conversions are still registered"
    assert len(keys) == 2 and len(keys[0]) == 2, keys  # f before gate/up, g after down
    assert not keys[0] & keys[1], f"two compiles' conversions share keys: {keys}"
    del models_alive, model, compiled
    torch._dynamo.reset()
    gc.collect()
    assert state.CONVERSIONS == {}


def test_a_fake_group_made_after_another_keeps_dynamos_rule_map():
    """tests/dynamo_rules.py: the fake group ``dynashard.explain`` makes (one per call) leaves Dynamo's trace-rule map
    as it was, which the next compile would otherwise build again (15 ms each, 960 times a unit run); a rebuild gives
    the same map."""
    from torch._dynamo import trace_rules

    from tests import dynamo_rules

    rules = trace_rules.get_torch_obj_rule_map()
    torch.manual_seed(0)
    dynashard.explain(models.MLP(32, 96), torch.randn(4, 32), world_size=2,
                      options={"compiler": "eager", "min_shard_numel": 0})
    assert trace_rules.get_torch_obj_rule_map() is rules
    dynamo_rules.rebuild()
    rebuilt = trace_rules.get_torch_obj_rule_map()
    assert rebuilt is not rules and rebuilt == rules
