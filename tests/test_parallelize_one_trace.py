"""``dynashard.parallelize`` and the user's ``torch.compile(model, backend="dynashard", options=...)`` share one
Dynamo trace and one plan: the example runs as that compile would, and its program (compiled with the options'
compiler at its first call after parallelize) serves the compile. One rank on the fake process group: counts
of Dynamo frames traced, plans made and graphs compiled. Numerics on real ranks: tests/test_parallelize.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import dynashard
from dynashard import _torch as private
from dynashard.load.registered import FACADES, facades
from dynashard.weights.store import STORE
from tests import models

pytestmark = pytest.mark.unit

OPTIONS = {"compiler": "aot_eager", "min_shard_numel": 0}  # (a compiler other than eager: compiled at first call)


@pytest.fixture
def compiles(monkeypatch):
    """Graphs handed to a compiler: (compiler, whether parallelize's example run was still going)."""
    from dynashard import state

    made = []
    compile_graph = private.compile_graph

    def counted(compiler, *args, **kwargs):
        made.append((compiler, getattr(getattr(state, "PARALLELIZING", None), "active", False)))
        return compile_graph(compiler, *args, **kwargs)

    monkeypatch.setattr(private, "compile_graph", counted)
    return made


def _llama() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return models.build("llama", 64, 96).eval(), torch.randint(0, 96, (2, 7))


def test_the_users_compile_with_the_same_options_traces_and_plans_nothing_more(fake_group, plans, compiles):
    model, ids = _llama()
    with torch.no_grad():
        dynashard.parallelize(model, ids, options=OPTIONS)
        frames, planned = counters["stats"]["unique_graphs"], plans.count
        assert planned == 1 and compiles == [], (planned, compiles)  # planned; no compiler ran in parallelize
        compiled = torch.compile(model, backend="dynashard", options=dict(OPTIONS))  # (an equal dict)
        compiled(ids)
        compiled(ids)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            model(ids)  # a plain call of the parallelized model: the same entry, sharded (not "ran eagerly")
    assert not [w for w in said if "ran eagerly" in str(w.message)], [str(w.message) for w in said]
    assert counters["stats"]["unique_graphs"] == frames, "the user's compile traced the model again"
    assert plans.count == 1, plans.count
    assert compiles == [("aot_eager", False)], compiles  # compiled once, at the first call after parallelize


def test_a_training_compile_traces_afresh_and_the_inference_program_is_never_compiled(fake_group, plans, compiles):
    model, ids = _llama()
    with torch.no_grad():
        dynashard.parallelize(model, ids, options=OPTIONS)
    compiled = torch.compile(model, backend="dynashard", options=OPTIONS)
    compiled(ids).sum().backward()  # grad enabled: the example's entry (traced under no_grad) does not apply
    assert plans.count == 2, plans.count
    assert compiles == [("aot_eager", False)], compiles  # the training graph's compile only
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_other_options_trace_again_and_plan_the_same_cuts(fake_group, plans, compiles):
    model, ids = _llama()
    with torch.no_grad():
        dynashard.parallelize(model, ids, options=OPTIONS)
        registered = {name: (id(p), p.shape) for name, p in model.named_parameters()}
        torch.compile(model, backend="dynashard", options={**OPTIONS, "compiler": "eager"})(ids)
    assert plans.count == 2, plans.count
    assert compiles == [("eager", False)], compiles
    # the second plan read the registered shards: the same parameters, at the same shapes, some of them cut
    assert {name: (id(p), p.shape) for name, p in model.named_parameters()} == registered
    assert any(STORE.is_sharded(f) for m in model.modules() for f in facades(m).values())


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) @ torch.ones(3, 3)  # (a shape error after the linears)


def test_a_parallelize_that_fails_before_cutting_leaves_the_model_as_it_was(fake_group):
    model = _Fails()
    before = {name: type(m) for name, m in model.named_modules()}
    hooks = {name: (len(m._state_dict_hooks), len(m._load_state_dict_pre_hooks)) for name, m in model.named_modules()}
    with pytest.raises(Exception, match="size|shape"):
        with torch.no_grad():
            dynashard.parallelize(model, torch.randn(2, 64), options=OPTIONS)
    assert {name: type(m) for name, m in model.named_modules()} == before
    assert not any(FACADES in m.__dict__ for m in model.modules())
    assert "forward" not in model.__dict__
    assert {name: (len(m._state_dict_hooks), len(m._load_state_dict_pre_hooks))
            for name, m in model.named_modules()} == hooks
    x = torch.randn(2, 64)  # its weights whole, with their values
    assert torch.equal(model.down(torch.relu(model.up(x))), torch.relu(x @ model.up.weight.T + model.up.bias)
                       @ model.down.weight.T + model.down.bias)


