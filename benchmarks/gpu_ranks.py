"""gpu_check S2: real ranks sharing one GPU over gloo, against the unsharded model.

NCCL 2.28 (torch 2.11) refuses two ranks on one GPU ("Duplicate GPU detected"); gloo has no such check and
moves CUDA tensors for the collectives dynashard emits, staging them through host memory. So 2 and 4
processes all on ``cuda:0``, ``init_process_group("gloo")`` (gloo serves both CPU and CUDA tensors),
run dynashard's real multi-process program. What this stands in for: NCCL's transport between GPUs and
any timing (gloo syncs the host; nothing here is fast). Each rank checks, on its own:

- logits of HF Llama (2 layers, 8 heads, 4 K/V heads) compiled with dynashard, float32 and bfloat16,
  against the same model unsharded, computed by this rank alone (one process's answer);
- 16 greedy tokens of ``generate()`` (``model.forward`` compiled, HF's default cache) equal to the
  unsharded model's, float32 (bfloat16 near-ties could flip an argmax without anything being wrong);
- one training step (``parallelize``, SGD over the shards, loss through HF's ``labels``): the loss
  before and after the step equal the unsharded twin's;
- torchao float8 MLPs (weight-only, dynamic float8 activations per tensor and per row) compiled with dynashard,
  eager and Inductor, against the unsharded float8 model (benchmarks/gpu_float8.py; a skip without torchao).

Rank worker: torchrun --standalone --nproc-per-node N -m benchmarks.gpu_ranks --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

WORLDS = (2, 4)
NEW_TOKENS = 16
FP32_RTOL = 1e-4  # float32, O(1) values: the same products summed in another order (about 1e-6 here)


def _llama(device: str, dtype: torch.dtype) -> Any:
    import transformers as T

    from tests.test_cuda import _unit_weights

    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=4, vocab_size=128, max_position_embeddings=64, pad_token_id=0,
                           bos_token_id=None, eos_token_id=None)  # (no eos: generate never stops early)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    _unit_weights(model)  # outputs O(1): a wrong term shows above bfloat16's bar
    return model.to(device=device, dtype=dtype).eval()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-6)


def logits(device: str, compiler: str) -> dict[str, Any]:
    import dynashard
    from tests.test_cuda import BF16_RTOL

    out = {}
    for dtype, bar in ((torch.float32, FP32_RTOL), (torch.bfloat16, BF16_RTOL)):
        model = _llama(device, dtype)
        twin = copy.deepcopy(model)
        ids = torch.randint(3, 128, (2, 12), device=device)
        torch.compiler.reset()
        fast = torch.compile(model, backend=dynashard.backend(compiler=compiler, min_shard_numel=0))
        with torch.no_grad():
            err = _rel(fast(ids, use_cache=False).logits, twin(ids, use_cache=False).logits)
        assert err <= bar, f"{dtype}: logits off by {err:.2e} of their magnitude (bar {bar:.1e})"
        out[str(dtype).removeprefix("torch.")] = err
    return out


def generate(device: str, compiler: str) -> dict[str, Any]:
    import dynashard

    model = _llama(device, torch.float32)
    twin = copy.deepcopy(model)
    ids = torch.randint(3, 128, (1, 6), device=device)
    torch.compiler.reset()
    model.forward = torch.compile(model.forward, backend=dynashard.backend(compiler=compiler, min_shard_numel=0))
    kw = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
    with torch.no_grad():
        got, want = model.generate(ids, **kw), twin.generate(ids, **kw)
    new = got[0, ids.shape[1]:].tolist()
    assert len(new) == NEW_TOKENS and torch.equal(got, want), f"tokens {new}, unsharded {want[0, 6:].tolist()}"
    return {"tokens": new}


def train_step(device: str, compiler: str) -> dict[str, Any]:
    import dynashard

    model = _llama(device, torch.float32).train()
    twin = copy.deepcopy(model)
    ids = torch.randint(3, 128, (2, 12), device=device)
    torch.compiler.reset()
    dynashard.parallelize(model, ids, options={"min_shard_numel": 0}, use_cache=False)
    fast = torch.compile(model, backend=dynashard.backend(compiler=compiler, min_shard_numel=0))
    held, whole = dynashard.held_bytes(model), dynashard.held_bytes(twin)
    losses = {}
    for name, fn, m in (("sharded", fast, model), ("unsharded", twin, twin)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)  # built over the shards (README "Training")
        before = fn(ids, labels=ids, use_cache=False).loss
        before.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            after = fn(ids, labels=ids, use_cache=False).loss
        losses[name] = (float(before), float(after))
    (b, a), (wb, wa) = losses["sharded"], losses["unsharded"]
    err = max(abs(b - wb) / abs(wb), abs(a - wa) / abs(wa))
    assert err <= FP32_RTOL, f"losses before/after the step {b:.6f}/{a:.6f}, unsharded {wb:.6f}/{wa:.6f}"
    assert held < 0.8 * whole, f"this rank holds {held} of {whole} bytes: not sharded"
    return {"loss_before": b, "loss_after": a, "rel_err": err, "held_fraction": held / whole}


def rank_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--compiler", default="inductor")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(0)  # every rank on cuda:0
    else:
        torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda:0" if args.device == "cuda" else "cpu"
    results = {}
    from benchmarks.gpu_float8 import rank_check

    for name, fn in (("logits", logits), ("generate", generate), ("train", train_step), ("float8", rank_check)):
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, **fn(device, args.compiler)}
        except Exception as e:  # noqa: BLE001 - recorded; the next check runs
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                             "traceback": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        with open(os.path.join(args.out, f"rank{rank}_of{world}.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# --- the stage: both worlds at once (they time nothing), each under its own deadline ----------------------


def stage(st: Any, args: argparse.Namespace) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu_ranks_") as tmp:
        _stage(st, args, tmp)


def _stage(st: Any, args: argparse.Namespace, tmp: str) -> None:
    from benchmarks.gpu_check import NO_CUDA, child_env

    device, compiler = ("cpu", "eager") if args.dry_run else ("cuda", "inductor")
    # (the dry run: world 2 only; world 4 is the same code, and 4 more CPU processes cost the default suite too much)
    worlds = (2,) if args.dry_run else WORLDS
    procs = {}
    for world in worlds:
        os.makedirs(os.path.join(tmp, str(world)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "-m", "benchmarks.gpu_ranks", "--device", device, "--compiler", compiler,
               "--out", os.path.join(tmp, str(world))]
        procs[world] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**child_env(), "OMP_NUM_THREADS": "1"}, start_new_session=True)
    deadline = time.monotonic() + args.timeout
    logs = {}
    for world, proc in procs.items():
        try:
            logs[world] = proc.communicate(timeout=max(1, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            logs[world] = f"(killed after {args.timeout:.0f} s)\n" + (proc.communicate()[0] or "")
    for world in worlds:
        per_rank = {}
        for r in range(world):
            path = os.path.join(tmp, str(world), f"rank{r}_of{world}.json")
            per_rank[r] = json.load(open(path)) if os.path.exists(path) else {}
        for check in ("logits", "generate", "train", "float8"):
            st.run(f"w{world} {check}", lambda w=world, c=check, p=per_rank: _judge(w, c, p, log=logs[w]))
    if args.dry_run:
        st.skip("w4", f"{NO_CUDA}: 4 ranks not run (the code of world 2, which ran)")
        st.skip("cuda", f"{NO_CUDA}: CPU tensors and compiler='eager'; CUDA tensors over gloo and Inductor not run")


def _judge(world: int, check: str, per_rank: dict[int, dict], log: str) -> dict[str, Any]:
    got = {r: res.get(check) for r, res in per_rank.items()}
    missing = [r for r, g in got.items() if g is None]
    if missing:
        raise RuntimeError(f"ranks {missing} did not finish {check}; torchrun's output:\n{log[-3000:]}")
    bad = {r: g["error"] for r, g in got.items() if not g["ok"]}
    if bad:
        raise AssertionError("; ".join(f"rank {r}: {e}" for r, e in bad.items()))
    g0 = got[0]
    if "skipped" in g0:
        from benchmarks.gpu_check import Skipped

        raise Skipped(g0["skipped"])
    summary = {"logits": lambda: f"rel err fp32 {g0['float32']:.1e}, bf16 {g0['bfloat16']:.1e}",
               "generate": lambda: f"{NEW_TOKENS} tokens as unsharded",
               "train": lambda: f"loss {g0['loss_before']:.4f}->{g0['loss_after']:.4f} as unsharded "
                                f"(rel {g0['rel_err']:.1e}), held {g0['held_fraction']:.2f}",
               "float8": lambda: "rel err " + ", ".join(f"{k} {v:.1e}" for k, v in g0["errors"].items())
                                 + "".join(f"; not run: {k} ({v})" for k, v in g0["skipped_configs"].items())}[check]()
    return {"summary": summary, "per_rank": got}


if __name__ == "__main__":
    rank_main()
