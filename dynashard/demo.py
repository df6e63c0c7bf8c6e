"""The two-minute demo: ``torchrun --standalone --nproc-per-node 2 -m dynashard.demo``.

Builds a small pre-norm transformer (same seed on every rank; attention with a hard-coded head
count, written with views and transposes, no edits for sharding), prints the plan, compiles it
with dynashard, runs three batch shapes through one compiled model and prints the largest
difference to the unsharded model and the weight bytes each rank keeps.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dynashard


class Block(nn.Module):
    HEADS = 8  # hard-coded, as models are written: dynashard gives each rank its share of heads

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):
        b, t, c = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.HEADS, c // self.HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, hidden: int, ffn: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, ffn) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager"])
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if torch.cuda.is_available():  # one GPU per rank, NCCL (dynashard's host-side checks run on gloo beside it)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model(args.hidden, args.ffn, args.depth).to(device)
    inputs = [torch.randn(b, s, args.hidden).to(device) for b, s in ((2, 16), (3, 40), (1, 7))]
    with torch.no_grad():
        references = [model(x) for x in inputs]
        if rank == 0:
            print(dynashard.explain(model, inputs[0]))
        total = dynashard.held_bytes(model)
        fast = torch.compile(model, backend="dynashard", options={"compiler": args.compiler})
        diffs = [float((fast(x) - ref).abs().max()) for x, ref in zip(inputs, references)]
    kept = dynashard.held_bytes(model)
    report = f"rank {rank}/{world}: max |sharded - unsharded| = {max(diffs):.2e} over batch shapes " + ", ".join(
        str(tuple(x.shape)) for x in inputs
    )
    report += f"; parameter bytes held {kept / 2**20:.1f} MiB of {total / 2**20:.1f} MiB"
    for r in range(world):
        if r == rank:
            print(report, flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