def test_the_programs_dynamo_binds_go_with_the_model(fake_group):
    """Dynamo binds each compiled graph as a global of the traced frame's function: the parallelized forward's
    own globals, not dynashard's module namespace, which would keep every model's programs alive."""
    import dynashard.load.parallelize as module

    model, ids = _llama()
    with torch.no_grad():
        dynashard.parallelize(model, ids, options=OPTIONS)
        model(ids)
    assert not [k for k in vars(module) if k.startswith("__compiled_fn")]
    assert [k for k in model.forward.__globals__ if k.startswith("__compiled_fn")]  # (where they are)


def test_a_call_past_the_recompile_limit_is_said_as_that(fake_group):
    """A parallelized model's frame at Dynamo's recompile_limit runs the next variant of the call uncompiled:
    the error names the limit and the fix. (Before: the eager run reached a facade and said "a submodule cannot
    run on its own", which was not what happened: PEFT's adapter switches met it.)"""
    from dynashard.errors import UsageError

    model, ids = _llama()
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        dynashard.parallelize(model, ids, options=OPTIONS)
        model(ids)  # (the same variant: the entry parallelize left)
        with pytest.raises(UsageError, match=r"compiled 1 times, torch._dynamo.config.recompile_limit \(1\)"):
            model(ids[:, :5])  # another length: a compile of its own (dynamic from then on), past the limit of 1


class _NoBackwardHere(nn.Module):
    """Raises under gradients after its first linear, as flex_attention does on CPU ("FlexAttention does not
    support backward on CPU"): Dynamo meets the raise while tracing and runs the frame uncompiled."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.up(x)
        if h.requires_grad:
            raise NotImplementedError("no backward here")
        return self.down(h)


def test_a_call_dynamo_runs_uncompiled_is_said_as_that(fake_group):
    """A call of the parallelized model whose frame Dynamo skips (an error in the model's code while tracing:
    flex_attention under gradients on CPU, found by tests/test_training_fuzz.py) runs eagerly and reads a shard:
    the error says Dynamo ran the call uncompiled and names the shard, not the facade's "a submodule cannot run
    on its own" (the model itself was called). Dynamo marks such a frame to run uncompiled from then on: the
    model's later calls met the facades too, until ``torch._dynamo.reset()``."""
    from dynashard.errors import UsageError

    torch.manual_seed(0)
    model, x = _NoBackwardHere(), torch.randn(2, 8)
    dynashard.parallelize(model, x, options=OPTIONS)  # (planned without gradients)
    with pytest.raises(UsageError, match=r"Dynamo ran this call of _NoBackwardHere \(parallelized\) uncompiled") as e:
        model(x)
    # (torch 2.11 compiles the calls inside the skipped frame on their own: the backend names the weight one of them
    # reads as an argument, as the store filed it there: 'up')
    said = str(e.value)
    assert ("'up.weight'" in said or "'up' is read whole by a part of the call" in said) and "submodule" not in said, \
        said
    with torch.no_grad():  # a call Dynamo compiles runs sharded again (the skipped frame is not skipped for good)
        assert model(x).shape == (2, 8)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_parallelize_from_a_checkpoint_on_a_world_of_one_reads_every_weight_whole(tmp_path, compiler):
    """``torchrun --nproc-per-node 1`` (a debugging run, one GPU): nothing is cut, and every weight of the model built
    on meta is read whole from the checkpoint before the example runs. The example ran on the storage-less
    parameters instead ("setStorage: ... out of bounds for storage of size 0": the weights were read only after
    it)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = models.MLP(16, 32)
    save_file(reference.state_dict(), tmp_path / "mlp.safetensors")
    with dynashard.empty_weights():
        model = models.MLP(16, 32)
    torch._dynamo.reset()
    private.init_fake_process_group(1, 0)
    try:
        x = torch.randn(4, 16)
        with torch.no_grad():
            dynashard.parallelize(model, x, checkpoint=tmp_path / "mlp.safetensors", options={"compiler": compiler})
            assert all(torch.equal(p, reference.get_parameter(n)) for n, p in model.named_parameters())
            torch.testing.assert_close(model(x), reference(x))  # (the same weights, the same ops: float32)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
