"""The host-side protocol runs on a CPU-capable group over the user's ranks (``protocol.host_group``).

NCCL moves only CUDA tensors, so on an NCCL group the handshake, status exchanges and object gathers
run on a gloo companion. There is no NCCL here: a ``"cuda:gloo"`` group stands in for it (a gloo
backend registered for CUDA only: a CPU tensor's all_reduce on it raises "No backend type associated
with device type cpu", as on NCCL), and ``DYNASHARD_HOST_GROUP=companion`` makes every rank take the
companion path on the gloo groups a whole run needs.

Each test runs on every rank and asserts there (tests/scenarios.py): the protocol and the mesh share
one spawn of 4 ranks; a scenario that leaves its ranks in different numbers of groups, or a rank
dead, runs alone.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dynashard
from dynashard.comm.protocol import CALL, HOST_GROUP_ENV, exchange_status, first_rank_status, handshake, host_group
from dynashard.errors import PeerError, SetupError, UsageError
from tests import models
from tests.battery import lose_rank1
from tests.scenarios import Scenarios, raised

pytestmark = pytest.mark.gloo

DEADLINE_S = 180  # each spawn takes 3-15 s on the quiet 2-core machine; 3x slower and busy, with a 2x margin
GLOO_TIMEOUT = 15  # seconds: a dead rank must surface as an error within about this long
on_ranks = Scenarios(__name__, worlds=(4,), deadline_s=DEADLINE_S)


@on_ranks
def test_the_protocol_runs_on_a_group_that_cannot_move_cpu_tensors(rank, world):
    """On a group like NCCL's (no CPU backend) the handshake and every status exchange work, through
    the companion, and still tell the ranks apart: a handshake that all_reduced a CPU tensor on the
    user's group would raise on the first call."""
    group = dist.new_group(list(range(world)), backend="cuda:gloo")
    error = raised(lambda: dist.all_reduce(torch.zeros(1), group=group))  # what NCCL says to a CPU tensor
    assert isinstance(error, RuntimeError) and "No backend type associated with device type cpu" in str(error), error
    host = host_group(group)
    assert host is not group and host_group(group) is host, "no companion, or another one each time"
    assert dist.get_process_group_ranks(host) == list(range(world)), dist.get_process_group_ranks(host)
    handshake(CALL, ["int64[2, 8]"], group)  # the same inputs: passes
    error = raised(lambda: handshake(CALL, [f"int64[2, {8 + rank}]"], group))
    assert isinstance(error, UsageError) and "int64[2, 8]" in str(error) and "int64[2, 9]" in str(error), error
    error = raised(lambda: exchange_status(None, ValueError("bad weight") if rank == 1 else None, group, "planning"))
    if rank == 1:
        assert type(error) is ValueError and str(error) == "bad weight", repr(error)
    else:
        assert isinstance(error, PeerError), repr(error)
        assert "rank 1 failed during planning: ValueError: bad weight" in str(error), error
    error = raised(lambda: first_rank_status(UsageError("bad file") if rank == 0 else None, group, "reading"))
    assert type(error) is (UsageError if rank == 0 else PeerError) and "bad file" in str(error), repr(error)
    objects = exchange_status(("rank", rank), None, group, "gathering")
    assert objects == [("rank", r) for r in range(world)], objects


