"""gpu_check S4: a FORECAST of tensor-parallel decode speedups from one GPU. Not a measurement of TP.

What is measured: rank 0's program of a Llama-2-7B-shaped model (bench_decode's gpt-fast-style Llama:
hidden 4096, 32 heads, 32 K/V heads, MLP 11008, vocab 32000; ``--layers`` of its 32 layers, bf16,
batch 1, a KV cache of ``CONTEXT`` positions) compiled by dynashard with ``mode="reduce-overhead"``
(CUDA graphs) on the fake process group at TP 1, 2, 4 and 8: its collectives move no data, so a step
is this rank's sharded compute alone. One decode step is timed with CUDA events over ``STEPS`` replays;
``torch.compile(mode="reduce-overhead")`` of the unsharded model gives the backend's own overhead at TP 1.

What is assumed (the forecast): decode at batch 1 is bound by memory traffic, so the 32-layer step is the
measured one scaled by the bytes rank 0 reads per step (weights and KV cache, 32 layers against
``--layers``); each collective costs a published all-reduce latency on NVLink (``LATENCY_US``, cited);
compute and communication do not overlap; no skew between ranks. T_N = t(N) + n_coll(N) x L(N), and
the speedup S_N = T_1 / T_N, beside gpt-fast's measured 1.61x (TP2) and 2.42x (TP4). ``break_even_us``:
the per-collective latency at which S_N would fall to 1.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from typing import Any

import torch

TPS = (1, 2, 4, 8)
CONTEXT = 512
STEPS = 100
FULL_LAYERS = 32

# Published small-message all-reduce latencies on H100 NVLink, in microseconds, at 32 KB (the decode
# step's messages are 8 KB: 4096 bf16 values; the LM head's gather 64/N KB). Both rows from the same
# table, without CUDA graphs: https://github.com/sgl-project/sglang/pull/2904 (H100, "custom allreduce"
# is TensorRT-LLM's one-shot kernel as SGLang ships it; "vllm" is vLLM's custom all-reduce).
LATENCY_US = {
    "one-shot custom all-reduce (TRT-LLM kernel, sglang PR 2904, H100)": {2: 4.5, 4: 4.8, 8: 7.8},
    "vLLM custom all-reduce (sglang PR 2904, H100)": {2: 8.7, 4: 9.2, 8: 11.8},
}
# gpt-fast's README, "Tensor Parallelism": Llama-2-7B, 104.9 / 168.84 / 254.02 / 328.43 tokens/s on
# 1 / 2 / 4 / 8 A100-80GB (https://github.com/pytorch-labs/gpt-fast)
GPT_FAST = {"source": "https://github.com/pytorch-labs/gpt-fast README, Tensor Parallelism, Llama-2-7B, A100",
            "speedup": {2: round(168.84 / 104.9, 2), 4: round(254.02 / 104.9, 2), 8: round(328.43 / 104.9, 2)}}


def _sizes(dry: bool, layers: int) -> Any:
    from benchmarks.bench_decode import Sizes

    if dry:  # heads and K/V heads divisible by 8
        return Sizes(layers=2, dim=64, heads=8, kv_heads=8, ffn=128, vocab=256)
    return Sizes(layers=layers, dim=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000)


def bytes_per_step(s: Any, layers: int, n: int, context: int, elt: int = 2) -> float:
    """Bytes rank 0 reads per decode step at TP ``n``: its shards of every layer's weights and KV cache,
    and of the LM head (the embedding reads one row)."""
    kv_dim = s.kv_heads * s.head_dim
    layer = (s.dim * (s.dim + 2 * kv_dim) + s.dim * s.dim + 3 * s.dim * s.ffn) * elt
    cache = 2 * context * kv_dim * elt
    return (layers * (layer + cache) + s.dim * s.vocab * elt) / n


def collectives(model: torch.nn.Module, args: tuple, n: int) -> dict[str, Any]:
    """dynashard's plan at TP ``n``: the collectives of one decode step, in the layers and outside them."""
    import dynashard

    if n == 1:
        return {"in_layers": 0, "outside": 0}
    report = dynashard.explain(model, *args, world_size=n, options={"min_shard_numel": 0})
    rows = [r for r in report.rows if r.collectives not in ("-", "")]
    in_layers = sum(r.fqn.startswith("layers.") for r in rows)
    return {"in_layers": in_layers, "outside": len(rows) - in_layers, "rows": [(r.fqn, r.collectives) for r in rows]}


def time_steps(fn: Any, token: torch.Tensor, device: str, steps: int) -> float:
    """Seconds per decode step, after the compile (first call), the recording and a few replays."""
    pos = [torch.tensor([CONTEXT + i], device=device) for i in range(steps + 4)]
    with torch.no_grad():
        for p in pos[:4]:
            torch.compiler.cudagraph_mark_step_begin()
            fn(token, p)
        if device == "cpu":
            start = time.perf_counter()
            for p in pos[4:]:
                fn(token, p)
            return (time.perf_counter() - start) / steps
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for p in pos[4:]:
            torch.compiler.cudagraph_mark_step_begin()
            fn(token, p)
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3 / steps


