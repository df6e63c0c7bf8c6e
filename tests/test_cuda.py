"""The GPU tier (``pytest -m cuda``; ``bash benchmarks/gpu_check.sh`` runs it): what CPU cannot check.

NEVER RUN ON A GPU. Written on a CPU-only machine against torch 2.13 and transformers 5.23; there
it is collected and skipped (every test needs ``torch.cuda.is_available()``). Until a GPU run has
passed, read each test as a specification of what should hold, not as evidence that it does.

One GPU (a fake process group or simulated ranks stand in for the other ranks):
- HF Llama, Qwen2 and GPT-2 in bfloat16 under each CUDA SDPA kernel forced alone (flash,
  memory-efficient, cuDNN, math): ``explain(verify=True)``, every rank's program against the unsharded
  model, and the plan tests/test_hf_models.py pins on CPU; and under Inductor, rank 0's program against
  the same program run eagerly (benchmarks/gpu_check.sh S1 runs each kernel in a process of its own).
  (On CPU these rules are checked through math stand-ins for the kernels, tests/gpu_attention_on_cpu.py:
  never the kernels themselves.)
- Inductor's Triton code for a sharded graph, against the same graph run eagerly.
- ``mode="reduce-overhead"``: the sharded graph replays as a CUDA graph that reads its shards in
  place (no copy of a weight per replay); a cache grown by cat (HF's DynamicCache) and held by heads
  survives the next replay.
- NCCL at world 1 (tests/cuda_ranks.py, a subprocess): dynashard's host-side messages travel on a
  CPU companion group of the NCCL group.
Two GPUs: real NCCL ranks against the unsharded model (an MLP, a Llama decoder, bench_decode's
cached decoder), and the demo.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import dynashard
from dynashard import _torch as private
from tests import models
from tests.multiproc import SUBPROCESS_DEADLINE_S

NO_CUDA = "no CUDA: torch.cuda.is_available() is False (the GPU tier: `pytest -m cuda` on a GPU)"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason=(
    f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}" if torch.cuda.is_available() else NO_CUDA))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cuda"
aten = torch.ops.aten

# --- HF models under each CUDA SDPA kernel, bfloat16, every rank simulated -------------------------

# The op F.scaled_dot_product_attention traces to on CUDA when only that kernel is allowed.
KERNELS = {
    "flash": ("FLASH_ATTENTION", aten._scaled_dot_product_flash_attention.default),
    "efficient": ("EFFICIENT_ATTENTION", aten._scaled_dot_product_efficient_attention.default),
    "cudnn": ("CUDNN_ATTENTION", aten._scaled_dot_product_cudnn_attention.default),
    # math: SDPA decomposes into matmuls and a softmax while tracing; no fused kernel op in the graph
    "math": ("MATH", None),
}
# How HF calls SDPA. "mask": as it ships, compiled: transformers keeps the boolean causal mask while
# Dynamo traces (masking_utils._ignore_causal_mask_sdpa never skips it under torch < 2.14), so SDPA gets
# attn_mask and is_causal=False. "causal": no mask, is_causal=True (and enable_gqa=True for fewer K/V
# heads than query heads), what HF runs eagerly and the only form flash takes (it accepts no mask).
CAUSAL_ATTENTION = "sdpa_is_causal"
# NOTE: torch 2.13's refusals when the allowed SDPA kernels cannot take a call (CUDA's select_sdp_backend;
# the second is the CPU dispatcher's, met when this file's helpers are tried on CPU)
NO_KERNEL = ("No available kernel", "No viable backend for scaled_dot_product_attention")
CASES = [("flash", "causal"), ("efficient", "causal"), ("efficient", "mask"), ("cudnn", "causal"), ("cudnn", "mask"),
         ("math", "causal"), ("math", "mask")]
# Under Inductor, one form per kernel: as HF ships compiled (a mask), except flash (no mask at all)
INDUCTOR_CASES = [("flash", "causal"), ("efficient", "mask"), ("cudnn", "mask"), ("math", "mask")]
FUSED_OPS = {v[1] for v in KERNELS.values() if v[1] is not None}

# bfloat16 keeps 8 significant bits: one rounding is off by up to 2**-9 of the value. A sharded linear
# rounds each rank's partial sum, and the all_reduce rounds their sum again, where the unsharded one
# rounds once; the layers after it (norms, softmax, SiLU, more matmuls) carry that error on, scaled by
# a few. 2**-5 of the largest magnitude of a layer's output is about 16 roundings' worth: room for that,
# while a wrong number (a missing or doubled rank's term, another rank's head, a misplaced shard) moves
# outputs by a sizeable part of their magnitude, which the weights below keep O(1). explain's own bar
# for bfloat16 (report._RTOL: 0.4 absolute) is far looser, hence this one. Tried on CPU (the CPU flash
# kernel, bf16, HF Llama): errors were 0.4-0.9% of the magnitudes, and a simulated all_reduce 6% off
# failed this bar (o_proj 0.17 of 2.6) while passing explain's.
BF16_RTOL = 2**-5


def _register_causal_attention() -> None:
    """HF's SDPA attention with no mask at all: the inputs here have no padding and no cache (query
    and key lengths equal), where a causal mask is exactly ``is_causal=True``."""
    import transformers as T
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    T.AttentionInterface.register(CAUSAL_ATTENTION, sdpa_attention_forward)
    T.masking_utils.AttentionMaskInterface.register(CAUSAL_ATTENTION, lambda *args, **kwargs: None)


def _unit_weights(model: torch.nn.Module) -> None:
    """Every 2-D weight drawn at std 1/sqrt(fan_in) and biases at 0.1: each layer's output is O(1).
    (HF's initializer_range 0.02 leaves outputs near 1e-2, where a wrong term hides under bf16's bar.)"""
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.nn.Parameter) and weight.dim() == 2:
                fan_in = weight.shape[0] if type(module).__name__ == "Conv1D" else weight.shape[1]  # GPT-2: [in, out]
                weight.normal_(0.0, fan_in ** -0.5)
                bias = getattr(module, "bias", None)
                if isinstance(bias, torch.nn.Parameter):
                    bias.normal_(0.0, 0.1)


def _hf_model(arch: str, form: str, device: str, dtype: torch.dtype):
    import transformers as T

    from tests.hf_configs import CONFIGS

    _register_causal_attention()
    torch.manual_seed(0)
    attention = CAUSAL_ATTENTION if form == "causal" else "sdpa"
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch](), attn_implementation=attention)
    _unit_weights(model)
    return model.to(device=device, dtype=dtype).eval()


def _messages(error: BaseException) -> str:
    seen, chain = [], error
    while chain is not None and len(seen) < 8:
        seen.append(f"{type(chain).__name__}: {chain}")
        chain = chain.__cause__ or chain.__context__
    return "\n".join(seen)


def _traced_ops_or_skip(model, ids, kernel: str, backend) -> set:
    """The aten ops of the model's graph, traced by Dynamo and AOTAutograd with only ``kernel`` allowed,
    and run. A skip when torch itself has no such kernel for this GPU and call (``NO_KERNEL``):
    a fact about the GPU (or the call's form), decided before dynashard is involved."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ops: set = set()

    def record(gm, example_inputs):
        ops.update(n.target for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    with sdpa_kernel([getattr(SDPBackend, backend)]), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.no_grad():
                torch.compile(model, backend=aot_autograd(fw_compiler=record))(ids, use_cache=False)
        except Exception as e:  # noqa: BLE001 - only torch's own refusal is a skip
            said = _messages(e)
            if not any(refusal in said for refusal in NO_KERNEL):
                raise
            why = " | ".join(str(w.message) for w in caught if "attention" in str(w.message).lower())[:1500]
            name = torch.cuda.get_device_name() if torch.cuda.is_available() else "this device"
            pytest.skip(f"SDPA {kernel} ({backend}) is unsupported on {name} for this call: torch found no "
                        f"kernel; its reasons: {why or 'none given'}")
    return ops


def _output_magnitudes(model, ids, fqns) -> tuple[dict[str, float], float]:
    """The largest |value| each named module outputs, and of the logits, in one eager run."""
    scales: dict[str, float] = {}
    handles = []
    for fqn in fqns:
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            continue

        def hook(_module, _args, out, fqn=fqn):
            scales[fqn] = max(scales.get(fqn, 0.0), float(out.detach().abs().max()))

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    top = float(logits.abs().max())
    for fqn in list(scales):  # a tied embedding's row also carries the LM head's error (the logits)
        if isinstance(model.get_submodule(fqn), torch.nn.Embedding):
            scales[fqn] = max(scales[fqn], top)
    return scales, top


def check_hf_kernel(arch: str, kernel: str, form: str, device: str = DEVICE, dtype: torch.dtype = torch.bfloat16,
                    world: int = 2) -> dynashard.explainer.Report:
    """One architecture under one SDPA kernel: the kernel really traced, every simulated rank equal to the
    unsharded model within ``BF16_RTOL`` of each layer's magnitude, and the plan the CPU tier pins."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.hf_configs import EXPECTED

    backend, op = KERNELS[kernel]
    model = _hf_model(arch, form, device, dtype)
    ids = torch.randint(3, 96, (2, 7), device=device)
    ops = _traced_ops_or_skip(model, ids, kernel, backend)
    if op is None:
        assert not ops & FUSED_OPS, f"forced {backend}, the graph has a fused op: {sorted(map(str, ops & FUSED_OPS))}"
    else:
        assert op in ops, f"forced {backend}, the graph has no {op}: {sorted(map(str, ops))}"
    torch._dynamo.reset()
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        report = dynashard.explain(model, ids, world_size=world, verify=True, options={"min_shard_numel": 0},
                                   use_cache=False)  # raises if any rank is beyond explain's own (loose) bar
    scales, top = _output_magnitudes(model, ids, [r.fqn for r in report.rows])
    checked = [(r.fqn, r.verify_err, scales.get(r.fqn, top)) for r in report.rows if r.verify_err is not None]
    assert len(checked) >= 5, str(report)  # q, k, v, o and the MLP at least: sharded, so compared
    worst = [(fqn, err, scale) for fqn, err, scale in checked if err > BF16_RTOL * scale]
    assert not worst, f"beyond {BF16_RTOL} x the layer's magnitude: {worst}\n{report}"
    for g in report.graphs:
        assert g.output_err <= BF16_RTOL * top, f"output error {g.output_err} for logits up to {top}\n{report}"
    whole = {r.fqn.rsplit(".", 1)[-1] for r in report.rows if r.style == "replicate"}
    gathers = {r.fqn.rsplit(".", 1)[-1]: r.collectives for r in report.rows
               if r.collectives not in ("-", "all_reduce")}
    assert (whole, gathers) == EXPECTED[arch][world], str(report)  # what CPU pins: nothing gathered more
    return report


@pytest.mark.parametrize("kernel,form", CASES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_hf_model_in_bf16_under_each_cuda_attention_kernel_is_verified(arch, kernel, form):
    check_hf_kernel(arch, kernel, form)


# --- Inductor on CUDA: Triton kernels for the sharded graph --------------------------------------


def check_hf_inductor(arch: str, kernel: str, form: str, device: str = DEVICE, dtype: torch.dtype = torch.bfloat16,
                      world: int = 2, compiler: str = "inductor") -> float:
    """One architecture under one SDPA kernel, rank 0's program at ``world`` on the fake group, compiled by
    ``compiler`` (Inductor: Triton) against the same program compiled with ``compiler="eager"``; together
    with check_hf_kernel (the eager program equals the unsharded model) this is Inductor's sharded model
    against the unsharded one. Compared: the last hidden state, and the logits where the plan gathers
    nothing (a gather on the fake group returns uninitialised memory: GPT-2's tied LM head). Returns the
    largest error as a fraction of the output's magnitude."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.hf_configs import EXPECTED

    backend = KERNELS[kernel][0]
    model = _hf_model(arch, form, device, dtype)
    ids = torch.randint(3, 96, (2, 7), device=device)
    gathered = bool(EXPECTED[arch][world][1])

    def run(c: str) -> list[torch.Tensor]:
        torch._dynamo.reset()
        fn = torch.compile(copy.deepcopy(model), backend=dynashard.backend(compiler=c, min_shard_numel=0))
        with torch.no_grad(), sdpa_kernel([getattr(SDPBackend, backend)]):
            try:
                out = fn(ids, use_cache=False, output_hidden_states=True)
            except Exception as e:  # noqa: BLE001 - only torch's own refusal is a skip
                if not any(refusal in _messages(e) for refusal in NO_KERNEL):
                    raise
                pytest.skip(f"SDPA {kernel} ({backend}) is unsupported here for this call: {_messages(e)[:500]}")
        return [out.hidden_states[-1].float()] + ([] if gathered else [out.logits.float()])

    want = _on_fake_group(lambda: run("eager"), world)
    got = _on_fake_group(lambda: run(compiler), world)
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        # see BF16_RTOL: Triton computes a fused region in float32 and rounds once, eager rounds per op
        rel = float((g - w).abs().max()) / max(float(w.abs().max()), 1e-6)
        assert rel <= BF16_RTOL, f"{compiler} against eager, rank 0's program: error {rel:.2e} of the magnitude"
        worst = max(worst, rel)
    return worst


@pytest.mark.parametrize("kernel,form", INDUCTOR_CASES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_hf_model_in_bf16_under_each_cuda_attention_kernel_under_inductor(arch, kernel, form):
    check_hf_inductor(arch, kernel, form)


def _on_fake_group(fn, world: int = 2):
    """``fn()`` with a fake default group of ``world`` (this process is rank 0): its collectives move no
    data, so an all_reduce leaves rank 0's partial sum as it is, and a gather returns uninitialised memory."""
    torch._dynamo.reset()
    private.init_fake_process_group(world, 0)
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def _no_graph_caches():
    """A hit in the FX graph or AOTAutograd cache skips the compile whose code and logs a test reads."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def test_inductor_emits_triton_kernels_for_the_sharded_graph_and_matches_it_run_eagerly():
    """A Llama block (GQA, RoPE, SDPA, SwiGLU) at world 2 on the fake group, compiled by Inductor on CUDA:
    the code is Triton kernels around this rank's matmuls and two all_reduces (attention, MLP), and computes
    what the same sharded graph computes eagerly (rank 0's program: the fake all_reduce adds nothing)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    block = models.LlamaBlock(hidden=64, n_heads=4, n_kv_heads=2, ffn=176).to(DEVICE).eval()
    x = torch.randn(2, 8, 64, device=DEVICE)
    cos, sin = (t.to(DEVICE) for t in models.rope_tables(16, 8))
    options = {"min_shard_numel": 0}
    report = dynashard.explain(block, x, cos, sin, world_size=2, options=options)
    # (a gather's output on the fake group is uninitialised memory: the comparison needs a plan without one)
    assert {r.collectives for r in report.rows} == {"all_reduce", "-"}, str(report)
    assert not [r for r in report.rows if r.style == "replicate"], str(report)

    def compiled(compiler: str):
        fn = torch.compile(copy.deepcopy(block), backend=dynashard.backend(compiler=compiler, **options))
        with torch.no_grad(), _no_graph_caches():
            return run_and_get_code(fn, x, cos, sin) if compiler == "inductor" else (fn(x, cos, sin), [])

    eager, _ = _on_fake_group(lambda: compiled("eager"))
    out, code = _on_fake_group(lambda: compiled("inductor"))
    source = "\n".join(code)
    assert "@triton.jit" in source, source
    assert len(re.findall(r"torch\.ops\._c10d_functional\.all_reduce_?\.default\(", source)) == 2, source
    # fp32: matmuls and SDPA are the same CUDA kernels in both runs; Triton fuses the norms, RoPE and
    # SwiGLU and sums in its own order (about 1e-6 here). 1e-4 of O(1) values leaves room for that only.
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


# --- mode="reduce-overhead": CUDA graphs replay with the shards read in place --------------------


def _replays(fn, xs) -> tuple[list[torch.Tensor], dict[str, int]]:
    """Outputs of ``fn`` over ``xs`` (the first warms up, the second records, the rest replay) and the
    change in Inductor's CUDA-graph counters meanwhile."""
    from torch._dynamo.utils import counters

    keys = ("cudagraph_skips", "cudagraph_recorded_non_static_inputs")
    before = {k: counters["inductor"][k] for k in keys}  # (looked up each time: Dynamo may replace the dicts)
    outs = []
    with torch.no_grad():
        for x in xs:
            torch.compiler.cudagraph_mark_step_begin()
            outs.append(fn(x).clone())  # a replay's output lives in the graph's memory until the next replay
    return outs, {k: counters["inductor"][k] - before[k] for k in keys}


def test_reduce_overhead_replays_the_sharded_graph_with_the_shards_read_in_place():
    """MLP 256 -> 512 at world 2 on the fake group under mode="reduce-overhead": Inductor records a CUDA
    graph (no skip) whose only copied input is x, as for the model compiled plainly (its parameters are
    static inputs); the shards' addresses are the recorded graph's static inputs, and every replay equals
    the sharded graph run eagerly on the same input. tests/test_compile_settings.py checks on CPU the static
    input slots Inductor is given; what a replay copies needs a GPU."""
    from torch._inductor import cudagraph_trees

    from dynashard.weights.store import STORE

    torch.manual_seed(0)
    plain = models.MLP(256, 512).to(DEVICE).eval()
    model, twin = copy.deepcopy(plain), copy.deepcopy(plain)
    xs = [torch.randn(4, 256, device=DEVICE) for _ in range(4)]
    # a skip raises with its reason (a CPU op in the graph, an input mutation, ...) instead of only counting
    with _no_graph_caches(), torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        _, plain_counts = _replays(torch.compile(plain, mode="reduce-overhead"), xs)

        def sharded():
            eager_fn = torch.compile(twin, backend=dynashard.backend(compiler="eager", min_shard_numel=0))
            ours_fn = torch.compile(model, backend=dynashard.backend(mode="reduce-overhead", min_shard_numel=0))
            with torch.no_grad():
                want = [eager_fn(x) for x in xs]
            return want, *_replays(ours_fn, xs)

        want, got, counts = _on_fake_group(sharded)
    assert plain_counts == {"cudagraph_skips": 0, "cudagraph_recorded_non_static_inputs": 1}, plain_counts
    assert counts == plain_counts, (counts, plain_counts)  # recorded once, copying x alone
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)  # the same kernels, replayed
    shards = [STORE.shard_of(p) for p in (model.up.weight, model.up.bias, model.down.weight)]  # (down's bias: whole)
    assert all(s is not None for s in shards) and model.up.weight.untyped_storage().nbytes() == 0
    # NOTE: torch 2.13's tree manager (per thread and device) holds each recorded graph's static inputs'
    # addresses in its node; a graph recorded after another in one step is that node's child (walked as
    # CUDAGraphTreeManager.shutdown walks them)
    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    nodes, static = [n for roots in manager.roots.values() for n in roots], set()
    while nodes:
        node = nodes.pop()
        nodes.extend(c for children in node.children.values() for c in children)
        static.update(p for p in node.static_input_data_ptrs if p)
    held = {s.data_ptr() for s in shards} | {model.down.bias.data_ptr()}
    assert held <= static, f"read by the CUDA graph from a copy: {len(held - static)} of the shards and whole bias"


def test_reduce_overhead_keeps_a_grown_cache_apart_from_the_next_replay():
    """HF's DynamicCache form (a cache grown by cat, returned held by heads: CachedDecoder "cat") under
    mode="reduce-overhead": a CUDA graph's output lives in memory its next replay reuses, so the held
    part is copied when handed back (program.py). The logits of a prefill and 6 decode steps, and each
    layer's held cache after them, equal the same model's compiled with compiler="eager" (fake group,
    both: an all_reduce keeps rank 0's term; no gather in these graphs). 1e-4: Inductor's float32
    kernels against eager aten, the same sums in another order."""
    from dynashard.weights.store import STORE

    torch.manual_seed(0)
    model = models.CachedDecoder(form="cat").to(DEVICE).eval()
    twin = copy.deepcopy(model)
    steps = [(torch.randint(0, 96, (2, 5), device=DEVICE), torch.arange(5, device=DEVICE))]
    steps += [(torch.randint(0, 96, (2, 1), device=DEVICE), torch.tensor([5 + i], device=DEVICE)) for i in range(6)]

    def run(m, backend):
        torch._dynamo.reset()
        fast, logits = torch.compile(m, backend=backend), []
        with torch.no_grad():
            for ids, pos in steps:
                torch.compiler.cudagraph_mark_step_begin()
                logits.append(fast(ids, pos).clone())
        return logits + [STORE.shard_of(layer.kv_cache.k_cache).clone() for layer in m.layers]

    want, got = _on_fake_group(lambda: (run(twin, dynashard.backend(compiler="eager", min_shard_numel=0)),
                                        run(model, dynashard.backend(mode="reduce-overhead", min_shard_numel=0))))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


# --- NCCL ---------------------------------------------------------------------------------------


def _python(*args: str, torchrun: int = 0) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun)] if torchrun else []
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *launcher, *args], capture_output=True, text=True,
                          timeout=SUBPROCESS_DEADLINE_S, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done


def test_host_messages_use_a_cpu_companion_of_a_one_rank_nccl_group():
    """In a fresh process (the NCCL group must not outlive the test): dynashard.comm.protocol.host_group of an
    NCCL group is a cached gloo group over its ranks, of a gloo group the group itself; a CPU all_reduce
    travels on it; a compiled MLP on the GPU equals eager. (At world 1 dynashard compiles unsharded:
    dynamo_backend.py; the per-call handshake on NCCL is the two-GPU test's.)"""
    done = _python("-m", "tests.cuda_ranks", "host_group")
    assert "host_group: OK" in done.stdout, done.stdout


@two_gpus
def test_two_nccl_ranks_compute_the_unsharded_models():
    """torchrun on 2 GPUs, NCCL: an MLP, a Llama decoder (bf16) and bench_decode's cached decoder (greedy
    tokens) against the unsharded model on every rank, with about half the weights held per rank."""
    done = _python("-m", "tests.cuda_ranks", "two_ranks", torchrun=2)
    assert all(f"rank {r}: OK" in done.stdout for r in range(2)), done.stdout


@two_gpus
def test_demo_on_two_gpus():
    """The README's demo as shipped, on 2 GPUs (it picks NCCL when CUDA is available): both ranks report
    a difference to the unsharded model below 1e-3, each rank on its own GPU (LOCAL_RANK)."""
    done = _python("-m", "dynashard.demo", "--hidden", "256", "--ffn", "1024", "--depth", "1", torchrun=2)
    diffs = [float(line.split("= ")[1].split()[0]) for line in done.stdout.splitlines() if "max |sharded" in line]
    assert len(diffs) == 2 and max(diffs) < 1e-3, done.stdout
