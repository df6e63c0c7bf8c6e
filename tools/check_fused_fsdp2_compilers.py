"""nanoGPT's fused ``c_attn`` under FSDP2 x dynashard on a 2x2 (dp x tp) gloo mesh, beyond what
tests/test_training_2d.py runs (eager compiler, float32): one training step compiled with Inductor, or with
FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (``--bf16``), against the unsharded float32 twin.

    PYTHONPATH=. torchrun --standalone --nproc-per-node 4 tools/check_fused_fsdp2_compilers.py [--bf16]

Both dp replicas take the same batch, so FSDP's dp average of the gradient is the twin's gradient on it. Prints
each rank's worst gradient error relative to the largest element of the twin's gradient: 7.5e-7 with Inductor
in float32, 1.4e-2 with bfloat16 parameters (measured 2026-12-03; a missing or doubled gradient is 0.5-1.0).
"""

import argparse
import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dynashard
from tests import models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bf16", action="store_true", help="FSDP2 gathers bfloat16 parameters")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = models.build("nanogpt", 32, 96)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    options = {"group": mesh["tp"], "min_shard_numel": 0}
    dynashard.parallelize(model, ids, options=options, dtensor=True)
    extra = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if args.bf16 else {}
    fully_shard(model, mesh=mesh["dp"], shard_placement_fn=dynashard.fsdp_shard_placement, **extra)
    fast = torch.compile(model, backend="dynashard", options=options)
    fast(ids).float().pow(2).mean().backward()
    twin(ids).float().pow(2).mean().backward()
    reference = dict(twin.named_parameters())
    worst = max(((p.grad.full_tensor().float() - reference[n].grad).abs().max() / reference[n].grad.abs().max()).item()
                for n, p in model.named_parameters())
    print(f"rank {dist.get_rank()}: worst gradient error, relative to the twin's largest element: {worst:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
