"""What dynashard leaves in the process ("state passed, not shared"): hooks and tables live
as long as what they serve, and nothing acts on another thread's work.

One process, torch's fake process group at world 2 (collectives move no data: only which tensors
live, and where, is read here).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

import dynashard
from dynashard import _torch as private
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


@pytest.fixture()
def fake_group():
    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


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
