"""One training step (forward, loss, backward, AdamW) of the suite's workloads, side by side.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_train [--workloads mlp,block,decoder]
        [--tokens 256,1024] [--systems "dtensor inductor,dynashard inductor,bound"] [--iters 10]
        [--smoke] [--out PATH]

Workloads: workloads.py's mlp, block and decoder (moe is not trained: dynashard refuses a backward
through MoE partial sums, and the bound has none either). Float32, batch 1, the same weights and
inputs on every rank.

Systems (each a deep copy of the same model with an AdamW of its own over the parameters it holds;
compiled ones with fullgraph=True, dynamic=False):
  unsharded eager / inductor   the model / torch.compile(model), every rank training all of it
  dtensor eager / inductor     parallelize_module with the workload's Megatron plan and the
                               head-count edit (workloads.dtensor_parallelize), then (inductor)
                               torch.compile; gradients and AdamW state are DTensors
  dynashard eager / inductor   dynashard.parallelize(model, *inputs), AdamW over its shards, then
                               torch.compile(model, backend=dynashard.backend(compiler=...)), plan "auto"
  dynashard sp eager / inductor  the same with options sequence_parallel=True
  bound                        workloads.shard_by_hand(..., copies=...): this rank's shards with
                               Megatron's f (identity forward, all_reduce backward, once per value
                               the colwise layers read) and g (all_reduce forward, identity
                               backward, after each rowwise layer and the vocab embedding) written
                               as autograd Functions over funcol, the LM head's all_gather keeping
                               this rank's columns backward; compiled with Inductor (Dynamo traces
                               an autograd.Function as a higher-order op: its backward is kept)
Default: unsharded eager, unsharded inductor, dtensor inductor, dynashard inductor, dynashard sp inductor, bound.

The step: ``opt.zero_grad(set_to_none=True)``; ``loss = loss_of(model(*inputs))`` (cross-entropy
against random next tokens for the decoder, ``out.float().pow(2).mean()`` otherwise, eager);
``loss.backward()``; ``opt.step()`` (AdamW, lr 1e-4, torch's default implementation: on CPU the
per-tensor loop, eager, for every system).

Correctness, before timing: every system's first step runs forward and backward from the same
weights on the same inputs as an unsharded eager reference; its output and every gradient are
compared with the reference's (a shard's gradient with the same slice of the whole gradient, a
DTensor's gathered with full_tensor). The run exits 1 after writing its record if one differs.

Collectives per step: counted in the second step with torch.profiler, forward (with the loss),
backward and optimizer step each profiled on its own: every ``c10d::`` op event
(``c10d::allreduce_``, ``c10d::allgather_into_tensor_coalesced_``, ...). Every path to the process
group goes through one: funcol in eager code and in Inductor's generated code, DTensor's
redistributions, ``dist.*`` calls. Those not issued by a ``_c10d_functional`` op are shown "via
dist" (dynashard's per-call input check: one all_reduce of 6 int64 per graph call); the record
also holds the input shapes of the funcol ones.

Activations: the bytes of the tensors one forward (with the loss) saves for its backward, each storage
once (``torch.autograd.graph.saved_tensors_hooks``; a compiled graph's saved activations included),
the largest rank's: what ``sequence_parallel`` cuts between the TP regions.

Memory: after that step (parameters, ``.grad`` and AdamW state all alive: their peak), the bytes
of this rank's parameters, gradients and optimizer state tensors (a DTensor's local tensor), the
largest rank's. Target: the unsharded model's same bytes with every tensor the Megatron plan
shards divided by the world size (1/N of the sharded tensors, plus the replicated ones).

Timing: per workload and token count, every system built and stepped twice (the checks above),
then timed interleaved (one step of each system per round, a barrier before each); the slowest
rank's median and min, and the median of each phase (forward + loss, backward, optimizer step).
"setup + first step s": building the system (deep copy, parallelize_module / shard_by_hand /
dynashard.parallelize, which runs the model once) and its first step, compiles included, Inductor
pointed at an empty cache directory of its own (suite.cold_cache).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._common import (
    OUT_HELP,
    Progress,
    gather,
    init,
    out_path,
    record,
    summarize,
    time_interleaved,
    write_json,
)
from benchmarks.suite import cold_cache, source_version, tolerance, warm_up_toolchain
from benchmarks.train_metrics import (
    PHASES,
    Phase,
    count_collectives,
    grad_error,
    saved_bytes,
    state_bytes,
    table,
    target_bytes,
    verdict,
)
from benchmarks.workloads import SMOKE, WORKLOADS, Sizes, dtensor_parallelize, shard_by_hand, sharded_parameters

SYSTEMS = (
    "unsharded eager",
    "unsharded inductor",
    "dtensor eager",
    "dtensor inductor",
    "dynashard eager",
    "dynashard inductor",
    "dynashard sp eager",
    "dynashard sp inductor",
    "bound",
)
DEFAULT_SYSTEMS = ("unsharded eager", "unsharded inductor", "dtensor inductor", "dynashard inductor",
                   "dynashard sp inductor", "bound")
TRAINED = ("mlp", "block", "decoder")
LR = 1e-4
# float32: a sharded or compiled step sums the same products in another order, forward and backward,
# which moves a gradient by a few ulps times sqrt(K) (K <= 4096): about 1e-6 of its largest element
# (tests/test_training.py measures < 2e-6). A missing all_reduce or a wrong slice is off by O(1).
GRAD_RTOL = 1e-4


@dataclasses.dataclass
class Trainer:
    fn: Callable[..., torch.Tensor]  # the model, compiled or not
    model: nn.Module
    opt: torch.optim.Optimizer


def loss_of(out: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    if target is None:
        return out.float().pow(2).mean()
    return F.cross_entropy(out.flatten(0, -2).float(), target.flatten())


def _compile(model: nn.Module, backend: Any) -> Callable[..., Any]:
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=False)


def build(system: str, workload: str, base: nn.Module, inputs: tuple[Any, ...], ctx: dict[str, Any]) -> Trainer:
    kind, _, variant = system.partition(" ")
    sp = variant.startswith("sp ")
    variant = variant.removeprefix("sp ")
    compiled, compiler = variant != "eager", ctx["compiler"]
    if kind == "unsharded":
        model = copy.deepcopy(base)
        fn = _compile(model, compiler) if compiled else model
    elif kind == "dtensor":
        if "mesh" not in ctx:
            from torch.distributed.device_mesh import init_device_mesh

            ctx["mesh"] = init_device_mesh("cpu", (ctx["world"],))
        model = dtensor_parallelize(copy.deepcopy(base), WORKLOADS[workload].plan, ctx["mesh"])
        fn = _compile(model, compiler) if compiled else model
    elif kind == "dynashard":
        import dynashard

        # NOTE: a fresh backend object per build (see suite.build: Dynamo would otherwise reuse
        # another copy's program, and this system's compile would go unmeasured).
        options = {"compiler": compiler if compiled else "eager", "min_shard_numel": ctx["min_shard_numel"],
                   "sequence_parallel": sp}
        model = dynashard.parallelize(copy.deepcopy(base), *inputs, options=options)
        fn = _compile(model, dynashard.backend(**options))
    else:
        w = WORKLOADS[workload]
        model = shard_by_hand(base, w.plan, ctx["world"], ctx["rank"], copies=w.copies)
        fn = _compile(model, compiler)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    return Trainer(fn, model, opt)


def train_step(t: Trainer, inputs: tuple[Any, ...], target: torch.Tensor | None, phase: Phase) -> None:
    """One step; ``phase(name, fn)`` runs each part (timing or profiling it)."""
    t.opt.zero_grad(set_to_none=True)
    loss = phase("forward", lambda: loss_of(t.fn(*inputs), target))
    phase("backward", loss.backward)
    phase("optimizer", t.opt.step)


def timing_phases(into: list[dict[str, float]]) -> Phase:
    """A ``phase`` for train_step that appends each step's seconds per phase to ``into``."""

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        if name == PHASES[0]:
            into.append({})
        t0 = time.perf_counter()
        out = fn()
        into[-1][name] = time.perf_counter() - t0
        return out

    return phase


