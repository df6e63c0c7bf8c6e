"""Where a first compile's time goes: Dynamo's trace, dynashard's aten trace, plan and rewrite, the compiler.

Launch: python -m benchmarks.bench_compile_phases [--layers 2,8] [--compilers eager,inductor] [--repeats 3]
        [--gc default,frozen] [--world 2] [--smoke] [--out PATH]

One process, rank 0 of a fake process group of ``--world`` ranks (dynashard plans and rewrites rank 0's
graph exactly as on real ranks; the fake group moves no data, so outputs are not checked here: the suite
checks them). Model: a random HF ``LlamaForCausalLM`` (hidden 256, 8 heads, 4 K/V heads, ffn 688, vocab
1024, ``--layers`` layers), float32, ids ``[1, 32]``, under ``torch.no_grad()``, ``use_cache=False``;
``torch.compile(model, backend="dynashard", options={"compiler": C})`` with dynashard's compile cache off
(``DYNASHARD_CACHE=0``: every repeat plans) and, under Inductor, a fresh ``TORCHINDUCTOR_CACHE_DIR`` per
repeat (kernels compiled earlier in the process may still be reused in memory).

Phases (seconds, rank 0), timed by wrapping dynashard's own functions for the run:
- ``first call``: ``fast(ids)``'s first call, from the call to its output;
- ``backend``: dynashard's backend, Dynamo's callback (``dynamo_backend._compile_sharded``);
- ``aten trace``: the retrace of Dynamo's graph to aten ops (``_torch.trace_aten`` outside the rewrite);
- ``plan``: ``plan.make_plan``; ``rewrite``: the rewrite's trace (``rewrite.rewrite``);
- ``graph compile``: the compiler dynashard hands the rewritten graph to (``dynamo_backend._compile``: for
  ``eager`` nothing is compiled);
- ``dynamo``: ``first call`` less ``backend`` less a second call's time (Dynamo's trace, guards, bytecode);
- ``gc``: CPython's garbage collector during the first call and the second (``gc.callbacks``), whatever it
  interrupts.
The median of ``--repeats`` rounds (each after ``torch._dynamo.reset()`` on a freshly built model).

``--gc``: each round starts from ``gc.collect()``; ``default`` then runs with CPython's collector as the process
has it, ``frozen`` calls ``gc.freeze()`` first (what imports and earlier rounds made is no longer walked by a full
collection) and ``gc.unfreeze()`` after the round. The two alternate round by round, in the same process.

What a rewrite that does not retrace could save (issue 45's item 2), for the eager rows: the aten graph the
first trace made (``aten ops`` its ops) run node by node on its own fake inputs by ``torch.fx.Interpreter``,
under the fake mode alone (``fake run``: each output's fake, no graph built) and retraced by make_fx as the
rewrite is (``make_fx run``: the same, a graph built); their difference is make_fx's proxy bookkeeping.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Iterator

import torch

from benchmarks._common import OUT_HELP, out_path, record, write_json

PHASES = ("first call", "backend", "aten trace", "plan", "rewrite", "graph compile", "dynamo", "gc")


@dataclasses.dataclass
class Phases:
    """Seconds spent in each phase, and the aten graph the first trace made (for :func:`retrace_cost`)."""

    seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    aten: torch.fx.GraphModule | None = None


@contextlib.contextmanager
def timed_phases() -> Iterator[Phases]:
    """Seconds spent in each of dynashard's phases while inside (module attributes wrapped, then restored)."""
    from dynashard import _torch as private
    from dynashard import analysis, dynamo_backend

    spent = Phases()
    inside_rewrite = [False]

    def wrap(module, name, key, flag=False):
        fn = getattr(module, name)

        def timed(*args, **kwargs):
            if key == "aten trace" and inside_rewrite[0]:
                return fn(*args, **kwargs)  # (the rewrite's own trace: counted as the rewrite)
            if flag:
                inside_rewrite[0] = True
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if key == "aten trace" and spent.aten is None:  # (the first: Dynamo's graph to aten ops)
                    spent.aten = out
                return out
            finally:
                spent.seconds[key] += time.perf_counter() - start
                if flag:
                    inside_rewrite[0] = False

        return module, name, fn, timed

    began = [0.0]

    def collector(phase, info):  # (gc.callbacks: seconds in the collector, whatever it interrupted)
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            spent.seconds["gc"] += time.perf_counter() - began[0]

    wrapped = [wrap(dynamo_backend, "_compile_sharded", "backend"), wrap(private, "trace_aten", "aten trace"),
               wrap(analysis, "make_plan", "plan"), wrap(dynamo_backend, "rewrite", "rewrite", flag=True),
               wrap(dynamo_backend, "_compile", "graph compile")]
    for module, name, _, timed in wrapped:
        setattr(module, name, timed)
    gc.callbacks.append(collector)
    try:
        yield spent
    finally:
        gc.callbacks.remove(collector)
        for module, name, fn, _ in wrapped:
            setattr(module, name, fn)


