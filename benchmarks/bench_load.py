"""Loading a model larger than a rank should hold: peak RSS per rank and time to the first output.

Launch: python -m benchmarks.bench_load [--smoke] [--paths ...] [--compiler inductor|eager] [--out PATH]

The script writes a Llama-style checkpoint once (HF ``LlamaForCausalLM``, fp32; the default 10
layers of hidden 2048 / ffn 5632, 32 heads and 4 KV heads, vocab 32000, untied head: 581 M
parameters, 2.16 GiB) as an HF safetensors directory (``save_pretrained``, 1 GB files and their
index), as a torch.distributed.checkpoint directory and as one ``torch.save`` file, plus the
unsharded model's logits for a 32-token prompt. Then, for each path, it launches a fresh
``torchrun --nproc-per-node 2`` (gloo, one thread per rank) that loads the model, runs the prompt,
checks the logits and reports each rank's peak RSS (VmHWM, which counts file pages a rank has
mapped too) and the wall time from the launch to the model being loaded and to the first output:

- ``whole``: today's path. ``from_pretrained`` on every rank (the whole model), then
  ``torch.compile(model, backend="dynashard")``: the first call cuts and frees.
- ``safetensors``: built under ``dynashard.empty_weights()``, ``dynashard.parallelize(model, ids,
  checkpoint=DIR)`` (each rank reads its slices with ``get_slice``), then compiled.
- ``dcp``: the same from the DCP directory saved by the unsharded model.
- ``dcp_sharded``: the same from a DCP directory saved by the parallelized model at this world size
  (``dcp.save(model.state_dict())``, written by the ``safetensors`` path after its measurement): the
  resume case, where each saved chunk is one rank's pieces.
- ``hf_tp``: HF's own TP, ``from_pretrained(DIR, tp_plan="auto")`` (needs ``accelerate``: ``pip install
  -e .[bench]``), run eagerly as HF runs it.
- ``gpt_fast``: gpt-fast's loader as a reference: a meta model, ``torch.load(mmap=True)`` +
  ``load_state_dict(assign=True)``, each planned weight sliced by hand (colwise q/k/v/gate/up,
  rowwise o/down with an all_reduce hook) and copied out of the map, run eagerly.
- ``dynamo_floor``: no loading and no planning: the model built on meta, given uninitialised memory
  (``to_empty``), traced by Dynamo with ``backend="eager"`` and run once (its output is not compared).
  The floor of any path that compiles the model once on this machine: process start, imports,
  Dynamo's warm-up and its trace of the model.
- ``tiny``: the ``safetensors`` path on a 2-layer hidden-64 model of the same family: the process's
  own footprint (Python, torch, Dynamo, the compiler, gloo) with almost no weights.

Targets: a dynashard path's peak RSS per rank at most (its shards + replicated
tensors) x 1.15 + the tiny footprint, and at most 0.6x the ``whole`` path's; time to the first output
no slower than HF's TP. HF's TP and gpt-fast run eagerly, so ``--compiler eager`` is the like-for-like
time comparison; the default (Inductor) adds its compile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks._common import OUT_HELP, out_path, record, write_json

PATHS = ("whole", "safetensors", "dcp", "dcp_sharded", "hf_tp", "gpt_fast", "tiny", "dynamo_floor")


def config(smoke: bool, tiny: bool = False) -> dict:
    if smoke or tiny:
        return dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)
    return dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=10, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)


def write_checkpoints(cfg: dict, where: str, prompt_len: int) -> None:
    """The model (seed 0) in three formats and its logits, once per config (reused while the
    directory's config.json matches)."""
    import torch.distributed.checkpoint as dcp
    import transformers as T

    marker = os.path.join(where, "bench_config.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == cfg:
                return
    os.makedirs(where, exist_ok=True)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**cfg)).eval()
    model.save_pretrained(os.path.join(where, "hf"), max_shard_size="1GB")
    state = model.state_dict()
    dcp.save(state, checkpoint_id=os.path.join(where, "dcp"), no_dist=True)
    torch.save(state, os.path.join(where, "model.pth"))
    ids = torch.randint(0, cfg["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    torch.save({"ids": ids, "logits": logits}, os.path.join(where, "reference.pt"))
    with open(marker, "w") as f:
        json.dump(cfg, f)


# ---------------------------------------------------------------- one path, on each torchrun rank


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import transformers as T

    import dynashard
    from benchmarks._common import gather

    t0 = float(os.environ["BENCH_T0"])
    torch.set_num_threads(1)
    path = args.worker
    tiny = path == "tiny"
    where = args.tiny_dir if tiny else args.dir
    cfg = T.LlamaConfig(**config(args.smoke, tiny))
    hf_dir = os.path.join(where, "hf")
    ref = torch.load(os.path.join(where, "reference.pt"))
    ids = ref["ids"]
    options = {"compiler": args.compiler}
    if path != "hf_tp":  # HF's TP starts the process group itself
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    held = None
    with torch.no_grad():
        if path == "whole":
            model = T.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
            t_loaded = time.time() - t0
            run = torch.compile(model, backend=dynashard.backend(**options))
        elif path in ("safetensors", "dcp", "dcp_sharded", "tiny"):
            with dynashard.empty_weights():
                model = T.LlamaForCausalLM(cfg).eval()
            ckpt = {"dcp": os.path.join(where, "dcp"), "dcp_sharded": sharded_dir(where)}.get(path, hf_dir)
            dynashard.parallelize(model, ids, options=options, checkpoint=ckpt, use_cache=False)
            t_loaded = time.time() - t0
            held = dynashard.held_bytes(model)
            run = torch.compile(model, backend=dynashard.backend(**options))
        elif path == "hf_tp":
            model = T.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, tp_plan="auto").eval()
            t_loaded = time.time() - t0
            run = model
        elif path == "gpt_fast":
            model = gpt_fast_load(cfg, os.path.join(where, "model.pth"))
            t_loaded = time.time() - t0
            run = model
        elif path == "dynamo_floor":  # (no weights read: its output is not the model's; see the docstring)
            with torch.device("meta"):
                model = T.LlamaForCausalLM(cfg).eval()
            model.to_empty(device="cpu")
            model.model.rotary_emb = T.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
            t_loaded = time.time() - t0
            run = torch.compile(model, backend="eager")
        else:
            raise SystemExit(f"unknown path {path!r}; expected one of {PATHS}")
        logits = run(ids, use_cache=False).logits
    t_first = time.time() - t0
    if held is None:
        held = dynashard.held_bytes(model)
    err = 0.0 if path == "dynamo_floor" else float((logits - ref["logits"]).abs().max())
    per_rank = gather({"rank": rank, "peak_rss": peak_rss(), "held": held, "t_loaded_s": t_loaded,
                       "t_first_s": t_first, "max_abs_diff": err})
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(per_rank, f)
    if path == "safetensors":  # (after the measurement) the checkpoint the dcp_sharded path reads
        import torch.distributed.checkpoint as dcp

        dcp.save(model.state_dict(), checkpoint_id=sharded_dir(where))
    dist.barrier()
    dist.destroy_process_group()


def sharded_dir(where: str) -> str:
    import torch.distributed as dist

    return os.path.join(where, f"dcp_sharded_w{dist.get_world_size()}")


def gpt_fast_load(cfg, pth: str):
    """gpt-fast's loading (generate.py ``_load_model`` + tp.py ``_apply_tp_*``) on an HF Llama: meta
    model, mmap'd state dict assigned, then every planned weight replaced by a copy of its slice."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import transformers as T

    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg).eval()
    state = torch.load(pth, mmap=True, weights_only=True)
    model.load_state_dict(state, assign=True, strict=False)  # (non-persistent inv_freq: recomputed below)
    model.model.rotary_emb = T.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)

    def cut(linear, dim: int) -> None:
        piece = torch.tensor_split(linear.weight.detach(), world, dim=dim)[rank]
        linear.weight = torch.nn.Parameter(piece.clone(), requires_grad=False)  # out of the map

    def reduce(_module, _inputs, output):
        return funcol.all_reduce(output, "sum", dist.group.WORLD)

    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj):
            cut(lin, 0)
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            cut(lin, 1)
            lin.register_forward_hook(reduce)
    for name, p in model.named_parameters():  # replicated tensors: copied out of the map too
        if p.untyped_storage().data_ptr() in _mapped(state):
            owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            setattr(owner, attr, torch.nn.Parameter(p.detach().clone(), requires_grad=False))
    del state
    return model


def _mapped(state: dict) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in state.values()}


# ---------------------------------------------------------------- the driver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager", "eager"))
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "dynashard-bench-load"),
                        help="where the checkpoints are written (reused while the config matches)")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tol", type=float, default=1e-3)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, every path: seconds")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tiny-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown paths {unknown}; expected a subset of {PATHS}")
    if args.smoke:
        args.dir = os.path.join(args.dir, "smoke")
    tiny_dir = os.path.join(args.dir, "tiny")
    print(f"writing checkpoints to {args.dir} (reused when present)", file=sys.stderr)
    write_checkpoints(config(args.smoke), args.dir, args.prompt)
    write_checkpoints(config(args.smoke, tiny=True), tiny_dir, args.prompt)
    results = {}
    for path in paths:
        if path == "hf_tp" and not _has("accelerate"):
            results[path] = {"skipped": "HF's TP loading needs accelerate: pip install -e '.[bench]'"}
            print(f"{path}: skipped ({results[path]['skipped']})", file=sys.stderr)
            continue
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result = f.name
        env = {**os.environ, "BENCH_T0": repr(time.time()), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "benchmarks.bench_load", "--worker", path, "--dir", args.dir, "--tiny-dir", tiny_dir,
               "--result", result, "--compiler", args.compiler, "--prompt", str(args.prompt)]
        if args.smoke:
            cmd.append("--smoke")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            results[path] = {"failed": done.stderr[-3000:]}
            print(f"{path}: FAILED\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        with open(result) as f:
            per_rank = json.load(f)
        os.remove(result)
        results[path] = {
            "peak_rss_mib": max(mib(r["peak_rss"]) for r in per_rank),
            "held_mib": max(mib(r["held"]) for r in per_rank),
            "t_loaded_s": max(r["t_loaded_s"] for r in per_rank),
            "t_first_s": max(r["t_first_s"] for r in per_rank),
            "max_abs_diff": max(r["max_abs_diff"] for r in per_rank),
            "per_rank": per_rank,
        }
        r = results[path]
        print(f"{path:12s} peak RSS {r['peak_rss_mib']:8.0f} MiB  held {r['held_mib']:8.0f} MiB  loaded "
              f"{r['t_loaded_s']:6.1f} s  first output {r['t_first_s']:6.1f} s  max|diff| {r['max_abs_diff']:.2e}",
              file=sys.stderr)
    targets = check_targets(results)
    for line in targets["lines"]:
        print(line)
    rec = record({"model": config(args.smoke), "compiler": args.compiler, "prompt": args.prompt,
                  "paths": paths, "targets": targets}, results, args.nproc, 1)
    write_json(out_path(args.out, "load", args.smoke), rec)
    bad = [p for p, r in results.items() if "failed" in r or r.get("max_abs_diff", 0) > args.tol]
    return 1 if bad else 0


def check_targets(results: dict) -> dict:
    """The memory and time targets (module docstring), from the measured paths (absent paths: not checked)."""
    lines, out = [], {}
    tiny = results.get("tiny", {}).get("peak_rss_mib")
    whole = results.get("whole", {}).get("peak_rss_mib")
    hf = results.get("hf_tp", {}).get("t_first_s")
    for path in ("safetensors", "dcp", "dcp_sharded"):
        r = results.get(path)
        if not r or "peak_rss_mib" not in r:
            continue
        row = {"peak_rss_mib": r["peak_rss_mib"]}
        if tiny is not None:
            row["bound_mib"] = r["held_mib"] * 1.15 + tiny
            row["within_bound"] = r["peak_rss_mib"] <= row["bound_mib"]
        if whole is not None:
            row["vs_whole"] = r["peak_rss_mib"] / whole
            row["within_0.6x_whole"] = row["vs_whole"] <= 0.6
        if hf is not None:
            row["t_first_vs_hf_tp"] = r["t_first_s"] / hf
        out[path] = row
        lines.append(f"{path}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in row.items()))
    return {"lines": lines, **out}


def mib(n: float) -> float:
    return n / 2**20


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())
