"""``dynashard.held_bytes``: what a rank holds after dynashard shards and frees a model's weights.

Single process on torch's fake process group (collectives move no data): only the shards' sizes
are read, not their values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dynashard
from dynashard import _torch as private
from tests import models

pytestmark = pytest.mark.unit


def test_held_bytes_counts_this_ranks_shards_after_compile():
    torch.manual_seed(0)
    model = models.MLP(32, 96, bias=False)
    model.register_buffer("scale", torch.ones(8))  # a buffer is held whole
    weights = model.up.weight.nbytes + model.down.weight.nbytes
    before = dynashard.held_bytes(model)
    assert before == weights + 8 * 4

    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        with torch.no_grad():
            torch.compile(model, backend=dynashard.backend(compiler="eager", min_shard_numel=0))(torch.randn(4, 32))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()

    # Both weights cut in half over 2 ranks (up colwise, down rowwise) and their full tensors freed.
    assert model.up.weight.untyped_storage().nbytes() == 0
    assert dynashard.held_bytes(model) == weights // 2 + 8 * 4


def test_held_bytes_of_a_model_parallelized_with_dtensors_counts_their_local_shards(fake_group):
    """``parallelize(..., dtensor=True)`` registers DTensors (for FSDP2): each counts as its local shard. torch 2.13's
    DTensor names its device mesh among its inner attributes (``__tensor_flatten__``), which was taken for an
    inner tensor: ``held_bytes`` raised "'DeviceMesh' object has no attribute 'untyped_storage'" (and so did
    examples/train_2d.py, which prints it)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = models.MLP(32, 96, bias=False)
    weights = model.up.weight.nbytes + model.down.weight.nbytes
    mesh = DeviceMesh("cpu", [0, 1])  # (the tensor-parallel mesh: the fake group's two ranks)
    dynashard.parallelize(model, torch.randn(4, 32), options={"compiler": "eager", "min_shard_numel": 0,
                                                                "group": mesh}, dtensor=True)
    assert isinstance(model.up.weight, DTensor) and isinstance(model.down.weight, DTensor)
    assert dynashard.held_bytes(model) == weights // 2  # (up colwise, down rowwise: half of each on rank 0 of 2)
