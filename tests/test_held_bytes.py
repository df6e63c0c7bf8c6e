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
