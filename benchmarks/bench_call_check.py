"""What the per-call agreement costs: every call of a dynashard graph first compares the ranks'
inputs in one all_reduce of 6 int64, so that ranks calling with different shapes (or, by default,
different token ids) get a clear error instead of a gloo abort, a hang or a mix of batches.
``check_inputs``: ``"ids"`` (the default) compares shapes, the values of integer inputs on every
call and of every input at compile time; ``"shapes"`` shapes only; ``"values"`` checksums every
input every call; ``"off"`` skips the collective.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_call_check [--hidden 1024 --ffn 4096]

The handshake is started when the call starts and finished inside the graph, just before its first
collective (``dynashard/runtime/gate.py``), so the computation up to there overlaps it; "ids, waited before
the call" is the default with that gate removed (the handshake finished before the graph runs, as
before the gate), compiled and timed beside the others.

Systems, timed interleaved (one call of each per round, a barrier before every call), slowest
rank's median, ratios to "off", for two workloads: the residual MLP block (``x + down(gelu(up(x)))``,
float inputs: "ids" costs what "shapes" does) and a token model (an embedding of ``--vocab`` rows,
vocab-parallel, then the block: token ids in, so "ids" checksums them every call). Each compiled
four times, one per ``check_inputs``. The outputs are checked against the unsharded model.
``--smoke`` runs tiny sizes, 2 iterations.
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch
import torch.distributed as dist

from benchmarks._common import MLP, OUT_HELP, init, out_path, record, summarize, time_interleaved, write_json

CHECKS = ("off", "shapes", "ids", "values")
BLOCKING = "ids, waited before the call"
SYSTEMS = (*CHECKS, BLOCKING)


def compiling(system: str):
    """Where ``system`` compiles: the blocking baseline's graphs get no gate."""
    if system != BLOCKING:
        return contextlib.nullcontext()
    return mock.patch("dynashard.runtime.gate.insert", lambda gm: None)


class TokenModel(torch.nn.Module):
    """Token ids in: a vocab-parallel embedding, then the residual MLP block."""

    def __init__(self, vocab: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.block = MLP(hidden, ffn)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--out", help=OUT_HELP)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.out = out_path(args.out, "call_check", args.smoke)
    if args.smoke:
        args.hidden, args.ffn, args.vocab, args.tokens, args.iters, args.compiler = 16, 64, 50, [1, 4], 2, "eager"
    rank, world = init(1)
    # every system compiles the same forward (static at 1 token, then dynamic): 10 entries, past Dynamo's 8
    torch._dynamo.config.recompile_limit = 64
    builds = {"mlp": lambda: MLP(args.hidden, args.ffn),
              "tokens": lambda: TokenModel(args.vocab, args.hidden, args.ffn)}
    rows = []
    for workload, build in builds.items():
        compiled = {}
        for system in SYSTEMS:
            torch.manual_seed(0)
            check = "ids" if system == BLOCKING else system
            options = {"compiler": args.compiler, "min_shard_numel": 0, "check_inputs": check}
            compiled[system] = torch.compile(build(), backend="dynashard", options=options)
        torch.manual_seed(0)
        unsharded = build()
        with torch.no_grad():
            for tokens in args.tokens:
                g = torch.Generator().manual_seed(tokens)  # the same inputs on every rank
                x = torch.randn(1, tokens, args.hidden, generator=g) if workload == "mlp" else torch.randint(
                    0, args.vocab, (1, tokens), generator=g)
                ref = unsharded(x)
                errors = {}
                for c in SYSTEMS:
                    with compiling(c):  # (the first call at these sizes compiles)
                        errors[c] = float((compiled[c](x) - ref).abs().max())
                calls = {_name(c): (lambda f=compiled[c], x=x: f(x)) for c in SYSTEMS}
                times = time_interleaved(calls, 3, args.iters)
                per_system = {_name(c): {"first_s": 0.0, "max_abs_diff": errors[c]} for c in SYSTEMS}
                results = summarize(rank, per_system, times)
                off = results[0]["median_ms"]
                for r in results:
                    rows.append({"workload": workload, "tokens": tokens, "system": r["system"],
                                 "median_ms": r["median_ms"], "min_ms": r["min_ms"], "vs_off": r["median_ms"] / off,
                                 "max_abs_diff": r["max_abs_diff"]})
    bad = [r for r in rows if r["max_abs_diff"] > 1e-3]
    if rank == 0:
        print(f"per-call agreement on {world} ranks (gloo, 1 thread per rank), MLP {args.hidden}x{args.ffn} "
              f"(tokens: after a {args.vocab}-row embedding), {args.compiler}, median of {args.iters}, slowest rank\n")
        print("| workload | tokens | system | median ms | min ms | vs off | max abs diff |\n"
              "|---|---:|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['workload']} | {r['tokens']} | {r['system']} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | "
                  f"{r['vs_off']:.2f}x | {r['max_abs_diff']:.1e} |")
        config = {"hidden": args.hidden, "ffn": args.ffn, "vocab": args.vocab, "tokens": args.tokens,
                  "iters": args.iters, "compiler": args.compiler}
        write_json(args.out, record(config, rows, world, 1))
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"outputs differ from the unsharded block: {bad}")


def _name(system: str) -> str:
    return system if system == BLOCKING else f"check_inputs={system}"


if __name__ == "__main__":
    main()
