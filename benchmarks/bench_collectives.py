"""Cost of each collective dynashard can emit, on this machine's process group.

Launch: torchrun --standalone --nproc-per-node 4 -m benchmarks.bench_collectives [--rows 256 --features 1024]

Why it exists: dynashard picks between equivalent collectives by measurement (e.g. gloo's
reduce_scatter against an all-to-all plus a local sum for ``inputs="per_rank"``); this records
those numbers. Every tensor is built before timing; a barrier precedes every call; medians of
``--iters`` calls after 3 warm-up calls, slowest rank. ``--smoke`` uses tiny tensors.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks._common import OUT_HELP, init, out_path, record, summarize, time_interleaved, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--features", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", help=OUT_HELP)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.out = out_path(args.out, "collectives", args.smoke)
    if args.smoke:
        args.rows, args.features, args.iters = 4, 8, 2
    rank, world = init(1)
    rows, feats = args.rows, args.features
    big = torch.randn(world * rows, feats)  # every rank's rows: the partial sums of a rowwise linear
    small = torch.randn(rows, feats)  # this rank's rows
    out_small, out_big = torch.empty(rows, feats), torch.empty(world * rows, feats)
    tiny = torch.zeros(4, dtype=torch.int64)
    calls = {
        f"all_reduce [{world * rows}x{feats}]": lambda: dist.all_reduce(big),
        f"reduce_scatter [{world * rows}x{feats}] -> [{rows}x{feats}]":
            lambda: dist.reduce_scatter_tensor(out_small, big),
        f"all_to_all [{world * rows}x{feats}] + sum": lambda: dist.all_to_all_single(out_big, big)
        or out_big.view(world, rows, feats).sum(0),
        f"all_to_all [{rows}x{feats}]": lambda: dist.all_to_all_single(out_small, small),
        f"all_gather [{rows}x{feats}] -> [{world * rows}x{feats}]": lambda: dist.all_gather_into_tensor(out_big, small),
        "all_reduce of 4 int64 (latency)": lambda: dist.all_reduce(tiny),
    }
    times = time_interleaved(calls, 3, args.iters)
    results = summarize(rank, {name: {"first_s": 0.0, "max_abs_diff": 0.0} for name in calls}, times)
    if rank == 0:
        print(f"collectives on {world} ranks (gloo, 1 thread per rank), median of {args.iters}, slowest rank\n")
        print("| collective | median ms | min ms |\n|---|---:|---:|")
        for r in results:
            print(f"| {r['system']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} |")
        write_json(args.out, record({"rows": rows, "features": feats, "iters": args.iters}, results, world, 1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
