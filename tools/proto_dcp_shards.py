"""Measures plain local shards saved by ``torch.distributed.checkpoint`` at their
global offsets, for every layout dynashard cuts (not only DTensor's ``torch.chunk`` layouts), with
``dynashard.weights.dcp_planners.make_checkpointable`` (what ``dynashard.parallelize`` puts on its shards).

DCP asks a state-dict value for ``__create_write_items__``,
``__create_chunk_list__`` and ``__get_tensor_shard__`` (DTensor's ``_Checkpointable`` protocol,
``torch/distributed/checkpoint/planner_helpers.py``); set on the shard tensor itself, they describe
this rank's pieces of a dim as chunks of the global tensor. Whole components every rank holds are
the same chunk on every rank, which DCP's save planner deduplicates.

    torchrun --standalone --nproc-per-node 2 tools/proto_dcp_shards.py /tmp/dcp_proto

Saves, at world 2, a [96, 40] weight cut four ways (balanced; a fused [q | k | v] per component;
k and v held whole; 93 rows dealt 47/46 and 3 held whole), then checks that (1) ``dcp.load`` into a
plain full tensor in one process gives the original and (2) ``dynashard.load.checkpoint`` reads every
rank's pieces back at worlds 2 and 4. Loading back *into* the plain shards through ``dcp.load``
fails ("Size mismatch between saved [96, 40] and current [48, 40]": the default load planner
compares a non-DTensor's own size): loading goes through dynashard's reader instead.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynashard.layout.split import Split  # noqa: E402
from dynashard.load.checkpoint import open_checkpoint  # noqa: E402
from dynashard.weights.dcp_planners import make_checkpointable  # noqa: E402
from dynashard.weights.store import cut  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = torch.randn(96, 40)
    splits = {"balanced": Split((96,)), "fused": Split((48, 24, 24)),
              "whole_kv": Split((64, 16, 16), whole=frozenset({1, 2})), "uneven": Split((93, 3), whole=frozenset({1}))}
    for name, split in splits.items():
        shard = make_checkpointable(cut(full, 0, split, world, rank).clone(), full.shape, 0,
                                    split.pieces(world, rank))
        path = os.path.join(sys.argv[1], name)
        dcp.save({"w": shard}, checkpoint_id=path)
        dist.barrier()
        if rank == 0:
            whole = torch.zeros_like(full)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({"w": whole}, checkpoint_id=path, no_dist=True)
            back = all(torch.equal(open_checkpoint(path).read("w", 0, split.pieces(n, r)), cut(full, 0, split, n, r))
                       for n in (2, 4) for r in range(n))
            print(f"{name}: saved at world 2; loaded whole at world 1: {torch.equal(whole, full)}; "
                  f"read back at worlds 2 and 4: {back}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
