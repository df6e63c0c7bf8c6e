"""The benchmark suite: every workload x token count x system, side by side in one process group.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.suite [--workloads mlp,block,decoder,moe]
        [--tokens 1,64,256,1024] [--systems "dtensor inductor,dynashard inductor,bound"] [--iters 20]
        [--smoke] [--out PATH]
Plots and the scaling table, from the records of runs at world 1, 2 and 4: python -m benchmarks.report

Workloads (workloads.py; weights and inputs from the same seed on every rank, float32):
  mlp      x + down(gelu(up(x))), hidden 1024, ffn 4096, input [1, tokens, 1024]
  block    tests.models.LlamaBlock(hidden=1024, n_heads=8, ffn=2816): RMSNorm, q/k/v, RoPE (half
           rotation), SDPA, o, RMSNorm, SwiGLU; called as block(x, cos, sin)
  decoder  tests.models.LlamaDecoder(vocab 32000, hidden 1024, 8 heads, ffn 2816, 4 layers,
           untied LM head): ids [1, tokens] in, logits out
  moe      tests.models.MoE(hidden 1024, ffn 1408, 8 experts, top 2): router, 3-D expert weights
           run as W[ids] + bmm (HF's batched_mm), residual; input [1, tokens, 1024]. The dtensor
           systems are not applicable (no parallel style shards 3-D expert parameters): reported
           "n/a" with the reason, not run
Systems (each builds its own deep copy; compiled ones use fullgraph=True, dynamic=False):
  unsharded eager / inductor   the model as is / torch.compile(model): every rank computes it all
  dtensor eager / inductor     parallelize_module with the workload's Megatron plan and the
                               head-count edit, then (inductor) torch.compile of it
  dynashard eager / inductor   torch.compile(model, backend=dynashard.backend(compiler=...)),
                               plan "auto"; the collectives its rewritten graph holds are counted
  bound                        workloads.shard_by_hand: the same model code on this rank's 1/N
                               shards with the minimal collectives written by hand (one funcol
                               all_reduce per rowwise layer / vocab embedding / MoE block, one
                               all_gather for the LM head), compiled with Inductor: the sharded
                               compute plus the minimal communication in one program, no overlap
  bound compute                the same with every collective skipped (output not checked)
  bound comm                   the bound's collectives alone: c10d calls on preallocated tensors of
                               the same shapes, in the same order (output not checked)

Timing (all under torch.no_grad()): per workload and token count, torch._dynamo.reset(), then
every system is built and called once ("first call": tracing and compiling cold -- Inductor
pointed at an empty cache directory of its own and its in-memory caches cleared, see
``cold_cache``), then all are timed interleaved, one call each per round after a barrier
(``warmup`` untimed rounds, ``iters`` timed ones); the slowest rank's median and min are
reported. Then (at the first token count of each workload only) torch._dynamo.reset() and every
compiled system is built again from a fresh copy and called once: "recompile" (Dynamo and
dynashard trace again; Inductor finds the system's on-disk cache warm, its in-memory caches
cleared: roughly a second process start). Memory: parameter
bytes each rank holds and its RSS / peak RSS after the system's first call (process-wide, so it
includes the systems built before it). Correctness: each checked system's max abs difference to
unsharded eager on every rank; the run exits 1 if one exceeds the tolerance (see ``tolerance``)
or a system failed, after writing the record.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from benchmarks import report
from benchmarks._common import (
    OUT_HELP,
    Progress,
    gather,
    init,
    out_path,
    record,
    rss,
    summarize,
    time_call,
    time_interleaved,
    write_json,
)
from benchmarks.workloads import SMOKE, WORKLOADS, CommOnly, Sizes, collectives_of, dtensor_parallelize, shard_by_hand
from dynashard import held_bytes

SYSTEMS = (
    "unsharded eager",
    "unsharded inductor",
    "dtensor eager",
    "dtensor inductor",
    "dynashard eager",
    "dynashard inductor",
    "bound",
    "bound compute",
    "bound comm",
)
UNCHECKED = ("bound compute", "bound comm")  # no output to compare
COMPILED = ("unsharded inductor", "dtensor inductor", "dynashard eager", "dynashard inductor", "bound", "bound compute")


@dataclasses.dataclass
class Built:
    fn: Callable[..., Any]
    model: nn.Module | None
    collectives: Callable[[], str] = lambda: "-"


def _compile(model: nn.Module, backend: Any) -> Callable[..., Any]:
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=False)


def settled(fn: Callable[..., Any], inputs: tuple[Any, ...]) -> Callable[[], Any]:
    """``fn(*inputs)``, waiting for a collective still in flight in its output: DTensor eager returns
    the gathered LM head's logits as an unwaited AsyncCollectiveTensor, and that gather's time
    belongs to the call (unwaited, it would be charged to the next barrier instead)."""

    def call() -> Any:
        out = fn(*inputs)
        return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out

    return call


def _count(graphs: list[Any]) -> str:
    """``_c10d_functional`` ops in dynashard's rewritten graphs (waits not counted)."""
    if not graphs:  # see build(): every dynashard system must get its own program
        raise RuntimeError("dynashard's backend was never called: Dynamo reused another copy's compiled program")
    counts: collections.Counter[str] = collections.Counter()
    for g in graphs:
        for n in [] if g is None else g.graph.nodes:
            name = str(n.target)
            if n.op == "call_function" and name.startswith("_c10d_functional.") and "wait_tensor" not in name:
                counts[name.split(".")[1]] += 1
    text = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"
    unsharded = sum(g is None for g in graphs)
    if len(graphs) > 1:
        text += f" in {len(graphs)} graphs" + (f", {unsharded} left whole" if unsharded else "")
    return text


