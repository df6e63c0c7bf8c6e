"""What the per-call agreement costs: every call of a dynashard graph first compares the ranks'
input shapes in one all_reduce of 6 int64 (``check_inputs="shapes"``, the default; ``"values"``
adds a checksum of the input values; ``"off"`` skips it), so that ranks calling with different
shapes get a clear error instead of a gloo abort or a hang.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_call_check [--hidden 1024 --ffn 4096]

Systems, timed interleaved (one call of each per round, a barrier before every call), slowest
rank's median: the same residual MLP block (``x + down(gelu(up(x)))``, one all_reduce) compiled
three times with dynashard, ``check_inputs`` "off", "shapes" and "values"; ratios to "off". The
outputs are checked against the unsharded block. ``--smoke`` runs tiny sizes, 2 iterations.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks._common import MLP, OUT_HELP, init, out_path, record, summarize, time_interleaved, write_json

CHECKS = ("off", "shapes", "values")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--out", help=OUT_HELP)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.out = out_path(args.out, "call_check", args.smoke)
    if args.smoke:
        args.hidden, args.ffn, args.tokens, args.iters, args.compiler = 16, 64, [1, 4], 2, "eager"
    rank, world = init(1)
    models, compiled = {}, {}
    for check in CHECKS:
        torch.manual_seed(0)
        models[check] = MLP(args.hidden, args.ffn)
        options = {"compiler": args.compiler, "min_shard_numel": 0, "check_inputs": check}
        compiled[check] = torch.compile(models[check], backend="dynashard", options=options)
    torch.manual_seed(0)
    unsharded = MLP(args.hidden, args.ffn)
    rows = []
    with torch.no_grad():
        for tokens in args.tokens:
            x = torch.randn(1, tokens, args.hidden)
            ref = unsharded(x)
            errors = {c: float((compiled[c](x) - ref).abs().max()) for c in CHECKS}  # also compiles
            calls = {f"check_inputs={c}": (lambda c=c, x=x: compiled[c](x)) for c in CHECKS}
            times = time_interleaved(calls, 3, args.iters)
            per_system = {f"check_inputs={c}": {"first_s": 0.0, "max_abs_diff": errors[c]} for c in CHECKS}
            results = summarize(rank, per_system, times)
            off = results[0]["median_ms"]
            for r in results:
                rows.append({"tokens": tokens, "system": r["system"], "median_ms": r["median_ms"],
                             "min_ms": r["min_ms"], "vs_off": r["median_ms"] / off, "max_abs_diff": r["max_abs_diff"]})
    bad = [r for r in rows if r["max_abs_diff"] > 1e-3]
    if rank == 0:
        print(f"per-call agreement on {world} ranks (gloo, 1 thread per rank), MLP {args.hidden}x{args.ffn}, "
              f"{args.compiler}, median of {args.iters}, slowest rank\n")
        print("| tokens | system | median ms | min ms | vs off | max abs diff |\n|---:|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['tokens']} | {r['system']} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | "
                  f"{r['vs_off']:.2f}x | {r['max_abs_diff']:.1e} |")
        config = {"hidden": args.hidden, "ffn": args.ffn, "tokens": args.tokens, "iters": args.iters,
                  "compiler": args.compiler}
        write_json(args.out, record(config, rows, world, 1))
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"outputs differ from the unsharded block: {bad}")


if __name__ == "__main__":
    main()
