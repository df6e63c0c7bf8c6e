"""Latency of one tensor-parallel MLP block: dynashard against unsharded and DTensor baselines.

Launch: torchrun --standalone --nproc-per-node 2 benchmarks/bench_mlp.py [--smoke] [--out PATH]

Model: ``x + down(gelu(up(x)))`` with nn.Linear layers (hidden -> ffn -> hidden), built from the
same seed on every rank, input [1, tokens, hidden] (identical on every rank). Each system gets
its own deep copy of the model (dynashard frees the full weights of the model it compiles):

- unsharded eager / unsharded inductor (``torch.compile(model)``): every rank computes it all;
- DTensor eager / DTensor inductor: ``parallelize_module`` with ColwiseParallel on ``up`` and
  RowwiseParallel on ``down`` (then ``torch.compile`` of the parallelized module);
- dynashard eager / dynashard inductor: ``torch.compile(model, backend="dynashard",
  options={"compiler": ..., "min_shard_numel": ...})`` with plan "auto".

Timing (all under torch.no_grad()): a barrier before every call and only the call is timed.
Every system is built and called once first (that first call includes compilation; Inductor's
on-disk cache may make it warm), then the systems are timed interleaved, one call each per
round: ``warmup`` untimed rounds, then ``iters`` timed ones, so load drift on a shared machine
hits every system alike. Each rank times itself; the slowest rank's median (and min) is reported. Correctness: max abs difference
to the unsharded eager output (worst rank). Memory: parameter bytes each rank still holds
(DTensor local shards / dynashard shards) and process RSS (VmRSS, VmHWM) after each system.
Exits 1 when any max abs diff exceeds --tol (so --smoke doubles as a CI check).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn

from _common import MLP, held_bytes, init, mib, record, rss, summarize, time_call, time_interleaved, write_json

SYSTEMS = (
    "unsharded eager",
    "unsharded inductor",
    "dtensor eager",
    "dtensor inductor",
    "dynashard eager",
    "dynashard inductor",
)


def build(system: str, base: nn.Module, world: int, min_shard_numel: int) -> tuple[nn.Module, nn.Module]:
    """(the module whose parameters to inspect, the callable to time) for one system."""
    model = copy.deepcopy(base)
    kind, compiler = system.split()
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if kind == "dynashard":
        options = {"compiler": compiler, "min_shard_numel": min_shard_numel}
        return model, torch.compile(model, backend="dynashard", options=options)
    return model, (torch.compile(model) if compiler == "inductor" else model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tol", type=float, default=1e-3, help="exit 1 if any max abs diff exceeds this")
    ap.add_argument("--min-shard-numel", type=int, default=1 << 16, help="dynashard option (its default: 65536)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of: " + ", ".join(SYSTEMS))
    ap.add_argument("--out", default="benchmarks/results/mlp.json")
    ap.add_argument("--smoke", action="store_true", help="CI sizes: hidden 64, ffn 256, tokens 8, min-shard-numel 0")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.ffn, args.tokens, args.iters, args.warmup = 64, 256, 8, 2, 1
        args.min_shard_numel = 0  # the smoke weights are below dynashard's default threshold
        if args.out == ap.get_default("out"):
            args.out = "benchmarks/results/mlp_smoke.json"
    systems = [s.strip() for s in args.systems.split(",")]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}")

    rank, world = init(args.threads)
    torch.manual_seed(0)  # same weights and input on every rank
    base = MLP(args.hidden, args.ffn).eval()
    x = torch.randn(1, args.tokens, args.hidden)
    with torch.no_grad():
        ref = base(x)

    # Build every system and make its first (compiling) call, then time them interleaved: each
    # round calls every system once, so drift on a shared 2-core machine hits all systems alike.
    built, first, diffs, mem = {}, {}, {}, {}
    for system in systems:
        model, fn = build(system, base, world, args.min_shard_numel)
        with torch.no_grad():
            first[system] = time_call(lambda: fn(x))  # noqa: B023
            diffs[system] = (fn(x) - ref).abs().max().item()
        built[system] = fn
        mem[system] = {"held_param_bytes": held_bytes(model), **rss()}
    with torch.no_grad():
        times = time_interleaved({s: (lambda fn=built[s]: fn(x)) for s in systems}, args.warmup, args.iters)
    per_system = {s: {"first_s": first[s], "max_abs_diff": diffs[s], **mem[s]} for s in systems}
    results = summarize(rank, per_system, times)

    if rank == 0:
        by_name = {r["system"]: r["median_ms"] for r in results}

        def ratio(ms: float, base_name: str) -> str:
            return f"{ms / by_name[base_name]:.2f}" if base_name in by_name else "n/a"

        print(f"\nMLP hidden={args.hidden} ffn={args.ffn} tokens={args.tokens}, world {world}, "
              f"{args.threads} thread(s)/rank, median of {args.iters} after {args.warmup} warm-up (slowest rank)")
        print("ratio = this system's median / the baseline's (lower is faster)\n")
        print("| system | median ms (slowest rank) | min ms | ratio vs DTensor compiled | ratio vs DTensor eager "
              "| ratio vs unsharded eager | first-call (compile) s | max abs diff |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in results:
            ms = r["median_ms"]
            print(f"| {r['system']} | {ms:.2f} | {r['min_ms']:.2f} | {ratio(ms, 'dtensor inductor')} "
                  f"| {ratio(ms, 'dtensor eager')} | {ratio(ms, 'unsharded eager')} "
                  f"| {r['first_call_s']:.2f} | {r['max_abs_diff']:.3g} |")
        rss_cols = " | ".join(f"rank {i} RSS / peak MiB" for i in range(world))
        print(f"\n| system | params held MiB/rank | {rss_cols} |")
        print("|---|---:|" + "---:|" * world)
        for r in results:
            held = "/".join(sorted({f"{p['held_param_bytes'] / 2**20:.3f}" for p in r["per_rank"]}))
            mem = " | ".join(f"{mib(p['VmRSS'])} / {mib(p['VmHWM'])}" for p in r["per_rank"])
            print(f"| {r['system']} | {held} | {mem} |")
        keys = ("hidden", "ffn", "tokens", "iters", "warmup", "min_shard_numel", "smoke")
        config = {k: getattr(args, k) for k in keys}
        config.update(input_shape=list(x.shape), dtype=str(x.dtype), systems=systems, plan="auto", backend="gloo")
        write_json(args.out, record(config, results, world, args.threads))
        print(f"\nwrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()
    worst = max(r["max_abs_diff"] for r in results)
    if worst > args.tol:
        raise SystemExit(f"max abs diff {worst:.3g} exceeds --tol {args.tol:g}")


if __name__ == "__main__":
    main()