def build(system: str, workload: str, base: nn.Module, inputs: tuple[Any, ...], ctx: dict[str, Any]) -> Built:
    kind, _, variant = system.partition(" ")
    plan = WORKLOADS[workload].plan
    world, rank, compiler = ctx["world"], ctx["rank"], ctx["compiler"]
    if system == "unsharded eager":
        return Built(base, base)
    if kind == "unsharded":
        model = copy.deepcopy(base)
        return Built(_compile(model, compiler), model)
    if kind == "dtensor":
        if "mesh" not in ctx:
            from torch.distributed.device_mesh import init_device_mesh

            ctx["mesh"] = init_device_mesh("cpu", (world,))
        model = dtensor_parallelize(copy.deepcopy(base), plan, ctx["mesh"])
        return Built(_compile(model, compiler) if variant == "inductor" else model, model)
    if kind == "dynashard":
        import dynashard

        # NOTE: a fresh backend object per build. Dynamo does not guard on module identity, so a
        # second copy compiled with the *same* backend reuses the first copy's program (correct:
        # the program looks shards up by the parameter passed), and this system's
        # own compile time and collectives would then go unmeasured.
        inner = dynashard.backend(compiler=compiler if variant == "inductor" else variant,
                                  min_shard_numel=ctx["min_shard_numel"])
        graphs: list[Any] = []

        def counting(gm, example_inputs):
            program = inner(gm, example_inputs)
            graphs.append(getattr(program, "graph", None))  # ShardedProgram.graph: the rewritten aten graph
            return program

        model = copy.deepcopy(base)
        return Built(_compile(model, counting), model, lambda: _count(graphs))
    model = shard_by_hand(base, plan, world, rank, comm=variant != "compute")
    done = collectives_of(model, *inputs)
    kinds = collections.Counter(k for k, _, _ in done)
    text = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) or "none"
    if variant == "comm":
        return Built(CommOnly(done, world), None, lambda: text)
    return Built(_compile(model, compiler), model, lambda: text if variant != "compute" else f"none (skips {text})")


def cold_cache(path: str) -> None:
    """Point Inductor at its own on-disk cache ``path`` and forget what this process compiled
    (kernels loaded in memory), so the next compile only finds what ``path`` holds."""
    from torch._inductor.utils import clear_inductor_caches

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path  # read on every use
    clear_inductor_caches()


def tolerance(ref: torch.Tensor, rtol: float) -> float:
    """float32, outputs of O(1): a sharded or compiled program sums the same products in another
    order (rowwise partial sums, Inductor's fused reductions), which moves a result by a few ulps
    times sqrt(K) for K <= 4096 -- about 1e-6 relative. ``rtol`` (1e-4) of the output's largest
    magnitude leaves two orders of margin, while a wrong shard or a missing reduce is off by O(1)."""
    return rtol * max(1.0, ref.abs().max().item())


