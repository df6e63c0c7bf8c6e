"""Measures a fused ``[q | k | v]`` weight as a DTensor on the tp mesh, under FSDP2 over dp,
read back through ``full_tensor()`` and DCP's default planners (torch's own protocol, no dynashard).

    torchrun --standalone --nproc-per-node 4 tools/proto_fused_fsdp2.py /tmp/fused_proto

On a 2x2 (dp x tp) gloo mesh, a [24, 8] weight ``[q | k | v]`` (8 rows each), tp rank r holding
``[q_r; k_r; v_r]``: ``_StridedShard(0, split_factor=3)`` on tp. Prints, on rank 0, whether

- the 1-D tp DTensor's ``full_tensor()`` is the weight;
- after ``fully_shard`` over dp on dim 0 (FSDP's default: placements ``(_StridedShard(0, sf=2),
  _StridedShard(0, sf=3))``) and on dim 1 (``shard_placement_fn``: ``(Shard(1), _StridedShard(0, sf=3))``),
  ``full_tensor()`` is the weight;
- ``dcp.save`` of the 1-D and the dim-1 2-D DTensor writes the weight (read back whole in one process);
- ``dcp.load`` of the saved weight into a 1-D and the dim-1 2-D DTensor fills them with their rows.

Measured (torch 2.13, CPU): 1-D full_tensor right; dim 0 wrong, dim 1 right; both saves refused ("overlapping
chunks"); both loads wrong without an error (hence dynashard's ``dtensor_params.checkpointable``).
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def main() -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    r, e, path = mesh["tp"].get_local_rank(), 8, sys.argv[1]
    torch.manual_seed(0)
    w = torch.randn(3 * e, e)
    mine = torch.cat([w[c * e + r * e // 2: c * e + (r + 1) * e // 2] for c in range(3)])

    def tp_weight() -> DTensor:
        return DTensor.from_local(mine.clone(), mesh["tp"], [_StridedShard(0, split_factor=3)], run_check=False,
                                  shape=w.shape, stride=w.stride())

    def fsdp_weight(dim: int) -> DTensor:
        linear = nn.Linear(e, 3 * e, bias=False)
        linear.weight = nn.Parameter(tp_weight())
        fully_shard(linear, mesh=mesh["dp"], shard_placement_fn=lambda _: Shard(dim))
        return linear.weight

    out = {"1-D full_tensor": torch.equal(tp_weight().full_tensor(), w)}
    for dim in (0, 1):
        p = fsdp_weight(dim)
        out[f"dp on dim {dim} {p.placements}: full_tensor"] = torch.equal(p.full_tensor(), w)
    if dist.get_rank() == 0:
        dcp.save({"w": w}, checkpoint_id=f"{path}/whole", no_dist=True)
    dist.barrier()
    for name, make in (("1-D", tp_weight), ("dp on dim 1", lambda: fsdp_weight(1))):
        try:
            dcp.save({"w": make()}, checkpoint_id=f"{path}/{name}")
            back = torch.zeros_like(w)
            dcp.load({"w": back}, checkpoint_id=f"{path}/{name}", no_dist=True)
            out[f"{name}: dcp.save"] = torch.equal(back, w)
        except BaseException as error:  # (DCP raises a CheckpointException, a BaseException)
            why = "overlapping chunks" if "overlapping chunks" in str(error) else type(error).__name__
            out[f"{name}: dcp.save"] = f"refused ({why})"
        target = make()
        with torch.no_grad():
            target.to_local().zero_()
        dcp.load({"w": target}, checkpoint_id=f"{path}/whole")
        out[f"{name}: dcp.load"] = torch.equal(target.full_tensor(), w)
    if dist.get_rank() == 0:
        for k, v in out.items():
            print(f"{k}: {v}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