def first_steps(
    t: Trainer, inputs: tuple[Any, ...], target: torch.Tensor | None, ref: dict[str, Any], ctx: dict[str, Any]
) -> dict[str, Any]:
    """Step 1 checked against the reference (its time includes compiling), step 2 counted."""
    info: dict[str, Any] = {}
    dist.barrier()
    t0 = time.perf_counter()
    out = t.fn(*inputs)
    loss_of(out, target).backward()
    info["first_s"] = time.perf_counter() - t0
    info["max_abs_diff"] = (out.detach() - ref["out"]).abs().max().item()
    info["grad_rel_err"] = grad_error(t.model, ref["grads"], ctx["rank"], ctx["world"])
    t.opt.step()
    info["collectives"] = count_collectives(functools.partial(train_step, t, inputs, target))
    info["state_bytes"] = state_bytes(t.model, t.opt)
    info["saved_bytes"] = saved_bytes(lambda: loss_of(t.fn(*inputs), target), t.model)
    return info


def reference(
    base: nn.Module, inputs: tuple[Any, ...], target: torch.Tensor | None, plan: dict[str, str], world: int
) -> dict[str, Any]:
    """The unsharded eager model's first step: output, gradients, and the memory target."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = model(*inputs)
    loss_of(out, target).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    sharded = sharded_parameters(model, plan)
    return {"out": out.detach(), "grads": grads, "target_bytes": target_bytes(model, opt, sharded, world)}


def run_group(
    workload: str,
    tokens: int,
    sizes: Sizes,
    base: nn.Module,
    args: argparse.Namespace,
    ctx: dict[str, Any],
    bar: Progress,
) -> list[dict[str, Any]]:
    torch._dynamo.reset()
    torch.manual_seed(1000 + tokens)  # the same inputs on every rank
    inputs = WORKLOADS[workload].inputs(sizes, tokens, ctx["max_tokens"])
    target = torch.randint(0, sizes.vocab, (1, tokens)) if workload == "decoder" else None
    tag = f"{workload} t={tokens}"
    bar.show(f"{tag}: unsharded reference")
    ref = reference(base, inputs, target, WORKLOADS[workload].plan, ctx["world"])
    trainers: dict[str, Trainer] = {}
    mine: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    load = [os.getloadavg()[0]]
    for system in args.systems:
        bar.show(f"{tag}: building {system}")
        cold_cache(os.path.join(ctx["cache_root"], f"{workload}-{tokens}-{system.replace(' ', '-')}"))
        error = None
        try:
            t0 = time.perf_counter()
            t = build(system, workload, base, inputs, ctx)
            build_s = time.perf_counter() - t0
            info = first_steps(t, inputs, target, ref, ctx)
            info.update(build_s=build_s, first_s=build_s + info["first_s"])
        except Exception as e:  # noqa: BLE001 - reported in the record and the exit status
            error = f"{type(e).__name__}: {e}"
        errors = [e for e in gather(error) if e]
        if errors:
            failed[system] = errors[0][:2000]
        else:
            trainers[system], mine[system] = t, info
        t = None
        bar.step()
    tol = tolerance(ref["out"], args.rtol)
    phases: dict[str, list[dict[str, float]]] = {s: [] for s in trainers}
    calls = {s: functools.partial(train_step, t, inputs, target, timing_phases(phases[s])) for s, t in trainers.items()}
    bar.show(f"{tag}: timing {len(calls)} systems")
    load.append(os.getloadavg()[0])
    times = time_interleaved(calls, args.warmup, args.iters, on_round=bar.step)
    load.append(os.getloadavg()[0])
    for s, info in mine.items():
        timed = phases[s][args.warmup :]
        info["phase_median_s"] = {p: statistics.median(step[p] for step in timed) for p in PHASES}
    calls = None
    trainers.clear()
    results = summarize(ctx["rank"], mine, times)
    for r in results:
        per_rank = r["per_rank"]
        state = {k: max(p["state_bytes"][k] for p in per_rank) for k in per_rank[0]["state_bytes"]}
        total = max(sum(p["state_bytes"].values()) for p in per_rank)
        grad_err = max(p["grad_rel_err"] for p in per_rank)
        r.update(
            workload=workload,
            tokens=tokens,
            tolerance=tol,
            grad_rel_err=grad_err,
            grad_rtol=GRAD_RTOL,
            ok=r["max_abs_diff"] <= tol and grad_err <= GRAD_RTOL,
            phase_median_ms={p: 1e3 * max(x["phase_median_s"][p] for x in per_rank) for p in PHASES},
            collectives=per_rank[0]["collectives"],
            state_bytes=state,
            state_total_bytes=total,
            saved_bytes=max(p["saved_bytes"] for p in per_rank),
            state_target_bytes=ref["target_bytes"],
            loadavg=load,  # 1-minute load average on rank 0's machine: before building, before and after timing
        )
    results += [
        {"workload": workload, "tokens": tokens, "system": s, "error": e, "ok": False} for s, e in failed.items()
    ]
    del ref
    gc.collect()
    return sorted(results, key=lambda r: args.systems.index(r["system"]))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(TRAINED), help="comma-separated subset of: " + ", ".join(TRAINED))
    ap.add_argument("--tokens", default="256,1024", help="comma-separated token counts")
    ap.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help="comma-separated subset of: " + ", ".join(SYSTEMS)
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--rtol", type=float, default=1e-4, help="output max abs diff allowed, relative to max |output|")
    ap.add_argument("--min-shard-numel", type=int, default=1 << 16, help="dynashard option (its default: 65536)")
    ap.add_argument(
        "--compiler",
        choices=("inductor", "aot_eager", "eager"),
        default="inductor",
        help="what the 'inductor' systems and the bound compile with (--smoke: aot_eager)",
    )
    ap.add_argument("--out", default=None, help=OUT_HELP.replace("<script>", "train_w<world>"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI sizes: hidden 64, 1 layer, vocab 512, 8 tokens, 2 steps timed, aot_eager (no Inductor)",
    )
    args = ap.parse_args()
    args.workloads = [w.strip() for w in args.workloads.split(",")]
    args.systems = [s.strip() for s in args.systems.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.smoke:
        args.tokens, args.iters, args.warmup, args.compiler = [8], 2, 1, "aot_eager"
        args.min_shard_numel = 0  # the smoke weights are below dynashard's default threshold
    for name, given, valid in (("workloads", args.workloads, TRAINED), ("systems", args.systems, SYSTEMS)):
        if set(given) - set(valid):
            ap.error(f"unknown {name} {sorted(set(given) - set(valid))}; expected some of {list(valid)}")
    return args


def main() -> None:
    args = parse()
    source = source_version()  # at the start: the code this run loads (dynashard/ may be edited meanwhile)
    cache = tempfile.mkdtemp(prefix="train_inductor_cache_")
    cold_cache(os.path.join(cache, "toolchain"))
    # every system compiles its own copy of the same module class: raise rather than run one eagerly
    torch._dynamo.config.recompile_limit = 16
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    rank, world = init(args.threads)
    sizes = SMOKE if args.smoke else Sizes()
    out = out_path(args.out, f"train_w{world}", args.smoke)
    ctx = {
        "cache_root": cache,
        "world": world,
        "rank": rank,
        "max_tokens": max(args.tokens),
        "min_shard_numel": args.min_shard_numel,
        "compiler": args.compiler,
    }
    bar = Progress(
        len(args.workloads) * len(args.tokens) * (len(args.systems) + args.warmup + args.iters), enabled=rank == 0
    )
    bar.show("warming up the compiler toolchain")
    warm_up_toolchain(args.compiler)
    results: list[dict[str, Any]] = []
    try:
        for workload in args.workloads:
            torch.manual_seed(0)  # the same weights on every rank
            base = WORKLOADS[workload].build(sizes, ctx["max_tokens"])
            for tokens in args.tokens:
                group = run_group(workload, tokens, sizes, base, args, ctx, bar)
                results += group
                if rank == 0:
                    bar.close()
                    print(table(group, world) + "\n", flush=True)
            del base
    finally:
        bar.close()
        shutil.rmtree(cache, ignore_errors=True)
    if rank == 0:
        keys = ("workloads", "tokens", "systems", "iters", "warmup", "rtol", "smoke", "compiler")
        config = {k: getattr(args, k) for k in keys}
        config.update(
            sizes=dataclasses.asdict(sizes),
            min_shard_numel=args.min_shard_numel,
            dtype="float32",
            backend="gloo",
            plans={w: WORKLOADS[w].plan for w in args.workloads},
            dynashard_plan="auto",
            bound_copies={w: WORKLOADS[w].copies for w in args.workloads},
            step="zero_grad(set_to_none=True), forward, loss (decoder: cross-entropy, else out.float().pow(2).mean()),"
            " backward, AdamW(lr=1e-4) step (torch's default implementation)",
            compile={"fullgraph": True, "dynamic": False},
            source=source,
            collectives="c10d:: op events in a torch.profiler session per phase of the second step",
            timing="interleaved rounds, barrier before each step, slowest rank's median/min",
        )
        rec = record(config, results, world, args.threads)
        write_json(out, rec)
        print(verdict(results) + f"\nwrote {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    bad = [
        f"{r['workload']} t={r['tokens']} {r['system']}: "
        + (
            r.get("error")
            or (
                f"output diff {r['max_abs_diff']:.3g} (tolerance {r['tolerance']:.3g}), "
                f"gradient error {r['grad_rel_err']:.3g} (tolerance {GRAD_RTOL})"
            )
        )
        for r in results
        if not r["ok"]
    ]
    if bad:
        raise SystemExit("bench_train: failed or mismatched systems:\n  " + "\n  ".join(bad))


if __name__ == "__main__":
    main()
