"""A model compiled with ``torch.compile(model, backend="dynashard")`` and then run around the compiled
call (nanoGPT's ``sample.py``: ``model.generate(...)``, which Dynamo's wrapper forwards to the uncompiled
module) runs unsharded: one warning names the fixes. Single process (a fake group where a compile runs).
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist

import dynashard
from dynashard import _torch as private
from tests import models

pytestmark = pytest.mark.unit


class _Sampler(models.NanoGPT):
    """nanoGPT's ``generate``: the module called on its own growing input (greedy here)."""

    @torch.no_grad()
    def generate(self, idx, steps: int):
        for _ in range(steps):
            idx = torch.cat([idx, self(idx)[:, -1, :].argmax(-1, keepdim=True)], 1)
        return idx


def _ids():
    return torch.randint(0, 96, (1, 4))


def test_generate_around_the_compiled_model_warns_once_naming_the_fix():
    torch._dynamo.reset()
    model = torch.compile(_Sampler(n_layer=1).eval(), backend="dynashard")
    with pytest.warns(UserWarning, match="not sharded") as caught:
        model.generate(_ids(), 2)
        model.generate(_ids(), 2)
    ours = [w for w in caught if "dynashard" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert "model.forward = torch.compile(model.forward, backend='dynashard')" in message
    assert "dynashard.parallelize" in message


def test_a_watched_module_still_copies_and_saves():
    """The hook travels with the module (torch.save(model), copy.deepcopy): it must pickle, inert."""
    torch._dynamo.reset()
    model = torch.compile(_Sampler(n_layer=1).eval(), backend="dynashard")
    twin = copy.deepcopy(model._orig_mod)
    torch.save(model, io.BytesIO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twin.generate(_ids(), 1)  # wrapped by nothing: no warning


def test_another_backend_is_left_alone():
    torch._dynamo.reset()
    model = torch.compile(_Sampler(n_layer=1).eval(), backend="eager")
    assert not model._orig_mod._forward_pre_hooks  # no hook on a module dynashard does not compile
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(_ids(), 1)


def test_the_compiled_call_and_the_recommended_fix_run_sharded_without_a_warning():
    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        options = {"min_shard_numel": 0, "compiler": "eager"}
        wrapped = torch.compile(_Sampler(n_layer=1).eval(), backend=dynashard.backend(**options))
        fixed = _Sampler(n_layer=1).eval()
        whole = dynashard.held_bytes(fixed)
        fixed.forward = torch.compile(fixed.forward, backend=dynashard.backend(**options))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                wrapped(_ids())
            fixed.generate(_ids(), 1)
        assert dynashard.held_bytes(wrapped._orig_mod) < whole
        assert dynashard.held_bytes(fixed) < whole
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_the_watch_adds_no_graph_break_under_fullgraph():
    """The pre-hook is traced with the wrapper's call (it returns at once there): fullgraph=True compiles
    the watched module whole, in one graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    private.init_fake_process_group(2, 0)
    try:
        options = {"min_shard_numel": 0, "compiler": "eager"}
        mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
        model = torch.compile(mlp, backend=dynashard.backend(**options), fullgraph=True)
        assert model._orig_mod._forward_pre_hooks  # (watched)
        model(torch.randn(4, 16))
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
