"""The seed prototype's scenario: its fx algorithm against dynashard, per call, side by side.

Launch: torchrun --standalone --nproc-per-node 4 -m benchmarks.bench_seed [--smoke] [--out PATH]

Scenario (docs/design.md, "The seed prototype"): every rank runs torch.manual_seed(rank), builds its own
nn.Linear(in, out), then its own batch torch.rand(batch, in): different weights and inputs per
rank, and each rank must get its own model's output on its own batch. Systems (each builds its
own model from the same seed; the batch is the same):

- unsharded: each rank runs its own nn.Linear (the reference; no communication);
- seed algorithm: the seed's shard_model + apply_fx ported below unchanged except for the
  pattern (see ``seed_apply_fx``): weight blocks exchanged once with all_to_all; per call an
  all_to_all of the input, world matmuls, world all_reduces, cat and narrow (static batch size);
- dynashard eager / dynashard inductor: torch.compile(model, backend="dynashard", options=
  {"inputs": "per_rank", "weights": "per_rank", "plan": {"*": "rowwise"}, "compiler": ...}):
  per call one all_to_all, one batched matmul, one reduce_scatter.

Timing as in the suite (all under torch.no_grad()): every system is set up and called once
("first call s" covers setup, tracing/compiling and that call), then the systems are timed
interleaved, one call each per round after a barrier: ``warmup`` untimed rounds, then ``iters``
timed ones. The slowest rank's median and min are reported. Correctness: max abs difference to
the unsharded output of the same rank (worst rank, first call and a call after timing).
Exits 1 when any max abs diff exceeds --tol.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.fx import replace_pattern, symbolic_trace

from benchmarks._common import OUT_HELP, gather, init, out_path, record, rss, summarize, time_interleaved, write_json

SYSTEMS = ("unsharded", "seed algorithm", "dynashard eager", "dynashard inductor")
OPTIONS = {"inputs": "per_rank", "weights": "per_rank", "plan": {"*": "rowwise"}}


# --- the seed prototype's algorithm (not in this repository), ported --------------------------------
def all_reduce(inp):
    dist.all_reduce(inp)
    return inp


def all_to_all(out, inp):
    dist.all_to_all_single(out, inp)
    return out


torch.fx.wrap("all_reduce")
torch.fx.wrap("all_to_all")


def seed_shard_model(model: torch.nn.Linear) -> None:
    """Rank j keeps input-feature block j of every rank's weight (block s of its new weight: rank s's)."""
    inp = model.weight
    output = torch.empty_like(inp.t().contiguous())
    all_to_all(output, inp.t().contiguous())
    model.weight = torch.nn.Parameter(output.t())


def seed_apply_fx(traced_model, rank: int, world_size: int, batch_size: int):
    """The seed's rewrite; returns (module, matches). Only ``pattern`` differs from the seed."""
    shard_size = traced_model.weight.size(1) // world_size

    def pattern(input_1, weight, bias):
        # The seed's F.linear(input_1, weight, bias=bias) traces to torch._C._nn.linear with bias as
        # a kwarg, while nn.Linear's trace passes it positionally, so it matches nothing on 2.13.
        return torch._C._nn.linear(input_1, weight, bias)

    def replacement(input_1, weight, bias):
        inp = input_1.t().contiguous()
        gathered_input = torch.empty_like(inp)
        gathered_input = all_to_all(gathered_input, inp)
        gathered_input = gathered_input.t()
        out = weight.as_strided((0,), (0,))  # the seed's empty-tensor trick
        for r in range(world_size):
            inp = torch.narrow(gathered_input, 1, r * shard_size, shard_size)
            w = torch.narrow(weight, 1, r * shard_size, shard_size)
            res = inp.matmul(w.t().contiguous())
            res = all_reduce(res)
            out = torch.cat((out, res))
        return torch.narrow(out, 0, rank * batch_size, batch_size) + bias

    matches = replace_pattern(traced_model, pattern, replacement)
    traced_model.recompile()
    return traced_model, matches


# --- the benchmark ---------------------------------------------------------------------------------
def make(args, rank: int) -> tuple[torch.nn.Linear, torch.Tensor]:
    """This rank's own model and batch, in the seed's order: seed, Linear, batch."""
    torch.manual_seed(rank)
    model = torch.nn.Linear(args.in_features, args.out_features).eval()
    return model, torch.rand(args.batch, args.in_features)