def measure(n: int, s: Any, device: str, dry: bool, plain: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    import dynashard
    from benchmarks.bench_decode import Llama
    from dynashard import _torch as private

    torch.compiler.reset()
    torch.manual_seed(0)
    dtype = torch.float32 if dry else torch.bfloat16
    base = Llama(s, max_len=CONTEXT + STEPS + 8).to(device=device, dtype=dtype).eval()
    token = torch.tensor([[1]], device=device)
    probe = (token, torch.tensor([CONTEXT], device=device))
    coll = collectives(copy.deepcopy(base) if n > 1 else base, probe, n)
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    private.init_fake_process_group(n, 0)
    try:
        if plain:
            fn = torch.compile(base, mode=None if dry else "reduce-overhead", backend="eager" if dry else "inductor")
        else:
            backend = dynashard.backend(compiler="eager", min_shard_numel=0) if dry else \
                dynashard.backend(mode="reduce-overhead", min_shard_numel=0)
            fn = torch.compile(base, backend=backend)
        started = time.perf_counter()
        step_s = time_steps(fn, token, device, 4 if dry else STEPS)
        wall = time.perf_counter() - started
    finally:
        dist.destroy_process_group()
    return {"tp": n, "step_ms": step_s * 1e3, "collectives": coll, "seconds": round(wall, 1),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips}


def forecast(measured: dict[int, dict], s: Any, layers: int) -> dict[str, Any]:
    full = {n: m["step_ms"] * bytes_per_step(s, FULL_LAYERS, n, CONTEXT) / bytes_per_step(s, layers, n, CONTEXT)
            for n, m in measured.items()}
    n_coll = {n: m["collectives"]["outside"] + m["collectives"]["in_layers"] * FULL_LAYERS // layers
              for n, m in measured.items()}
    out: dict[str, Any] = {"t_full_ms": full, "n_coll": n_coll, "tiers": {}}
    if 1 not in full:
        return out
    for tier, lat in LATENCY_US.items():
        out["tiers"][tier] = {n: round(full[1] / (full[n] + n_coll[n] * lat[n] / 1e3), 2) for n in full if n > 1}
    out["break_even_us"] = {n: round((full[1] - full[n]) / n_coll[n] * 1e3, 1) for n in full if n > 1 and n_coll[n]}
    return out


def stage(st: Any, args: argparse.Namespace) -> None:
    from benchmarks.gpu_check import NO_CUDA

    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    layers = 2 if dry else args.layers
    s = _sizes(dry, layers)
    measured: dict[int, dict] = {}
    for n in (1, 2) if dry else TPS:
        m = st.run(f"tp{n}", lambda n=n: {**measure(n, s, device, dry), "summary": ""})
        if m is not None:
            measured[n] = m
            st.checks[-1].detail = f"{m['step_ms']:.3f} ms/step ({layers} layers)"
    st.run("plain tp1 (no dynashard)", lambda: {**measure(1, s, device, dry, plain=True), "summary": ""})
    if st.checks[-1].verdict == "PASS":
        st.checks[-1].detail = f"{st.checks[-1].data['step_ms']:.3f} ms/step"

    def predict() -> dict[str, Any]:
        f = forecast(measured, s, layers)
        assert 1 in measured and len(measured) > 1, f"too few degrees measured: {sorted(measured)}"
        tier = next(iter(LATENCY_US))
        said = ", ".join(f"TP{n} {x}x" for n, x in f["tiers"][tier].items())
        gf = ", ".join(f"TP{n} {x}x" for n, x in GPT_FAST["speedup"].items() if n in (2, 4))
        return {"summary": f"FORECAST (one-shot AR tier): {said}; gpt-fast measured {gf} on A100", **f}

    st.run("forecast", predict)
    st.facts.update(label="FORECAST: per-rank compute measured on one GPU with the fake process group; "
                          "collective latencies published (cited), not measured; not a multi-GPU measurement",
                    sizes=dataclasses.asdict(s), layers_measured=layers, full_layers=FULL_LAYERS, context=CONTEXT,
                    steps=STEPS, latency_us=LATENCY_US, gpt_fast=GPT_FAST, method=__doc__)
    if dry:
        st.skip("tp4, tp8", f"{NO_CUDA}: TP 4 and 8 not run (the code of TP 2, which ran)")
        st.skip("cuda graphs", f"{NO_CUDA}: the 7B shape in bf16 under CUDA graphs not run; a tiny float32 model "
                               "ran on CPU with compiler='eager': its times and forecast mean nothing")