def run_group(workload: str, tokens: int, sizes: Sizes, base: nn.Module, systems: list[str],
              args: argparse.Namespace, ctx: dict[str, Any], bar: Progress) -> list[dict[str, Any]]:
    torch._dynamo.reset()
    torch.manual_seed(1000 + tokens)  # the same inputs on every rank
    inputs = WORKLOADS[workload].inputs(sizes, tokens, ctx["max_tokens"])
    tag = f"{workload} t={tokens}"
    with torch.no_grad():
        ref = base(*inputs)
    tol = tolerance(ref, args.rtol)
    built: dict[str, Built] = {}
    mine: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    cache = {s: os.path.join(ctx["cache_root"], f"{workload}-{tokens}-{s.replace(' ', '-')}") for s in systems}
    load = [os.getloadavg()[0]]
    not_applicable = WORKLOADS[workload].not_applicable
    skipped = {s: not_applicable[s.partition(" ")[0]] for s in systems if s.partition(" ")[0] in not_applicable}
    for system in [s for s in systems if s not in skipped]:
        bar.show(f"{tag}: building {system}")
        error, info = None, {}
        cold_cache(cache[system])
        try:
            b = build(system, workload, base, inputs, ctx)
            with torch.no_grad():
                info["first_s"] = time_call(settled(b.fn, inputs))
                out = settled(b.fn, inputs)()
            info["max_abs_diff"] = None if system in UNCHECKED else (out - ref).abs().max().item()
            info.update(held_param_bytes=held_bytes(b.model) if b.model is not None else 0, **rss())
            info["collectives"] = b.collectives()
        except Exception as e:  # noqa: BLE001 - reported in the record and the exit status
            error = f"{type(e).__name__}: {e}"
        errors = [e for e in gather(error) if e]
        if errors:
            failed[system] = errors[0][:2000]
        else:
            built[system], mine[system] = b, info
        bar.step()
    with torch.no_grad():
        calls = {s: settled(b.fn, inputs) for s, b in built.items()}
        bar.show(f"{tag}: timing {len(calls)} systems")
        load.append(os.getloadavg()[0])
        times = time_interleaved(calls, args.warmup, args.iters, on_round=bar.step)
        load.append(os.getloadavg()[0])
    calls = b = None  # drop the first-built systems before the recompiles
    built.clear()
    torch._dynamo.reset()
    for system in [s for s in systems if s in COMPILED and s in mine and tokens == args.tokens[0]]:
        bar.show(f"{tag}: recompiling {system}")
        cold_cache(cache[system])  # on disk: what the first compile left; in memory: nothing
        b = build(system, workload, base, inputs, ctx)
        with torch.no_grad():
            mine[system]["recompile_s"] = time_call(settled(b.fn, inputs))
        del b
        bar.step()
    results = summarize(ctx["rank"], mine, times)
    for r in results:
        per_rank = r["per_rank"]
        r.update(
            workload=workload,
            tokens=tokens,
            tolerance=tol,
            ok=r["max_abs_diff"] is None or r["max_abs_diff"] <= tol,
            recompile_s=max((p.get("recompile_s", -1.0) for p in per_rank), default=-1.0),
            held_param_bytes=max(p["held_param_bytes"] for p in per_rank),
            rss_bytes=max(p["VmRSS"] for p in per_rank),
            peak_rss_bytes=max(p["VmHWM"] for p in per_rank),
            collectives=per_rank[0]["collectives"],
            loadavg=load,  # 1-minute load average on rank 0's machine: before building, before and after timing
        )
        if r["recompile_s"] < 0:
            r["recompile_s"] = None
    results += [{"workload": workload, "tokens": tokens, "system": s, "error": e, "ok": False}
                for s, e in failed.items()]
    results += [{"workload": workload, "tokens": tokens, "system": s, "not_applicable": why, "ok": True}
                for s, why in skipped.items()]
    return sorted(results, key=lambda r: systems.index(r["system"]))


def warm_up_toolchain(compiler: str) -> None:
    """One tiny compile first, so the process-wide start-up (imports, Inductor's C++ toolchain
    checks and compile workers) is not charged to the first system's cold compile."""
    with torch.no_grad():
        torch.compile(lambda t: (t * 2 + 1).sum(), backend=compiler, fullgraph=True)(torch.ones(8))
    torch._dynamo.reset()


