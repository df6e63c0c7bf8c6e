"""What a parallelized model's state dict holds, and every way users save and resume it, on 2 gloo ranks.

``state_dict()`` after ``parallelize`` holds this rank's pieces of the weights it cut, each carrying its
placement (dynashard/layout/placement.py): nanoGPT's ``torch.save`` on rank 0 / ``load_state_dict`` on every
rank is refused on the rank whose pieces differ, before anything changes; a rank's own file resumes it
exactly; DCP's ``full_state_dict=True`` returns whole tensors (model and optimizer) and loads them back;
a whole (unsharded) state dict still loads. Training compares SGD steps with momentum (its state is
this rank's pieces of the global momentum) against an unsharded twin.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

import dynashard
from dynashard.errors import UsageError
from tests import models
from tests.scenarios import Scenarios, raised

pytestmark = pytest.mark.gloo

# One spawn, every scenario: about 20 s of wall per rank quiet; 300 s covers a loaded 2-core machine.
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=300)

EAGER = {"min_shard_numel": 0, "compiler": "eager"}
FULL = StateDictOptions(full_state_dict=True)
# float32, the same sums in another order on the sharded ranks: a few ulps of values of order 1
ATOL = 1e-5


def _nanogpt():
    torch.manual_seed(0)
    return models.NanoGPT(vocab=96, n_embd=64, n_head=4, n_layer=1, block_size=16)


def _train(model, opt, ids, steps):
    for _ in range(steps):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _parallelized():
    model = _nanogpt()
    ids = torch.randint(0, 96, (2, 9))
    dynashard.parallelize(model, ids[:, :-1], options=EAGER)
    return model, ids


def _max_err(state, reference):
    return max(float((state[n] - t).abs().max()) for n, t in reference.items())


@on_ranks
def test_a_checkpoint_saved_on_rank0_is_refused_on_the_other_rank_and_changes_nothing(rank, world, tmp_path):
    # nanoGPT's train.py: torch.save({"model": model.state_dict(), "optimizer": ...}) on rank 0 only,
    # then every rank resumes with load_state_dict. Rank 1 would train on rank 0's rows.
    model, ids = _parallelized()
    opt = _sgd(model)
    _train(model, opt, ids, 1)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{tmp_path}/ckpt.pt")
    dist.barrier()
    saved = torch.load(f"{tmp_path}/ckpt.pt")  # (torch's default: weights_only=True)
    resumed, _ = _parallelized()
    before = {n: t.clone() for n, t in resumed.state_dict().items()}
    if rank == 0:
        resumed.load_state_dict(saved["model"])  # its own pieces: loads
        assert _max_err(resumed.state_dict(), model.state_dict()) == 0
    else:
        error = raised(lambda: resumed.load_state_dict(saved["model"]))
        assert isinstance(error, UsageError), repr(error)
        assert "rank 0 of 2's pieces" in str(error) and "full_state_dict=True" in str(error), str(error)
        assert "dcp.save" in str(error) and "export_safetensors" in str(error), str(error)
        assert _max_err(resumed.state_dict(), before) == 0, "a refused load changed the model"


@on_ranks
def test_a_shard_without_placement_or_from_another_world_is_refused(rank, world):
    model, _ = _parallelized()
    state = model.state_dict()
    name = "h.0.c_fc.weight"
    local = state[name]
    # (a copy loses the placement: rank 0's shard saved by an earlier dynashard looks just like it)
    error = raised(lambda: model.load_state_dict({**state, name: local.clone()}))
    assert isinstance(error, UsageError) and "says nothing of whose pieces" in str(error), str(error)
    quarter = torch.zeros(local.shape[0] // 2, *local.shape[1:])  # a world-4 shard
    error = raised(lambda: model.load_state_dict({**state, name: quarter}))
    assert isinstance(error, UsageError) and "another world size" in str(error), str(error)
    # its own state dict, and the unsharded model's (whole tensors), load
    model.load_state_dict(state)
    whole = _nanogpt().state_dict()
    model.load_state_dict(whole)
    full = get_model_state_dict(model, options=FULL)
    assert _max_err(full, whole) == 0


@on_ranks
def test_each_ranks_own_file_resumes_exactly(rank, world, tmp_path):
    model, ids = _parallelized()
    opt = _sgd(model)
    _train(model, opt, ids, 2)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{tmp_path}/ckpt.{rank}.pt")
    saved = torch.load(f"{tmp_path}/ckpt.{rank}.pt")
    resumed, _ = _parallelized()
    resumed.load_state_dict(saved["model"])
    resumed_opt = _sgd(resumed)
    resumed_opt.load_state_dict(saved["optimizer"])
    assert _train(resumed, resumed_opt, ids, 2) == _train(model, opt, ids, 2)
    assert _max_err(resumed.state_dict(), model.state_dict()) == 0


@on_ranks
def test_another_ranks_optimizer_state_is_refused_before_its_first_step(rank, world, tmp_path):
    model, ids = _parallelized()
    opt = _sgd(model)
    _train(model, opt, ids, 1)
    if rank == 0:
        torch.save(opt.state_dict(), f"{tmp_path}/opt.pt")
    dist.barrier()
    saved = torch.load(f"{tmp_path}/opt.pt")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    opt.load_state_dict(saved)
    if rank == 0:
        _train(model, opt, ids, 1)
    else:
        error = raised(lambda: _train(model, opt, ids, 1))
        assert isinstance(error, UsageError) and "rank 0 of 2's pieces" in str(error), str(error)
        assert _max_err(model.state_dict(), before) == 0, "the refused step changed the model"


@on_ranks
def test_full_state_dict_is_whole_and_resumes_the_unsharded_twin_and_back(rank, world, tmp_path):
    twin = _nanogpt()
    model, ids = _parallelized()
    opt, twin_opt = _sgd(model), _sgd(twin)
    loss = _train(model, opt, ids, 2)
    assert abs(loss - _train(twin, twin_opt, ids, 2)) < ATOL
    state, optim = get_state_dict(model, opt, options=FULL)
    # whole tensors under the full names, equal to the twin's after the same steps (model and momentum)
    assert _max_err(state, twin.state_dict()) < ATOL
    twin_optim = twin_opt.state_dict()["state"]
    names = [n for n, _ in twin.named_parameters()]
    assert max(float((optim["state"][n]["momentum_buffer"] - twin_optim[i]["momentum_buffer"]).abs().max())
               for i, n in enumerate(names)) < ATOL
    # saved on rank 0 (nanoGPT's way, with whole tensors) and resumed by every rank, or by the twin
    if rank == 0:
        torch.save({"model": state, "optim": optim}, f"{tmp_path}/full.pt")
    dist.barrier()
    saved = torch.load(f"{tmp_path}/full.pt")
    resumed, _ = _parallelized()
    resumed_opt = _sgd(resumed)
    fresh_twin = _nanogpt()
    set_model_state_dict(fresh_twin, copy.deepcopy(saved["model"]))  # (set_* writes into the dict it is given)
    assert _max_err(fresh_twin.state_dict(), twin.state_dict()) < ATOL
    set_state_dict(resumed, resumed_opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"],
                   options=FULL)
    assert abs(_train(resumed, resumed_opt, ids, 1) - _train(twin, twin_opt, ids, 1)) < ATOL
    assert _max_err(get_model_state_dict(resumed, options=FULL), twin.state_dict()) < ATOL
