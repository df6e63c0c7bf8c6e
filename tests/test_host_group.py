"""The host-side protocol runs on a CPU-capable group over the user's ranks (``protocol.host_group``).

NCCL moves only CUDA tensors, so on an NCCL group the handshake, status exchanges and object gathers
run on a gloo companion. There is no NCCL here: a ``"cuda:gloo"`` group stands in for it (a gloo
backend registered for CUDA only: a CPU tensor's all_reduce on it raises "No backend type associated
with device type cpu", as on NCCL), and ``DYNASHARD_HOST_GROUP=companion`` makes every rank take the
companion path on the gloo groups a whole run needs.
"""

from __future__ import annotations

import pytest

from tests.battery import faults
from tests.multiproc import RankError, run_ranks, run_ranks_outcomes

pytestmark = pytest.mark.gloo

DEADLINE_S = 180  # each spawn takes 3-15 s on the quiet 2-core machine; 3x slower and busy, with a 2x margin
GLOO_TIMEOUT = 15  # seconds: a dead rank must surface as an error within about this long


def _forced(rank: int, world: int, fn, *args):
    """``fn(rank, world, *args)`` with the companion path forced on this rank (before any dynashard call)."""
    import os

    from dynashard.protocol import HOST_GROUP_ENV

    os.environ[HOST_GROUP_ENV] = "companion"
    return fn(rank, world, *args)