def build(system: str, model: torch.nn.Linear, rank: int, world: int, batch: int):
    if system == "unsharded":
        return model
    if system == "seed algorithm":
        seed_shard_model(model)
        gm, matches = seed_apply_fx(symbolic_trace(model), rank, world, batch)
        assert len(matches) > 0, "seed pattern matched nothing: the benchmark would time a plain linear"
        return gm
    return torch.compile(model, backend="dynashard", options={**OPTIONS, "compiler": system.split()[1]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in-features", type=int, default=1024)
    ap.add_argument("--out-features", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tol", type=float, default=1e-3, help="exit 1 if any max abs diff exceeds this")
    ap.add_argument("--out", help=OUT_HELP)
    ap.add_argument("--smoke", action="store_true", help="the seed's sizes: Linear(64, 24), batch 100, 2 iters")
    args = ap.parse_args()
    args.out = out_path(args.out, "seed", args.smoke)
    if args.smoke:
        args.in_features, args.out_features, args.batch, args.iters, args.warmup = 64, 24, 100, 2, 1

    rank, world = init(args.threads)
    assert args.in_features % world == 0, "the seed's all_to_all splits in_features evenly"
    model, x = make(args, rank)
    with torch.no_grad():
        ref = model(x)
    # Per-rank models must really differ, or "each rank's own output" would test nothing.
    assert len(set(gather(ref.sum().item()))) == world, "ranks built identical models"

    built, first, diffs, mem = {}, {}, {}, {}
    for system in SYSTEMS:
        model, x_again = make(args, rank)
        assert torch.equal(x_again, x)
        dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            fn = build(system, model, rank, world, args.batch)
            y = fn(x)
        first[system] = time.perf_counter() - t0
        if system.startswith("dynashard"):  # per_rank weights: the shard is as large as the weight, freed
            assert model.weight.untyped_storage().nbytes() == 0, f"{system}: weight was not sharded and freed"
        built[system], diffs[system], mem[system] = fn, (y - ref).abs().max().item(), rss()

    with torch.no_grad():
        times = time_interleaved({s: (lambda fn=built[s]: fn(x)) for s in SYSTEMS}, args.warmup, args.iters)
        for system in SYSTEMS:
            diffs[system] = max(diffs[system], (built[system](x) - ref).abs().max().item())
    per_system = {s: {"first_s": first[s], "max_abs_diff": diffs[s], **mem[s]} for s in SYSTEMS}
    results = summarize(rank, per_system, times)

    if rank == 0:
        ms = {r["system"]: r["median_ms"] for r in results}
        print(f"\nseed scenario: Linear({args.in_features}, {args.out_features}), batch {args.batch}, "
              f"per-rank weights and inputs, world {world}, {args.threads} thread(s)/rank, "
              f"median of {args.iters} after {args.warmup} warm-up (slowest rank)")
        print("ratio = this system's median / the baseline's (lower is faster); speedup = seed / this\n")
        print("| system | median ms (slowest rank) | min ms | ratio vs seed algorithm | speedup over seed "
              "| ratio vs unsharded | first call s (incl. setup) | max abs diff |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in results:
            m = r["median_ms"]
            print(f"| {r['system']} | {m:.3f} | {r['min_ms']:.3f} | {m / ms['seed algorithm']:.2f} "
                  f"| {ms['seed algorithm'] / m:.2f}x | {m / ms['unsharded']:.2f} "
                  f"| {r['first_call_s']:.2f} | {r['max_abs_diff']:.3g} |")
        target = {s: ms["seed algorithm"] / ms[s] for s in SYSTEMS if s.startswith("dynashard")}
        verdict = ", ".join(f"{s} {v:.2f}x ({'met' if v >= 3 else 'NOT met'})" for s, v in target.items())
        print(f"\ntarget dynashard >= 3x faster than the seed algorithm: {verdict}")
        keys = ("in_features", "out_features", "batch", "iters", "warmup", "tol", "smoke")
        config = {k: getattr(args, k) for k in keys}
        config.update(input_shape=list(x.shape), dtype=str(x.dtype), systems=list(SYSTEMS), options=OPTIONS,
                      backend="gloo", speedup_over_seed=target)
        write_json(args.out, record(config, results, world, args.threads))
        print(f"\nwrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()
    worst = max(r["max_abs_diff"] for r in results)
    if worst > args.tol:
        raise SystemExit(f"max abs diff {worst:.3g} exceeds --tol {args.tol:g}")


if __name__ == "__main__":
    main()