def retrace_cost(aten: torch.fx.GraphModule, repeats: int) -> dict[str, float]:
    """``aten`` run node by node on its fake inputs under the fake mode alone, and retraced by make_fx."""
    from dynashard import _torch as private

    fakes = [n.meta["val"] for n in aten.graph.nodes if n.op == "placeholder"]
    mode = private.fake_mode_of(fakes)
    fake, traced = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        with mode:
            torch.fx.Interpreter(aten).run(*fakes)
        fake.append(time.perf_counter() - start)
        start = time.perf_counter()
        private.trace_aten(torch.fx.Interpreter(aten).run, fakes)
        traced.append(time.perf_counter() - start)
    return {"aten ops": sum(n.op == "call_function" for n in aten.graph.nodes),
            "fake run": statistics.median(fake), "make_fx run": statistics.median(traced)}


def build(layers: int):
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    return T.LlamaForCausalLM(config).eval()


def one_round(layers: int, compiler: str, ids: torch.Tensor, frozen: bool = False) -> dict[str, float]:
    torch._dynamo.reset()
    model = build(layers)
    gc.collect()  # (both modes start from a full collection: only the freeze differs)
    if frozen:
        gc.freeze()
    try:
        return _timed_round(model, compiler, ids)
    finally:
        if frozen:
            gc.unfreeze()


def _timed_round(model: torch.nn.Module, compiler: str, ids: torch.Tensor) -> dict[str, float]:
    if compiler == "inductor":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-phases-")
    fast = torch.compile(model, backend="dynashard", options={"compiler": compiler, "min_shard_numel": 0})
    with torch.no_grad(), timed_phases() as spent:
        start = time.perf_counter()
        fast(ids, use_cache=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        fast(ids, use_cache=False)
        second = time.perf_counter() - start
    out = {phase: spent.seconds[phase] for phase in PHASES if phase in spent.seconds}
    out["first call"] = first
    out["dynamo"] = first - spent.seconds["backend"] - second
    out["gc"] = spent.seconds["gc"]
    if compiler == "eager" and spent.aten is not None:
        out.update(retrace_cost(spent.aten, 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="2,8")
    parser.add_argument("--compilers", default="eager,inductor")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gc", default="default,frozen", help="default, frozen or both (alternated)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="1 layer, eager, one round: seconds")
    parser.add_argument("--out", help=OUT_HELP)
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.compilers, args.repeats, args.gc = "1", "eager", 1, "default"
    os.environ["DYNASHARD_CACHE"] = "0"
    torch.set_num_threads(args.threads)
    from dynashard import _torch as private

    private.init_fake_process_group(args.world, 0)
    ids = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(1))
    modes = [m for m in args.gc.split(",") if m]
    if not modes or set(modes) - {"default", "frozen"}:
        parser.error(f"--gc: expected default, frozen or both, found {args.gc!r}")
    results = []
    for compiler in [c for c in args.compilers.split(",") if c]:
        for layers in [int(n) for n in args.layers.split(",")]:
            rounds = {mode: [] for mode in modes}
            for _ in range(args.repeats):  # (the modes alternate: the process's state drifts alike for both)
                for mode in modes:
                    rounds[mode].append(one_round(layers, compiler, ids, frozen=mode == "frozen"))
            for mode in modes:
                results.append(_row(compiler, layers, mode, rounds[mode]))
    rec = record({"layers": args.layers, "compilers": args.compilers, "repeats": args.repeats, "gc": args.gc,
                  "model": "HF LlamaForCausalLM hidden 256, 8 heads, 4 K/V heads, ffn 688, vocab 1024",
                  "ids": [1, 32], "process group": f"fake, world {args.world}, rank 0"}, results, args.world,
                 args.threads)
    write_json(out_path(args.out, "compile_phases", args.smoke), rec)


def _row(compiler: str, layers: int, mode: str, rounds: list[dict[str, float]]) -> dict:
    """The medians of one (compiler, layers, gc mode)'s rounds, printed and returned."""
    row = {"compiler": compiler, "layers": layers, "gc mode": mode}
    row.update({phase: round(statistics.median(r[phase] for r in rounds), 3) for phase in rounds[0]})
    row["backend/first call"] = round(row["backend"] / row["first call"], 2)
    row["traces/first call"] = round((row["aten trace"] + row["rewrite"]) / row["first call"], 2)
    row["gc/first call"] = round(row["gc"] / row["first call"], 2)
    if "fake run" in row:
        row["fake run/make_fx run"] = round(row["fake run"] / row["make_fx run"], 2)
    print(f"{compiler:9s} {layers:2d} layers, gc {mode}: " + ", ".join(
        f"{k} {v}" for k, v in row.items() if k not in ("compiler", "layers", "gc mode")), flush=True)
    return row


if __name__ == "__main__":
    main()