def _protocol_on_a_group_without_cpu(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from dynashard.errors import PeerError, UsageError
    from dynashard.protocol import CALL, exchange_status, first_rank_status, handshake, host_group

    group = dist.new_group(list(range(world)), backend="cuda:gloo")
    out: dict = {"cpu_on_group": None}
    try:
        dist.all_reduce(torch.zeros(1), group=group)
    except RuntimeError as e:  # what NCCL says to a CPU tensor
        out["cpu_on_group"] = str(e)
    host = host_group(group)
    out["companion"] = host is not group and host_group(group) is host
    out["host_ranks"] = dist.get_process_group_ranks(host)
    handshake(CALL, ["int64[2, 8]"], group)  # the same inputs: passes
    try:
        handshake(CALL, [f"int64[2, {8 + rank}]"], group)
    except UsageError as e:
        out["shapes"] = str(e)
    try:
        exchange_status(None, ValueError("bad weight") if rank == 1 else None, group, "planning")
    except (PeerError, ValueError) as e:
        out["status"] = (type(e).__name__, str(e))
    try:
        first_rank_status(UsageError("bad file") if rank == 0 else None, group, "reading")
    except (PeerError, UsageError) as e:
        out["first"] = (type(e).__name__, str(e))
    out["objects"] = exchange_status(("rank", rank), None, group, "gathering")
    return out


def test_the_protocol_runs_on_a_group_that_cannot_move_cpu_tensors():
    """On a group like NCCL's (no CPU backend) the handshake and every status exchange work, through
    the companion, and still tell the ranks apart: before, the handshake all_reduced a CPU tensor on
    the user's group and raised on the first call."""
    for rank, r in enumerate(run_ranks(_protocol_on_a_group_without_cpu, 2, timeout=DEADLINE_S)):
        assert "No backend type associated with device type cpu" in r["cpu_on_group"], r
        assert r["companion"] and r["host_ranks"] == [0, 1], r
        assert "int64[2, 8]" in r["shapes"] and "int64[2, 9]" in r["shapes"], r
        assert r["status"] == ("ValueError", "bad weight") if rank == 1 else \
            r["status"][0] == "PeerError" and "rank 1 failed during planning: ValueError: bad weight" in r["status"][1]
        assert r["first"][0] == ("UsageError" if rank == 0 else "PeerError") and "bad file" in r["first"][1], r
        assert r["objects"] == [("rank", 0), ("rank", 1)], r


def _companion_edge_cases(rank: int, world: int) -> dict:
    import os

    import torch.distributed as dist

    from dynashard.errors import SetupError
    from dynashard.protocol import HOST_GROUP_ENV, exchange_status, handshake, host_group

    os.environ[HOST_GROUP_ENV] = "companion"
    reversed_group = dist.new_group([1, 0], sort_ranks=False)  # group rank 0 is global rank 1
    out = {"order": exchange_status(dist.get_rank(), None, reversed_group, "gathering"),
           "group_ranks": dist.get_process_group_ranks(reversed_group),
           "host_ranks": dist.get_process_group_ranks(host_group(reversed_group))}
    dist.new_group([0])  # rank 0 now belongs to one more group than rank 1
    try:
        handshake(1, [], dist.group.WORLD)
    except SetupError as e:
        out["counts"] = str(e)
    return out


def test_a_companion_keeps_the_groups_rank_order_and_refuses_ranks_it_would_name_apart():
    """Results gathered on the companion are indexed by the user's group rank (a group made with
    sort_ranks=False keeps its order); and ranks in different numbers of groups, whose companion torch
    would name differently on each (then both wait the whole timeout), raise at once on every rank."""
    for r in run_ranks(_companion_edge_cases, 2, timeout=DEADLINE_S, gloo_timeout=GLOO_TIMEOUT):
        assert r["group_ranks"] == [1, 0] and r["host_ranks"] == [1, 0], r
        assert r["order"] == [1, 0], r  # group rank 0's payload first: global rank 1's
        # (rank 0: WORLD, the reversed group, its companion, [0]; rank 1 all but [0])
        assert "belong to different numbers of process groups ([4, 3]" in r["counts"], r
        assert "cpu:gloo,cuda:nccl" in r["counts"], r


def _runs_through_companions(rank: int, world: int, path: str) -> dict:
    """A 2x2 mesh: each tp pair compiles, parallelizes (rank 0's deal) and exports over its own group,
    every agreement on that group's companion."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dynashard
    from dynashard.protocol import host_group
    from tests import models

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
        dealt = dynashard.parallelize(models.MLP(32, 96), x, options={**options, "weights": "rank0"}, device="cpu")
        after_deal = dealt(x)
    dp = dist.get_rank(mesh["dp"].get_group())
    dynashard.export_safetensors(dealt, f"{path}/dp{dp}.safetensors", group=tp)
    host = host_group(tp)
    ranks = (dist.get_process_group_ranks(host), dist.get_process_group_ranks(tp))
    return {"compiled": (compiled - expected).abs().max().item(), "dealt": (after_deal - expected).abs().max().item(),
            "companion": host is not tp, "ranks": ranks, "down": dict(dealt.named_parameters())["down.weight"].shape[1],
            "devices": {str(p.device) for p in dealt.parameters()} | {str(dealt.down.weight.device)}}


def test_a_mesh_runs_with_each_tp_group_agreeing_on_its_companion(tmp_path):
    """Compile, rank 0's deal and export over the tp groups of a 2x2 mesh, each through a companion made
    by its two ranks alone (use_local_synchronization): the results equal the unsharded model's."""
    import torch
    from safetensors.torch import load_file

    from tests import models

    results = run_ranks(_forced, 4, _runs_through_companions, str(tmp_path), timeout=DEADLINE_S)
    torch.manual_seed(0)
    reference = models.MLP(32, 96).state_dict()
    for r in results:
        # (float32: the rowwise layer sums two partial products, in another order than one matmul: ~1e-7)
        assert r["compiled"] < 1e-5 and r["dealt"] < 1e-5, r
        assert r["companion"] and r["ranks"][0] == r["ranks"][1], r
        assert r["down"] == 48, r  # the registered shard: half of 96
        assert r["devices"] == {"cpu"}, r
    for dp in (0, 1):
        saved = load_file(str(tmp_path / f"dp{dp}.safetensors"))
        assert sorted(saved) == sorted(reference)
        assert all(torch.equal(saved[k], reference[k]) for k in reference)


@pytest.mark.parametrize("which", ["rank1_dies_before_compile", "rank1_dies_after_compile"])
def test_a_dead_peer_is_named_through_the_companion(which):
    """The companion is made at the first handshake: a peer dead before it (the companion's own
    rendezvous waits for it) or after (the handshake's all_reduce on the companion fails) is a
    PeerError naming it within the group's timeout, not a hang."""
    rank0, rank1 = run_ranks_outcomes(_forced, 2, faults, which, timeout=DEADLINE_S, gloo_timeout=GLOO_TIMEOUT)
    assert isinstance(rank1, RankError) and rank1.exc_type == "Died"
    kind, msg = rank0["error"]
    # (at compile time Dynamo wraps it: BackendCompilerFailed, "PeerError: dynashard: ...")
    assert (kind == "PeerError" or "PeerError: dynashard" in msg) and "ranks [1] did not get there" in msg, msg
    assert rank0["seconds"] < 3 * GLOO_TIMEOUT, rank0
