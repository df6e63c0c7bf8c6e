"""Fused qkv with fewer KV heads than ranks (Falcon-style MQA, Phi-3-style GQA): latency and memory.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_fused_kv [--smoke] [--out PATH]

Model: one ``qkv_proj`` producing [q | k | v] (``heads`` query heads, ``kv`` KV heads, sliced
apart), RoPE-free causal SDPA with K/V repeated by expand + reshape, ``o_proj``; input
[1, tokens, hidden], identical on every rank. With ``kv`` below the world size the K/V heads
cannot be cut: dynashard holds k and v whole inside each rank's slice of the fused weight and
cuts q (and ``o_proj``) by heads. The alternative, the whole fused projection kept whole and with
it the attention, is what "unsharded" measures.

Systems: unsharded eager / inductor, dynashard eager / inductor (plan "auto"). Timing, the
correctness check (exit 1 above --tol) and the report follow the suite (``suite.py``).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._common import (
    OUT_HELP,
    init,
    mib,
    out_path,
    record,
    rss,
    summarize,
    time_call,
    time_interleaved,
    write_json,
)
from dynashard import held_bytes

SYSTEMS = ("unsharded eager", "unsharded inductor", "dynashard eager", "dynashard inductor")


class FusedKVAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv: int) -> None:
        super().__init__()
        self.heads, self.kv, self.dh = heads, kv, hidden // heads
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv) * self.dh, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.heads * self.dh, self.kv * self.dh, self.kv * self.dh], -1)
        q = q.view(b, t, self.heads, self.dh).transpose(1, 2)
        k = k.view(b, t, self.kv, self.dh).transpose(1, 2)
        v = v.view(b, t, self.kv, self.dh).transpose(1, 2)
        n = self.heads // self.kv
        k = k[:, :, None].expand(b, self.kv, n, t, self.dh).reshape(b, self.heads, t, self.dh)
        v = v[:, :, None].expand(b, self.kv, n, t, self.dh).reshape(b, self.heads, t, self.dh)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, Dynamo-only compiles (seconds)")
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    args.out = out_path(args.out, "fused_kv", args.smoke)
    if args.smoke:
        args.hidden, args.heads, args.tokens, args.iters, args.warmup = 64, 8, 8, 2, 1
    rank, world = init()
    torch.manual_seed(0)
    base = FusedKVAttention(args.hidden, args.heads, args.kv).eval()
    x = torch.randn(1, args.tokens, args.hidden)
    systems = [s for s in SYSTEMS if not (args.smoke and s.endswith("inductor"))]
    calls, per_system = {}, {}
    with torch.no_grad():
        want = base(x)
        for name in systems:
            model = copy.deepcopy(base)
            kind, compiler = name.split()
            if kind == "dynashard":
                fn = torch.compile(model, backend="dynashard", options={"compiler": compiler, "min_shard_numel": 0})
            else:
                fn = torch.compile(model) if compiler == "inductor" else model
            first = time_call(lambda fn=fn: fn(x))
            diff = float((fn(x) - want).abs().max())
            per_system[name] = {"first_s": first, "max_abs_diff": diff, "param_bytes": held_bytes(model), **rss()}
            calls[name] = lambda fn=fn: fn(x)
        times = time_interleaved(calls, args.warmup, args.iters)
    results = summarize(rank, per_system, times)
    if rank == 0:
        base_ms = {r["system"]: r["median_ms"] for r in results}
        print(f"fused qkv attention: hidden {args.hidden}, {args.heads} heads, {args.kv} KV heads, "
              f"{args.tokens} tokens, world {world}")
        print("| system | median ms | vs unsharded same compiler | max abs diff | params held MiB |")
        print("|---|---:|---:|---:|---:|")
        for r in results:
            ref = base_ms.get("unsharded " + r["system"].split()[1])
            print(f"| {r['system']} | {r['median_ms']:.2f} | {r['median_ms'] / ref:.2f} | "
                  f"{r['max_abs_diff']:.1e} | {mib(max(p['param_bytes'] for p in r['per_rank']))} |")
        write_json(args.out, record(vars(args), results, world, torch.get_num_threads()))
    bad = [r["system"] for r in results if r["max_abs_diff"] is not None and r["max_abs_diff"] > args.tol]
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"outputs differ from the unsharded model beyond {args.tol}: {bad}")


if __name__ == "__main__":
    main()