def source_version() -> str:
    """The commit benchmarked, and whether dynashard/ had uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "dynashard"], cwd=root, capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        return "unknown"
    return head + (" + uncommitted changes in dynashard/" if dirty else "")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # moe is opt-in outside --smoke: its eager systems copy W[ids] per token pair (5.9 GB per rank at
    # 256 tokens), so the default token counts' 1024 would not fit a 24 GiB machine.
    ap.add_argument("--workloads", default=None,
                    help="comma-separated: " + ", ".join(WORKLOADS) + " (default: mlp,block,decoder; --smoke: all)")
    ap.add_argument("--tokens", default="1,64,256,1024", help="comma-separated token counts")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of: " + ", ".join(SYSTEMS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--rtol", type=float, default=1e-4, help="max abs diff allowed, relative to max |output|")
    ap.add_argument("--min-shard-numel", type=int, default=1 << 16, help="dynashard option (its default: 65536)")
    ap.add_argument("--compiler", choices=("inductor", "aot_eager", "eager"), default="inductor",
                    help="what the 'inductor' systems and the bound compile with (--smoke: eager)")
    ap.add_argument("--out", default=None, help=OUT_HELP.replace("<script>", "suite_w<world>"))
    ap.add_argument("--smoke", action="store_true",
                    help="CI sizes: hidden 64, 1 layer, vocab 512, tokens 1,8, 2 iterations, Dynamo only (no Inductor)")
    args = ap.parse_args()
    if args.workloads is None:
        args.workloads = ",".join(WORKLOADS) if args.smoke else "mlp,block,decoder"
    args.workloads = [w.strip() for w in args.workloads.split(",")]
    args.systems = [s.strip() for s in args.systems.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.smoke:
        args.tokens, args.iters, args.warmup, args.compiler = [1, 8], 2, 1, "eager"
        args.min_shard_numel = 0  # the smoke weights are below dynashard's default threshold
    for name, given, valid in (("workloads", args.workloads, WORKLOADS), ("systems", args.systems, SYSTEMS)):
        if set(given) - set(valid):
            ap.error(f"unknown {name} {sorted(set(given) - set(valid))}; expected some of {list(valid)}")
    return args


def main() -> None:
    args = parse()
    cache = tempfile.mkdtemp(prefix="suite_inductor_cache_")
    cold_cache(os.path.join(cache, "toolchain"))
    # Every system compiles its own copy of the same module class, so one code object collects an
    # entry per system (and per recompile); raise instead of silently running a system eagerly.
    torch._dynamo.config.recompile_limit = 16
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    rank, world = init(args.threads)
    sizes = SMOKE if args.smoke else Sizes()
    out = out_path(args.out, f"suite_w{world}", args.smoke)
    ctx = {"cache_root": cache, "world": world, "rank": rank, "max_tokens": max(args.tokens),
           "min_shard_numel": args.min_shard_numel, "compiler": args.compiler}
    rounds = 0
    for workload in args.workloads:
        runs = [s for s in args.systems if s.partition(" ")[0] not in WORKLOADS[workload].not_applicable]
        rounds += len(args.tokens) * (len(runs) + args.warmup + args.iters) + sum(s in COMPILED for s in runs)
    bar = Progress(rounds, enabled=rank == 0)
    bar.show("warming up the compiler toolchain")
    warm_up_toolchain(args.compiler)
    results: list[dict[str, Any]] = []
    try:
        for workload in args.workloads:
            torch.manual_seed(0)  # the same weights on every rank
            base = WORKLOADS[workload].build(sizes, ctx["max_tokens"]).eval()
            for tokens in args.tokens:
                group = run_group(workload, tokens, sizes, base, args.systems, args, ctx, bar)
                results += group
                if rank == 0:
                    bar.close()
                    print(report.group_table(group, world), flush=True)
            del base
    finally:
        bar.close()
        shutil.rmtree(cache, ignore_errors=True)
    if rank == 0:
        keys = ("workloads", "tokens", "systems", "iters", "warmup", "rtol", "smoke", "compiler")
        config = {k: getattr(args, k) for k in keys}
        config.update(
            sizes=dataclasses.asdict(sizes), min_shard_numel=args.min_shard_numel, dtype="float32", backend="gloo",
            plans={w: WORKLOADS[w].plan for w in args.workloads}, dynashard_plan="auto",
            compile={"fullgraph": True, "dynamic": False,
                     "inductor_cache": "a fresh directory per rank, system, workload and token count; "
                                       "in-memory caches cleared before every first compile and recompile"},
            source=source_version(),
            timing="interleaved rounds, barrier before each call, slowest rank's median/min",
        )
        rec = record(config, results, world, args.threads)
        write_json(out, rec)
        md = report.markdown(rec)
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(md)
        print("\n" + report.summary(rec) + f"\nwrote {out} and {os.path.splitext(out)[0]}.md", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    bad = [f"{r['workload']} t={r['tokens']} {r['system']}: "
           + (r.get("error") or f"max abs diff {r['max_abs_diff']:.3g} > {r['tolerance']:.3g}")
           for r in results if not r["ok"]]
    if bad:
        raise SystemExit("suite: failed or mismatched systems:\n  " + "\n  ".join(bad))


if __name__ == "__main__":
    main()
