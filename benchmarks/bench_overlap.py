"""Does overlapping a rowwise all_reduce with the next chunk's matmuls pay here? (async-TP style)

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_overlap [--tokens 256] [--smoke]

The suite's MLP pair (hidden 1024, ffn 4096) sharded by hand on this rank's 1/N weights,
``all_reduce(gelu(x @ Wu^T) @ Wd^T)`` with funcol, written three ways and compiled with Inductor
(and run eagerly): "plain" (one matmul pair, one all_reduce), and "chunks k" (the tokens cut into
k chunks; chunk i's all_reduce is issued before chunk i+1's matmuls, all waited at the end, so
gloo's transport thread can move chunk i while the compute thread works on chunk i+1). This is the
overlap dynashard could emit; the measurement decides whether it should. Timing as in _common
(interleaved, barrier before every call, slowest rank's median); outputs checked against "plain".
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from benchmarks._common import OUT_HELP, init, out_path, record, summarize, time_interleaved, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", help=OUT_HELP)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.out = out_path(args.out, "overlap", args.smoke)
    if args.smoke:
        args.tokens, args.hidden, args.ffn, args.iters = 8, 16, 32, 2
    rank, world = init(1)
    group = dist.group.WORLD.group_name
    torch.manual_seed(0)
    w_up = torch.randn(args.ffn // world, args.hidden) / args.hidden**0.5
    w_down = torch.randn(args.hidden, args.ffn // world) / args.ffn**0.5
    x = torch.randn(args.tokens, args.hidden)

    def chunked(x: torch.Tensor, k: int) -> torch.Tensor:
        pending = [funcol.all_reduce(F.gelu(c @ w_up.t()) @ w_down.t(), "sum", group) for c in x.tensor_split(k, 0)]
        return torch.cat([funcol.wait_tensor(p) for p in pending])

    ways = {"plain": 1, "chunks 2": 2, "chunks 4": 4}
    calls = {}
    for name, k in ways.items():
        fn = lambda x, k=k: chunked(x, k)  # noqa: E731
        calls[f"eager {name}"] = fn
        calls[f"inductor {name}"] = torch.compile(fn, dynamic=False)
    with torch.no_grad():
        reference = chunked(x, 1)
        per_system = {}
        for name, fn in calls.items():
            per_system[name] = {"first_s": 0.0, "max_abs_diff": float((fn(x) - reference).abs().max())}
        times = time_interleaved({n: (lambda fn=fn: fn(x)) for n, fn in calls.items()}, 3, args.iters)
    results = summarize(rank, per_system, times)
    bad = [r["system"] for r in results if r["max_abs_diff"] > 1e-4]  # same sums, other grouping: ~1e-6
    if rank == 0:
        print(f"overlap by chunking, {args.tokens} tokens, world {world}, median of {args.iters}, slowest rank\n")
        base = {r["system"].split()[0]: r["median_ms"] for r in results if r["system"].endswith("plain")}
        print("| system | median ms | min ms | vs plain |\n|---|---:|---:|---:|")
        for r in results:
            ratio = r["median_ms"] / base[r["system"].split()[0]]
            print(f"| {r['system']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {ratio:.2f} |")
        config = {"tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "iters": args.iters}
        write_json(args.out, record(config, results, world, 1))
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"outputs differ from plain: {bad}")


if __name__ == "__main__":
    main()