@on_ranks
def test_a_mesh_runs_with_each_tp_group_agreeing_on_its_companion(rank, world, tmp_path):
    """Compile, rank 0's deal and export over the tp groups of a 2x2 mesh, each through a companion made
    by its two ranks alone (use_local_synchronization): the results equal the unsharded model's."""
    from safetensors.torch import load_file

    os.environ[HOST_GROUP_ENV] = "companion"  # (before any dynashard call)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"].get_group()
        options = {"min_shard_numel": 0, "compiler": "eager", "group": tp}
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(0)
        model = models.MLP(32, 96)
        with torch.no_grad():
            expected = model(x)
            compiled = torch.compile(model, backend=dynashard.backend(**options))(x)
            torch.manual_seed(0)
            dealt = dynashard.parallelize(models.MLP(32, 96), x, options={**options, "weights": "rank0"},
                                          device="cpu")
            after_deal = dealt(x)
        dp = dist.get_rank(mesh["dp"].get_group())
        dynashard.export_safetensors(dealt, f"{tmp_path}/dp{dp}.safetensors", group=tp)
        host = host_group(tp)
    finally:
        del os.environ[HOST_GROUP_ENV]
    # (float32: the rowwise layer sums two partial products, in another order than one matmul: ~1e-7)
    assert (compiled - expected).abs().max() < 1e-5 and (after_deal - expected).abs().max() < 1e-5
    assert host is not tp and dist.get_process_group_ranks(host) == dist.get_process_group_ranks(tp)
    down = dict(dealt.named_parameters())["down.weight"].shape[1]
    assert down == 48, down  # the registered shard: half of 96
    devices = {str(p.device) for p in dealt.parameters()} | {str(dealt.down.weight.device)}
    assert devices == {"cpu"}, devices
    dist.barrier()  # (both files written)
    torch.manual_seed(0)
    reference = models.MLP(32, 96).state_dict()
    for dp in (0, 1):
        saved = load_file(f"{tmp_path}/dp{dp}.safetensors")
        assert sorted(saved) == sorted(reference), (dp, sorted(saved))
        assert all(torch.equal(saved[k], reference[k]) for k in reference), dp


@on_ranks.alone(2, gloo_timeout=GLOO_TIMEOUT, deadline_s=DEADLINE_S)
def test_a_companion_keeps_the_groups_rank_order_and_refuses_ranks_it_would_name_apart(rank, world):
    """Results gathered on the companion are indexed by the user's group rank (a group made with
    sort_ranks=False keeps its order); and ranks in different numbers of groups, whose companion torch
    would name differently on each (then both wait the whole timeout), raise at once on every rank.
    (Alone: its ranks end in different numbers of groups.)"""
    os.environ[HOST_GROUP_ENV] = "companion"
    reversed_group = dist.new_group([1, 0], sort_ranks=False)  # group rank 0 is global rank 1
    order = exchange_status(dist.get_rank(), None, reversed_group, "gathering")
    assert order == [1, 0], order  # group rank 0's payload first: global rank 1's
    assert dist.get_process_group_ranks(reversed_group) == [1, 0]
    assert dist.get_process_group_ranks(host_group(reversed_group)) == [1, 0]
    dist.new_group([0])  # rank 0 now belongs to one more group than rank 1
    error = raised(lambda: handshake(1, [], dist.group.WORLD))
    assert isinstance(error, SetupError), repr(error)
    # (rank 0: WORLD, the reversed group, its companion, [0]; rank 1 all but [0])
    assert "belong to different numbers of process groups ([4, 3]" in str(error), error
    assert "cpu:gloo,cuda:nccl" in str(error), error


@on_ranks.alone(2, dies=(1,), gloo_timeout=GLOO_TIMEOUT, deadline_s=DEADLINE_S,
                cases=["before_compile", "after_compile"])
def test_a_dead_peer_is_named_through_the_companion(rank, world, case):
    """The companion is made at the first handshake: a peer dead before it (the companion's own
    rendezvous waits for it) or after (the handshake's all_reduce on the companion fails) is a
    PeerError naming it within the group's timeout, not a hang."""
    os.environ[HOST_GROUP_ENV] = "companion"
    error, seconds = lose_rank1(rank, case)
    msg = str(error)
    # (at compile time Dynamo wraps it: BackendCompilerFailed, "PeerError: dynashard: ...")
    assert (type(error).__name__ == "PeerError" or "PeerError: dynashard" in msg), msg
    assert "ranks [1] did not get there" in msg, msg
    assert seconds < 3 * GLOO_TIMEOUT, seconds
