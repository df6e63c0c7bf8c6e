"""Launch to first output, cold and warm: HF's TP eager and compiled against dynashard (issue 45, item 6).

Launch: python -m benchmarks.bench_start [--smoke] [--train] [--repeats 3] [--systems ...] [--out PATH]

``--train``: each system's first output is its first SGD step instead of its first logits (the loss of
``model(ids, labels=ids)``, its backward and ``SGD(lr=LR).step()``), and the record says how far that loss
and the loss after the step are from the unsharded model's (the driver's own step on the checkpoint).
dynashard's recipe is the same (``parallelize``, then ``torch.compile``), its first call under grad: the
training compile, whose plan and graph the compile cache keeps too.

The driver writes an 8-layer HF Llama checkpoint once (``save_pretrained``, fp32, hidden 1024 / ffn 2816,
16 heads and 4 KV heads, vocab 32000, untied head: 153 M parameters, 0.57 GiB) with the unsharded logits
of a 32-token prompt, then launches each system as a fresh ``torchrun --nproc-per-node 2`` (gloo, one
thread per rank). Every time is from the driver's launch of torchrun to the slowest rank's first logits:
process start, imports, reading the checkpoint, compiling and the call, for every system alike.

- ``hf_eager``: ``from_pretrained(DIR, tp_plan="auto")``, run eagerly (HF's TP as HF runs it).
- ``hf_compiled``: the same, then ``torch.compile(model)`` (Inductor), with an empty Inductor cache
  (``TORCHINDUCTOR_CACHE_DIR``: a new temporary directory).
- ``hf_compiled_warm``: a new torchrun of ``hf_compiled`` on the cache its cold run filled.
- ``ds_cold``: the README's recipe: ``AutoModelForCausalLM.from_config`` under ``dynashard.empty_weights()``,
  ``dynashard.parallelize(model, ids, checkpoint=DIR, use_cache=False)``, ``torch.compile(model,
  backend="dynashard")`` (Inductor), with an empty Inductor cache.
- ``ds_nested_cold`` / ``ds_nested_warm``: ``ds_cold`` / ``ds_warm`` with every decoder layer's forward one
  ``torch.compiler.nested_compile_region`` (set on the layers before ``parallelize``): planned flat, one
  region compiled by Inductor for all layers (``rewrite/outline.py``).
- ``ds_warm``: a new torchrun of ``ds_cold`` (same model, options, world size) on the Inductor and
  AOTAutograd caches its cold run filled (AOTAutograd's lives under ``TORCHINDUCTOR_CACHE_DIR`` too).

Each repeat gets new cache directories and runs the three groups ``[hf_eager]``, ``[hf_compiled,
hf_compiled_warm]``, ``[ds_cold, ds_warm]`` in an order rotated per repeat (a warm run right after its
cold one), so load drift on a shared machine hits every system alike. The checkpoint is in the page
cache after the first read, for every system alike.

Where the time goes, per run: each rank's wall clock at its stages (imports, model loaded, first
output), rank 0's ``torch._dynamo.utils.compilation_time_metrics`` summed per event (Dynamo's own timers:
the Dynamo trace, the backend call, Inductor's compile or cache load inside it, AOTAutograd's cache),
and for dynashard the ``TORCH_LOGS=dynashard`` summary lines (one per compile: cache hit or miss,
seconds, planning seconds).

Targets (issue 45): ``ds_cold`` at most 0.6x ``hf_compiled``; ``ds_warm`` at most 1.5x ``hf_eager``
(medians over the repeats; the first logits only: ``--train``'s ratios are printed without a target). Exits 1
when a system fails or its logits (``--train``: losses) differ by more than ``--tol``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks._common import OUT_HELP, out_path, record, write_json

SYSTEMS = ("hf_eager", "hf_compiled", "hf_compiled_warm", "ds_cold", "ds_warm", "ds_nested_cold", "ds_nested_warm")
GROUPS = (("hf_eager",), ("hf_compiled", "hf_compiled_warm"), ("ds_cold", "ds_warm"),
          ("ds_nested_cold", "ds_nested_warm"))
# Dynamo's timers summed in the record (the rest are kept too; these are the ones the README reads)
# What the profiled warm run is split into: (label, the file's path ends with, function), cumulative seconds
PROFILED = (
    ("parallelize (Dynamo trace + backend + reading the checkpoint)", "dynashard/load/parallelize.py", "parallelize"),
    ("Dynamo: frame compiles, backend included", "torch/_dynamo/convert_frame.py", "_compile"),
    ("Dynamo: the backend call", "torch/_dynamo/output_graph.py", "call_user_compiler"),
    ("dynashard backend", "dynashard/dynamo_backend.py", "dynashard_backend"),
    ("dynashard: aten trace + plan (analyse)", "dynashard/analysis.py", "analyse"),
    ("dynashard: aten traces (trace_aten)", "dynashard/_torch/__init__.py", "trace_aten"),
    ("dynashard: agreeing with the other ranks (STORE.agree)", "dynashard/weights/store.py", "agree"),
    ("dynashard: rewrite", "dynashard/rewrite/interpreter.py", "rewrite"),
    ("dynashard: Inductor via compile_graph (AOTAutograd + Inductor, cache load included)",
     "dynashard/_torch/__init__.py", "compile_graph"),
    ("AOTAutograd cache: try_load", "torch/_functorch/_aot_autograd/autograd_cache.py", "try_load"),
    ("dynashard: reading the shards (cut_and_free)", "dynashard/runtime/program.py", "cut_and_free"),
    ("dynashard: reading the weights left whole (materialize)", "dynashard/weights/freed.py", "materialize"),
    ("Inductor: compile_fx_inner (a compile, not a cache load)", "torch/_inductor/compile_fx.py", "compile_fx_inner"),
    ("Inductor: its vector-ISA probe (pick_vec_isa: g++ and a child Python per instruction set)",
     "torch/_inductor/cpu_vec_isa.py", "valid_vec_isa_list"),
    ("waiting on file locks (the other ranks' compiles of the same kernels, the probe's builds)",
     "torch/utils/_filelock.py", "__enter__"),
)
EVENTS = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler", "build_guards",
          "compile_fx_inner", "compile_fx.<locals>.fw_compiler_base", "create_aot_dispatcher_function",
          "autograd_cache_get", "fx_graph_cache_get", "PyCodeCache.load_by_key_path", "async_compile.wait")


LR = 0.1  # the SGD step of --train (large enough that a wrong gradient moves the loss after the step)


def config(smoke: bool) -> dict:
    if smoke:
        return dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)
    return dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)


def write_checkpoint(cfg: dict, where: str, prompt_len: int) -> None:
    """The model (seed 0) as an HF directory and its logits, once per config (reused while it matches)."""
    import torch
    import transformers as T

    marker = os.path.join(where, "bench_config.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == {**cfg, "lr": LR}:
                return
    os.makedirs(where, exist_ok=True)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**cfg)).eval()
    model.save_pretrained(os.path.join(where, "hf"), max_shard_size="1GB")
    ids = torch.randint(0, cfg["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    # (training: the unsharded model's loss, one SGD step, its loss after it)
    model.train()
    loss0 = model(ids, labels=ids, use_cache=False).loss
    loss0.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    with torch.no_grad():
        loss1 = model(ids, labels=ids, use_cache=False).loss
    torch.save({"ids": ids, "logits": logits, "loss0": loss0.detach(), "loss1": loss1},
               os.path.join(where, "reference.pt"))
    with open(marker, "w") as f:
        json.dump({**cfg, "lr": LR}, f)


# ---------------------------------------------------------------- one system, on each torchrun rank


def worker(args: argparse.Namespace) -> None:
    t0 = float(os.environ["BENCH_T0"])
    import torch

    t_torch = time.time() - t0
    import torch.distributed as dist
    import transformers as T

    import dynashard
    from benchmarks._common import gather

    t_imports = time.time() - t0
    profile_to = os.environ.get("BENCH_PROFILE") if os.environ["RANK"] == "0" else None
    if profile_to:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    torch.set_num_threads(1)
    hf_dir = os.path.join(args.dir, "hf")
    ref = torch.load(os.path.join(args.dir, "reference.pt"))
    ids = ref["ids"]
    system = args.worker.removesuffix("_warm").removesuffix("_cold")
    with contextlib.nullcontext() if args.train else torch.no_grad():
        if system in ("hf_eager", "hf_compiled"):  # (HF's TP starts the process group itself)
            model = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, tp_plan="auto").eval()
            t_loaded = time.time() - t0
            run = torch.compile(model) if system == "hf_compiled" else model
        elif system in ("ds", "ds_nested"):
            dist.init_process_group("gloo")
            with dynashard.empty_weights():
                model = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(hf_dir)).eval()
            if system == "ds_nested":  # every decoder layer's forward one nested compile region (the same function)
                # (the layer class's forward decorated, in a subclass: torch 2.13-2.15's Dynamo gives every call
                # of a region bound per instance, region.__get__(layer), the first layer's weights under no_grad)
                layer_class = type(model.model.layers[0])
                region_class = type(layer_class.__name__, (layer_class,),
                                    {"forward": torch.compiler.nested_compile_region(layer_class.forward)})
                for layer in model.model.layers:
                    layer.__class__ = region_class
            dynashard.parallelize(model, ids, checkpoint=hf_dir, use_cache=False)
            t_loaded = time.time() - t0
            run = torch.compile(model, backend="dynashard")
        else:
            raise SystemExit(f"unknown system {args.worker!r}; expected one of {SYSTEMS}")
        if args.train:  # the first SGD step is the first output
            model.train()
            loss0 = run(ids, labels=ids, use_cache=False).loss
            loss0.backward()
            torch.optim.SGD(model.parameters(), lr=LR).step()
        else:
            logits = run(ids, use_cache=False).logits
    t_first = time.time() - t0
    if profile_to:
        profile.disable()
        profile.dump_stats(profile_to)
    from torch._dynamo.utils import compilation_time_metrics  # (Dynamo's own timers, always on)

    timers = {k: [len(v), sum(v)] for k, v in compilation_time_metrics.items()}
    if args.train:  # (the loss after the step, its forward outside the timed span)
        with torch.no_grad():
            loss1 = run(ids, labels=ids, use_cache=False).loss
        err = max(abs(float(loss0) - float(ref["loss0"])), abs(float(loss1) - float(ref["loss1"])))
    else:
        err = float((logits - ref["logits"]).abs().max())
    per_rank = gather({"rank": dist.get_rank(), "t_torch_s": t_torch, "t_imports_s": t_imports,
                       "t_loaded_s": t_loaded, "t_first_s": t_first, "max_abs_diff": err, "timers": timers})
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(per_rank, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the driver


def launch(args: argparse.Namespace, system: str, cache: str, profile_to: str | None = None) -> dict:
    """One fresh torchrun of ``system`` on the Inductor cache ``cache``; its per-rank record
    (``profile_to``: rank 0 profiled from its imports to its first output, the stats written there)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": cache}
    if profile_to:
        env["BENCH_PROFILE"] = profile_to
    if system.startswith("ds"):
        env["TORCH_LOGS"] = "dynashard"  # (the summary lines: rank 0, a few lines per run)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "benchmarks.bench_start", "--worker", system, "--dir", args.dir, "--result", result,
           *(["--train"] if args.train else [])]
    load_before = os.getloadavg()[0]
    env["BENCH_T0"] = repr(time.time())
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - float(env["BENCH_T0"])
    if done.returncode != 0:
        return {"failed": done.stderr[-3000:]}
    with open(result) as f:
        per_rank = json.load(f)
    os.remove(result)
    timers = per_rank[0].pop("timers")
    for r in per_rank[1:]:
        r.pop("timers")
    lines = [m.group(1) for m in re.finditer(r"(dynashard: compiled (?:graph|a graph parallelize planned) .*)",
                                             done.stderr)]
    return {"t_first_s": max(r["t_first_s"] for r in per_rank), "split": split(per_rank[0], timers),
            "t_loaded_s": max(r["t_loaded_s"] for r in per_rank),
            "t_imports_s": max(r["t_imports_s"] for r in per_rank), "t_torch_s": max(r["t_torch_s"] for r in per_rank),
            "max_abs_diff": max(r["max_abs_diff"] for r in per_rank), "wall_s": wall,
            "load_before": load_before, "load_after": os.getloadavg()[0],
            "timers_rank0": {k: [n, round(s, 3)] for k, (n, s) in timers.items()},
            "dynashard_log": lines, "per_rank": per_rank}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "dynashard-bench-start"),
                        help="where the checkpoint is written (reused while the config matches)")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tol", type=float, default=1e-3)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one repeat")
    parser.add_argument("--train", action="store_true",
                        help="time to the first SGD step (loss, backward, step) instead of the first logits")
    parser.add_argument("--profile", default=None,
                        help="comma-separated systems run once more after the last repeat with rank 0 under cProfile "
                             "(a cold one on a new cache, a warm one on its cold run's); default: ds_warm when it runs")
    parser.add_argument("--no-profile", dest="profile", action="store_const", const="",
                        help="no profiled run")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; expected a subset of {SYSTEMS}")
    profiled = ([s for s in args.profile.split(",") if s] if args.profile is not None
                else ["ds_warm"] if "ds_warm" in systems else [])
    if sorted(set(profiled) - set(systems)):
        parser.error(f"--profile {sorted(set(profiled) - set(systems))}: not among --systems {systems}")
    if any(s.startswith("hf") for s in systems) and not _has("accelerate"):
        parser.error("HF's TP loading needs accelerate: pip install -e '.[bench]'")
    if args.smoke:
        args.dir, args.repeats = os.path.join(args.dir, "smoke"), 1
    print(f"writing the checkpoint to {args.dir} (reused when present)", file=sys.stderr)
    write_checkpoint(config(args.smoke), args.dir, args.prompt)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    loads, results_profile = [os.getloadavg()], {}
    for rep in range(args.repeats):
        groups = GROUPS[rep % len(GROUPS):] + GROUPS[:rep % len(GROUPS)]
        caches = {g[0]: tempfile.mkdtemp(prefix=f"bench-start-{g[0]}-") for g in groups}
        for group in groups:
            for system in group:
                if system not in systems:
                    continue
                r = launch(args, system, caches[group[0]])
                runs[system].append(r)
                shown = "FAILED\n" + r["failed"] if "failed" in r else (
                    f"{r['t_first_s']:6.1f} s (imports {r['t_imports_s']:4.1f} s, loaded {r['t_loaded_s']:5.1f} s; "
                    + ", ".join(f"{k} {v:.1f} s" for k, v in r["split"].items()
                                if k.endswith("_s") and k.startswith(("dynamo", "backend")))
                    + f"; load avg {r['load_before']:.1f})")
                print(f"repeat {rep} {system:17s} first output {shown}", file=sys.stderr)
                for line in r.get("dynashard_log", []):
                    print(f"    {line}", file=sys.stderr)
        if rep == args.repeats - 1:
            for system in profiled:
                group = next(g for g in groups if system in g)
                fresh = system == group[0]
                cache = tempfile.mkdtemp(prefix=f"bench-start-{system}-") if fresh else caches[group[0]]
                results_profile[f"{system}_profiled"] = profile_run(args, system, cache)
                if fresh:
                    shutil.rmtree(cache, ignore_errors=True)
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
        loads.append(os.getloadavg())
    results = {s: summarize(rs) for s, rs in runs.items()}
    results.update(results_profile)
    targets = check_targets(results, args.train)
    for line in targets["lines"]:
        print(line)
    rec = record({"model": config(args.smoke), "prompt": args.prompt, "train": args.train,
                  "lr": LR if args.train else None, "repeats": args.repeats, "systems": systems,
                  "load_average_1_5_15": loads, "targets": targets}, results, args.nproc, 1)
    write_json(out_path(args.out, "start_train" if args.train else "start", args.smoke), rec)
    bad = [s for s, rs in runs.items() for r in rs if "failed" in r or r["max_abs_diff"] > args.tol]
    return 1 if bad else 0


def split(rank0: dict, timers: dict) -> dict:
    """Rank 0's seconds by stage, from its clock and Dynamo's timers (summed over the run's frames)."""
    def total(event: str) -> float:
        return timers.get(event, [0, 0.0])[1]

    return {"imports_s": rank0["t_imports_s"], "to_loaded_s": rank0["t_loaded_s"] - rank0["t_imports_s"],
            "loaded_to_first_s": rank0["t_first_s"] - rank0["t_loaded_s"],
            "dynamo_frames": timers.get("_compile.compile_inner", [0])[0],
            "dynamo_trace_s": total("_compile.compile_inner") - total("OutputGraph.call_user_compiler"),
            "backend_s": total("OutputGraph.call_user_compiler"),
            "inductor_compile_s": total("compile_fx_inner"),
            "inductor_cache_load_s": total("AOTAutogradCache.inductor_load")}


def profile_run(args: argparse.Namespace, system: str, cache: str) -> dict:
    """One more run of ``system`` on ``cache`` (a warm system: its cold run's of the last repeat; a cold one: a new
    directory), rank 0 under cProfile (its times are inflated by the profiler and are not among the timed runs):
    where that start's seconds go. Each row is its function's cumulative seconds over the run (pstats: summed over
    its calls, a call nested in another of the same function counted once): the file-lock row is every wait
    for a lock, summed."""
    import pstats

    with tempfile.NamedTemporaryFile(suffix=".prof", delete=False) as f:
        prof = f.name
    r = launch(args, system, cache, profile_to=prof)
    if "failed" in r:
        return r
    stats = pstats.Stats(prof).stats  # {(file, line, function): (calls, primitive calls, tottime, cumtime, callers)}
    os.remove(prof)
    split = {}
    for label, file_end, function in PROFILED:
        found = [v[3] for (file, _, fn), v in stats.items() if fn == function and file.endswith(file_end)]
        split[label] = round(max(found), 3) if found else None
    r["profile_rank0_cumulative_s"] = split
    print(f"profiled {system}: first output {r['t_first_s']:.1f} s under cProfile; rank 0 cumulative seconds:",
          file=sys.stderr)
    for label, sec in split.items():
        print(f"    {sec if sec is not None else '-':>8} {label}", file=sys.stderr)
    return r


def summarize(rs: list[dict]) -> dict:
    ok = [r for r in rs if "failed" not in r]
    if not ok:
        return {"failed": rs[0]["failed"] if rs else "not run", "runs": rs}
    t = [r["t_first_s"] for r in ok]
    return {"t_first_median_s": statistics.median(t), "t_first_min_s": min(t), "t_first_s": t,
            "t_loaded_median_s": statistics.median(r["t_loaded_s"] for r in ok),
            "t_imports_median_s": statistics.median(r["t_imports_s"] for r in ok),
            "max_abs_diff": max(r["max_abs_diff"] for r in ok), "failures": len(rs) - len(ok), "runs": rs}


def check_targets(results: dict, train: bool = False) -> dict:
    """The issue's two ratios, of medians (absent systems: not checked; ``train``: no target)."""
    def med(s: str) -> float | None:
        return results.get(s, {}).get("t_first_median_s")

    out, lines = {}, []
    for name, num, den, bound in (("cold_vs_hf_compiled", "ds_cold", "hf_compiled", 0.6),
                                  ("warm_vs_hf_eager", "ds_warm", "hf_eager", 1.5),
                                  ("nested_cold_vs_hf_compiled", "ds_nested_cold", "hf_compiled", 0.6),
                                  ("nested_warm_vs_hf_eager", "ds_nested_warm", "hf_eager", 1.5),
                                  ("hf_warm_vs_hf_eager", "hf_compiled_warm", "hf_eager", None)):
        if med(num) is None or med(den) is None:
            continue
        ratio = med(num) / med(den)
        bound = None if train else bound
        out[name] = {"ratio": ratio, "target": bound, "met": None if bound is None else ratio <= bound}
        verdict = "" if bound is None else f" (target <= {bound}: {'met' if ratio <= bound else 'NOT met'})"
        lines.append(f"{num} / {den}: {med(num):.1f} s / {med(den):.1f} s = {ratio:.2f}x{verdict}")
    return {"lines": lines, **out}


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())
