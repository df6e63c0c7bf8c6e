"""Greedy decoding of a Llama-style model with its KV caches held sharded: prefill and decode, side by side.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_decode [--layers 8 --dim 2048 --heads 16
        --kv-heads 8 --ffn 5632 --vocab 32000] [--prompt 128 --new-tokens 64] [--systems "dynashard,bound"]
        [--reps 3 --warmup 1] [--smoke] [--out PATH]

Model: examples/generate.py's gpt-fast-style Llama (fused ``wqkv``, RoPE with a
half rotation, ``repeat_interleave`` for GQA, SDPA over the whole cache with a mask row per
position, SwiGLU ``w2(silu(w1(x)) * w3(x))``, RMSNorm, untied LM head), with a KV cache per layer
held in module buffers ``[1, kv_heads, max_len, head_dim]`` written by slice assignment
(``k_cache[:, :, input_pos] = k``), max_len = prompt + new tokens. Defaults: 8 layers, hidden 2048,
16 heads / 8 KV heads (head_dim 128), ffn 5632, vocab 32000: 1.89 GiB of float32 weights (decode reads
all but the embedding per token: memory-bound). Weights from one seed on every rank, batch 1, a
random prompt of 128 tokens, 64 new tokens (the prefill's token, then 63 decode steps), greedy.

Systems (all hold the same weights; ``--systems`` picks; default: all but "unsharded eager" and
"dynashard unchecked"; --smoke: also not "dtensor compiled" and "hf dynashard static"):
  unsharded eager     the model, every rank decoding all of it (also the token reference, always run)
  unsharded inductor  torch.compile(model): the single-process baseline each rank runs alone
  dynashard           torch.compile(copy, backend=dynashard.backend(compiler=...)), plan "auto", no
                      edits: prefill one graph, decode another; weights and KV caches cut by heads
                      on the first call (the full ones freed)
  dynashard unchecked the same with check_inputs="off": without the per-call agreement (one blocking
                      all_reduce of a few int64 before every call of a graph)
  bound               hand-written gpt-fast-style TP, compiled with Inductor: a model built with
                      heads/N query heads and kv_heads/N KV heads, its rows of wqkv (this rank's q,
                      k and v heads), w1 and w3, its columns of wo and w2, a local-heads KV cache,
                      one funcol all_reduce after wo and one after w2 per layer; vocabulary split
                      like dynashard's plan: the embedding vocab-parallel (masked lookup, one
                      all_reduce), the LM head colwise with its logits all-gathered
  dtensor eager       parallelize_module: wqkv / w1 / w3 ColwiseParallel, wo / w2 RowwiseParallel,
                      the embedding RowwiseParallel(input_layouts=Replicate()), the LM head
                      ColwiseParallel(output_layouts=Replicate()); with the edits it needs: the
                      heads and KV heads attributes divided by N, a local-heads KV cache, and
                      wqkv's rows permuted to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] so that
                      ColwiseParallel's even chunks are each rank's heads
  dtensor compiled    the same module under torch.compile (Inductor)
  hf tp               transformers' own TP: LlamaForCausalLM.from_pretrained(DIR, distributed_config=
                      DistributedConfig(tp_size=N, tp_plan="auto")) (5.23's spelling of tp_plan="auto") of a
                      checkpoint holding the same weights (wqkv split into q/k/v_proj, written by
                      rank 0 to a temporary directory), greedy model.generate(...,
                      cache_implementation="static") run eagerly (generate compiles its decode step
                      on CPU only with CompileConfig._compile_all_devices); needs `accelerate`
  hf dynashard static the same checkpoint loaded whole by LlamaForCausalLM.from_pretrained, then README
                      Serving's recipe (a): model.forward = torch.compile(model.forward, backend=dynashard),
                      greedy model.generate(..., cache_implementation="static"): HF's StaticCache, held
                      sharded by heads (allocated at the local size inside the prefill graph)
  hf dynashard dynamic  the same with HF's default DynamicCache (torch.cat growth, returned from each graph
                      and passed back): held by heads like the static cache (each graph returns this
                      rank's heads, the next reads them back); this row against the static one is what
                      the growing cache costs

Tokens, before timing: every system's greedy tokens are compared with the unsharded eager model's
(HF TP's too: the checkpoint holds the same weights). A system whose tokens differ is not timed: its
row reads "WRONG TOKENS" and the run exits 1 after writing its record. A system that fails to build
or run is recorded with its error; the run exits 1 only if unsharded, dynashard or the bound fails.

Timing: every system's first run (compiles, Inductor cache cold) is the token check; then
``--warmup`` untimed and ``--reps`` timed rounds, one whole generation of every system per round
(interleaved, a barrier before each). Prefill ms: the first call (prompt in, first token out),
median over the reps; decode ms/token: the median over every decode step of every rep, each step
the model call plus its argmax (hf systems: the time between successive calls of a LogitsProcessor, so
generate's own per-token work is included, and its prefill includes generate's set-up). The
slowest rank's medians are reported.

Bytes per rank (after the first run): weights (every parameter: a dynashard shard held in its
store, a DTensor's local tensor, the full tensor if its storage was not freed) and KV cache (the
cache buffers, or the cache that an hf system's generate returns: a dynashard shard, else the
tensor), largest rank.

Graphs: how many graphs Dynamo compiled during the system's build and first run (dynashard: one for
the prefill, one for the decode steps); the record also holds how many were compiled after the
first runs, while timing and counting (0 expected: no recompiles).

Collectives per decode step: ``c10d::`` op events in a torch.profiler session around one decode step
after the timed rounds (hf systems: between the first and second LogitsProcessor calls of a generate),
as bench_train.py counts them; "via dist": not issued by a funcol op (dynashard's per-call input
check, HF's in-place dist.all_reduce).

Targets: dynashard's decode at most 1.10x the bound's, at least 1.6x faster than unsharded
inductor, at most 0.8x of hf tp's and of dtensor eager's.

The machine's ceiling (after counting; --no-ceiling skips it): unsharded inductor decoding on rank 0
alone while the other ranks wait (the table's unsharded row runs on every rank at once), and GEMVs
over the weights' bytes, on rank 0 alone (all the bytes) and on every rank at once (1/N each): their
ratio is the most N-way TP can speed weight reads up on this machine's shared memory bus.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from benchmarks._common import OUT_HELP, Progress, gather, init, mib, out_path, record, time_interleaved, write_json
from benchmarks.suite import cold_cache, source_version, warm_up_toolchain
from benchmarks.train_metrics import _quiet_stderr, tally_collectives

SYSTEMS = ("unsharded eager", "unsharded inductor", "dynashard", "dynashard unchecked", "bound", "dtensor eager",
           "dtensor compiled", "hf tp", "hf dynashard static", "hf dynashard dynamic")
# the HF LlamaForCausalLM systems: loaded from a checkpoint of the same weights, decoded by model.generate
HF_SYSTEMS = ("hf tp", "hf dynashard static", "hf dynashard dynamic")
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in ("unsharded eager", "dynashard unchecked"))
# --smoke's default: each build path once (dtensor compiled is dtensor eager's module compiled; hf dynashard
# static is the dynamic row's build with hf tp's cache)
SMOKE_SYSTEMS = tuple(s for s in DEFAULT_SYSTEMS if s not in ("dtensor compiled", "hf dynashard static"))
# a failure of one of these fails the run (DTensor's and HF's are recorded, the run goes on)
OURS = ("unsharded eager", "unsharded inductor", "dynashard", "dynashard unchecked", "bound")
# (target name, system compared with, limit): dynashard's decode / that system's decode
TARGETS = (("<= 1.10x the bound", "bound", 1.10), ("<= 0.8x hf tp", "hf tp", 0.8),
           ("<= 0.8x dtensor eager", "dtensor eager", 0.8))
SPEEDUP_TARGET = 1.6  # unsharded inductor's decode / dynashard's


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int = 8
    dim: int = 2048
    heads: int = 16
    kv_heads: int = 8
    ffn: int = 5632
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


SMOKE = Sizes(layers=2, dim=64, heads=4, kv_heads=2, ffn=128, vocab=256)


# --- the model (examples/generate.py's, with the FFN width and the bound's TP as options) ---------


class KVCache(nn.Module):
    def __init__(self, max_len: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, kv_heads, max_len, head_dim))
        self.register_buffer("v_cache", torch.zeros(1, kv_heads, max_len, head_dim))

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Attention(nn.Module):
    """``heads`` / ``kv_heads``: the heads this module computes (all of them, or a rank's)."""

    def __init__(self, s: Sizes, heads: int, kv_heads: int, max_len: int, group: str | None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.group = heads, kv_heads, s.head_dim, group
        self.wqkv = nn.Linear(s.dim, (heads + 2 * kv_heads) * s.head_dim, bias=False)
        self.wo = nn.Linear(heads * s.head_dim, s.dim, bias=False)
        self.kv_cache = KVCache(max_len, kv_heads, s.head_dim)

    def forward(self, x, cos, sin, mask, input_pos):
        b, t, _ = x.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.heads * self.head_dim, kv, kv], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        c, s = cos[input_pos], sin[input_pos]
        q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.wo(y.transpose(1, 2).reshape(b, t, -1))
        return y if self.group is None else funcol.all_reduce(y, "sum", self.group)


class Block(nn.Module):
    def __init__(self, s: Sizes, world: int, max_len: int, group: str | None) -> None:
        super().__init__()
        self.group = group
        self.attention = Attention(s, s.heads // world, s.kv_heads // world, max_len, group)
        ffn = s.ffn // world
        self.w1, self.w3 = nn.Linear(s.dim, ffn, bias=False), nn.Linear(s.dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, s.dim, bias=False)
        self.attention_norm, self.ffn_norm = RMSNorm(s.dim), RMSNorm(s.dim)

    def forward(self, x, cos, sin, mask, input_pos):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        h = self.ffn_norm(x)
        y = self.w2(F.silu(self.w1(h)) * self.w3(h))
        return x + (y if self.group is None else funcol.all_reduce(y, "sum", self.group))


class Llama(nn.Module):
    """The whole model (``world=1``), or the bound's rank ``rank`` of ``world``: 1/world of the heads,
    KV heads, FFN and vocabulary, with the collectives written in (``group``: a process group name)."""

    def __init__(self, s: Sizes, max_len: int, world: int = 1, rank: int = 0, group: str | None = None) -> None:
        super().__init__()
        self.world, self.group = world, group
        self.vocab_start = rank * (s.vocab // world)
        self.tok_embeddings = nn.Embedding(s.vocab // world, s.dim)
        self.layers = nn.ModuleList(Block(s, world, max_len, group) for _ in range(s.layers))
        self.norm = RMSNorm(s.dim)
        self.output = nn.Linear(s.dim, s.vocab // world, bias=False)
        hd = s.head_dim
        freqs = torch.outer(torch.arange(max_len).float(), 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("cos", torch.cat((freqs, freqs), -1).cos())
        self.register_buffer("sin", torch.cat((freqs, freqs), -1).sin())
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril())

    def forward(self, ids, input_pos):
        if self.group is None:
            x = self.tok_embeddings(ids)
        else:  # Megatron's vocab-parallel embedding: this rank's rows, zeros elsewhere, one all_reduce
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.tok_embeddings.num_embeddings)
            x = self.tok_embeddings(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
            x = funcol.all_reduce(x, "sum", self.group)
        mask = self.causal[None, None, input_pos]
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, mask, input_pos)
        logits = self.output(self.norm(x))
        if self.group is None:
            return logits
        g = funcol.all_gather_tensor(logits.contiguous(), 0, self.group)  # [world * b, t, vocab/world]
        return g.view(self.world, *logits.shape).movedim(0, -2).reshape(*logits.shape[:-1], -1)


def qkv_rows(s: Sizes, world: int, rank: int) -> torch.Tensor:
    """The rows of the whole ``wqkv`` that rank ``rank`` computes: its q heads, then its k and v heads
    (GQA: query head i reads KV head i // (heads / kv_heads), so rank r's q heads read its KV heads)."""
    hd, q, kv = s.head_dim, s.heads // world, s.kv_heads // world
    q0, k0, v0 = rank * q * hd, s.heads * hd + rank * kv * hd, (s.heads + s.kv_heads) * hd + rank * kv * hd
    return torch.cat([torch.arange(q0, q0 + q * hd), torch.arange(k0, k0 + kv * hd), torch.arange(v0, v0 + kv * hd)])


def shard_by_hand(base: Llama, s: Sizes, max_len: int, world: int, rank: int) -> Llama:
    """The bound: a model built at the local sizes, holding copies of this rank's slices of ``base``."""
    model = Llama(s, max_len, world, rank, dist.group.WORLD.group_name).eval()
    rows = functools.partial(torch.Tensor.chunk, chunks=world, dim=0)
    cols = functools.partial(torch.Tensor.chunk, chunks=world, dim=1)
    with torch.no_grad():
        model.tok_embeddings.weight.copy_(rows(base.tok_embeddings.weight)[rank])
        model.output.weight.copy_(rows(base.output.weight)[rank])
        model.norm.weight.copy_(base.norm.weight)
        for mine, whole in zip(model.layers, base.layers, strict=True):
            mine.attention.wqkv.weight.copy_(whole.attention.wqkv.weight[qkv_rows(s, world, rank)])
            mine.attention.wo.weight.copy_(cols(whole.attention.wo.weight)[rank])
            mine.w1.weight.copy_(rows(whole.w1.weight)[rank])
            mine.w3.weight.copy_(rows(whole.w3.weight)[rank])
            mine.w2.weight.copy_(cols(whole.w2.weight)[rank])
            mine.attention_norm.weight.copy_(whole.attention_norm.weight)
            mine.ffn_norm.weight.copy_(whole.ffn_norm.weight)
    return model


def dtensor_parallelize(base: Llama, s: Sizes, max_len: int, world: int) -> Llama:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = copy.deepcopy(base)
    order = torch.cat([qkv_rows(s, world, r) for r in range(world)])
    for layer in model.layers:
        att = layer.attention
        att.wqkv.weight = nn.Parameter(att.wqkv.weight.detach()[order], requires_grad=False)
        att.heads //= world  # the head-count edit
        att.kv_heads //= world
        att.kv_cache = KVCache(max_len, att.kv_heads, att.head_dim)  # a local-heads cache
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "layers.*.attention.wqkv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.w1": ColwiseParallel(),
        "layers.*.w3": ColwiseParallel(),
        "layers.*.w2": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    return parallelize_module(model, init_device_mesh("cpu", (world,)), plan)


# --- HF's own TP ----------------------------------------------------------------------------------


def write_hf_checkpoint(base: Llama, s: Sizes, max_len: int, path: str) -> None:
    """``base``'s weights as an HF LlamaForCausalLM directory (safetensors + config)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    hd = s.head_dim
    sd = {"model.embed_tokens.weight": base.tok_embeddings.weight, "model.norm.weight": base.norm.weight,
          "lm_head.weight": base.output.weight}
    for i, layer in enumerate(base.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.attention.wqkv.weight.split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd])
        sd.update({
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.attention.wo.weight,
            p + "mlp.gate_proj.weight": layer.w1.weight, p + "mlp.up_proj.weight": layer.w3.weight,
            p + "mlp.down_proj.weight": layer.w2.weight,
            p + "input_layernorm.weight": layer.attention_norm.weight,
            p + "post_attention_layernorm.weight": layer.ffn_norm.weight,
        })
    os.makedirs(path, exist_ok=True)
    save_file({k: t.detach().contiguous().clone() for k, t in sd.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.dim, intermediate_size=s.ffn, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=hd,
        max_position_embeddings=max(2048, max_len), rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None, eos_token_id=None, pad_token_id=None, dtype="float32",
    ).save_pretrained(path)


def _hf_processor(prof: Any = None) -> Any:
    """A LogitsProcessor that notes when each step's logits arrive (and, with ``prof``, profiles the
    first decode step: from the prefill's logits to the next step's)."""
    from transformers import LogitsProcessor

    class Steps(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            if prof is not None and len(self.times) == 1:
                prof.start()
            elif prof is not None and len(self.times) == 2:
                prof.stop()
            return scores

    return Steps()


def hf_generate(model: Any, prompt: torch.Tensor, new_tokens: int, prof: Any = None,
                cache: str | None = "static") -> tuple[Any, float, list[float]]:
    """Greedy ``model.generate`` with ``cache_implementation=cache`` (None: HF's default DynamicCache);
    the generation, the seconds to the prefill's logits and every decode step's seconds."""
    from transformers import LogitsProcessorList

    steps = _hf_processor(prof)
    start = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False,
                         cache_implementation=cache, logits_processor=LogitsProcessorList([steps]),
                         return_dict_in_generate=True, pad_token_id=0)
    t = steps.times
    return out, t[0] - start, [b - a for a, b in zip(t, t[1:])]


# --- running and measuring a system ---------------------------------------------------------------


@dataclasses.dataclass
class Run:
    tokens: torch.Tensor  # [1, new_tokens]
    prefill_s: float
    steps_s: list[float]  # every decode step's seconds


@dataclasses.dataclass
class System:
    run: Callable[[], Run]  # one whole greedy generation
    step: Callable[[Any], None]  # one decode step under a profiler (``prof``: hf systems start and stop it inside)
    model: nn.Module
    cache_bytes: Callable[[], int] | None = None  # default: the model's kv_cache buffers


@torch.no_grad()
def decode(fn: Callable[..., torch.Tensor], prompt: torch.Tensor, new_tokens: int) -> Run:
    t = prompt.shape[1]
    start = time.perf_counter()
    token = fn(prompt, torch.arange(t))[:, -1].argmax(-1, keepdim=True)
    prefill = time.perf_counter() - start
    out, steps = [token], []
    for pos in range(t, t + new_tokens - 1):
        start = time.perf_counter()
        token = fn(token, torch.tensor([pos]))[:, -1].argmax(-1, keepdim=True)
        steps.append(time.perf_counter() - start)
        out.append(token)
    return Run(torch.cat(out, 1), prefill, steps)


def held(t: torch.Tensor) -> int:
    """Bytes of ``t`` this rank holds: a DTensor's local tensor; a weight or cache dynashard cut, its
    shard (plus the full tensor if its storage could not be freed); anything else its own bytes."""
    from torch.distributed.tensor import DTensor

    from dynashard.weights.store import STORE

    if isinstance(t, DTensor):
        return t.to_local().nbytes
    shard = STORE.shard_of(t)
    return (0 if shard is None else shard.nbytes) + (t.nbytes if t.untyped_storage().nbytes() else 0)


def build(system: str, base: Llama, s: Sizes, prompt: torch.Tensor, args: argparse.Namespace,
          ctx: dict[str, Any]) -> System:
    world, rank, compiler, new = ctx["world"], ctx["rank"], args.compiler, args.new_tokens
    max_len = prompt.shape[1] + new
    if system in HF_SYSTEMS:
        from transformers import LlamaForCausalLM
        from transformers.distributed import DistributedConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        cache = None if system == "hf dynashard dynamic" else "static"
        if system == "hf tp":
            # (tp_plan="auto" as a from_pretrained argument is deprecated in 5.23, this is its replacement)
            model = LlamaForCausalLM.from_pretrained(
                ctx["hf_dir"], dtype=torch.float32, distributed_config=DistributedConfig(tp_size=world, tp_plan="auto")
            ).eval()
        else:
            import dynashard

            model = LlamaForCausalLM.from_pretrained(ctx["hf_dir"], dtype=torch.float32).eval()
            model.forward = torch.compile(model.forward, backend=dynashard.backend(
                compiler=compiler, min_shard_numel=args.min_shard_numel))
        last: dict[str, Any] = {}

        def run() -> Run:
            out, prefill, steps = hf_generate(model, prompt, new, cache=cache)
            last["cache"] = out.past_key_values
            return Run(out.sequences[:, prompt.shape[1]:], prefill, steps)

        def step(prof: Any) -> None:
            hf_generate(model, prompt, 2, prof, cache=cache)

        def cache_bytes() -> int:
            return sum(held(t) for layer in last["cache"].layers for t in (layer.keys, layer.values))

        return System(run, step, model, cache_bytes)
    if system == "unsharded eager":
        model, fn = base, base
    elif system == "unsharded inductor":
        model = base
        fn = torch.compile(model, backend=compiler)
    elif system.startswith("dynashard"):
        import dynashard

        options = {"compiler": compiler, "min_shard_numel": args.min_shard_numel}
        if system == "dynashard unchecked":
            options["check_inputs"] = "off"
        model = copy.deepcopy(base)
        fn = torch.compile(model, backend=dynashard.backend(**options))
    elif system == "bound":
        model = shard_by_hand(base, s, max_len, world, rank)
        fn = torch.compile(model, backend=compiler)
    elif system.startswith("dtensor"):  # eager and compiled share one parallelized module
        if "dtensor" not in ctx:
            ctx["dtensor"] = dtensor_parallelize(base, s, max_len, world)
        model = ctx["dtensor"]
        fn = model if system == "dtensor eager" else torch.compile(model, backend=compiler)
    else:
        raise ValueError(system)

    def step(prof: Any) -> None:  # (a token as decode passes it: a fresh [1, 1], not a view, which would recompile)
        with torch.no_grad():
            fn(torch.tensor([[int(prompt[0, -1])]]), torch.tensor([prompt.shape[1]]))[:, -1].argmax(-1)

    return System(functools.partial(decode, fn, prompt, new), step, model)


def read_s(w: torch.Tensor, x: torch.Tensor, passes: int) -> float:
    """Seconds for ``passes`` GEMVs ``w @ x``: one read of ``w``'s bytes each, decode's pattern at batch 1."""
    start = time.perf_counter()
    for _ in range(passes):
        torch.mv(w, x)
    return time.perf_counter() - start


def alone_on_rank0(fn: Callable[[], Any], reps: int, rank: int) -> tuple[list[Any], float]:
    """``reps`` results of ``fn`` on rank 0 while the other ranks wait in a barrier, and the CPU seconds a
    waiting rank spent meanwhile (about 0 if gloo's barrier sleeps, as the "alone" reading assumes)."""
    dist.barrier()
    cpu = time.process_time()
    out = [fn() for _ in range(reps)] if rank == 0 else []
    dist.barrier()
    return out, time.process_time() - cpu


def ceiling(weight_bytes: int, s: Sizes, world: int, rank: int, reps: int) -> dict[str, Any]:
    """What this machine lets any N-way TP reach on decode's weight reads (collectives not counted).

    A float32 [rows, dim] matrix holding 1/N of the weights' bytes per rank, read by GEMVs: rank 0 alone
    reads it N times (the unsharded model's bytes per token) while the others wait; then every rank at
    once reads its own once (a TP rank's bytes per token). alone / together is the speedup the shared
    memory bus allows; 2.0 at world 2 would mean a bus per rank, as on GPUs. Also the bound's
    collectives of one decode step on their own (2 * layers + 1 all_reduces of [1, 1, dim], one all_gather of the
    logits' [1, 1, vocab / N]; funcol, each waited as the compiled graphs do), every rank at once."""
    w, x = torch.randn(weight_bytes // 4 // s.dim // world, s.dim), torch.randn(s.dim)
    read_s(w, x, 1)  # the pages touched
    alone, waiter_cpu = alone_on_rank0(lambda: read_s(w, x, world), reps, rank)
    together = []
    for _ in range(reps):
        dist.barrier()
        together.append(read_s(w, x, 1))
    group = dist.group.WORLD.group_name
    hidden, logits = torch.randn(1, 1, s.dim), torch.randn(1, 1, s.vocab // world)
    steps = []
    for _ in range(10 * reps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(2 * s.layers + 1):
            funcol.wait_tensor(funcol.all_reduce(hidden, "sum", group))
        funcol.wait_tensor(funcol.all_gather_tensor(logits, 0, group))
        steps.append(time.perf_counter() - start)
    mine = gather({"alone": alone, "together": statistics.median(together),
                   "waiter_cpu_s": waiter_cpu, "collectives": statistics.median(steps)})
    t_alone = statistics.median(mine[0]["alone"])
    t_together = max(m["together"] for m in mine)
    nbytes = w.nbytes * world
    return {"bytes": nbytes, "alone_s": t_alone, "together_s": t_together,
            "alone_gbps": nbytes / t_alone / 1e9, "together_gbps": nbytes / t_together / 1e9,
            "speedup": t_alone / t_together,
            "waiter_cpu_s": max((m["waiter_cpu_s"] for m in mine[1:]), default=0.0),
            "alone_wall_s": sum(mine[0]["alone"]), "collectives_ms": 1e3 * max(m["collectives"] for m in mine),
            "collectives": f"{2 * s.layers + 1} all_reduce of [1, 1, {s.dim}], "
                           f"1 all_gather of [1, 1, {s.vocab // world}]"}


def decode_collectives(sys_: System, hf: bool) -> dict[str, Any]:
    """The ``c10d::`` ops of one decode step (see the module docstring), as bench_train counts them."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    with _quiet_stderr():
        if hf:
            sys_.step(prof)
        else:
            with prof:
                sys_.step(prof)
    return tally_collectives(prof)


# --- the run --------------------------------------------------------------------------------------


def _graphs() -> int:
    """Graphs Dynamo has compiled in this process (a frame compiled, or compiled again)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _first_mismatch(got: torch.Tensor, want: torch.Tensor) -> int | None:
    if got.shape != want.shape:
        return 0
    diff = (got != want).flatten().nonzero()
    return None if diff.numel() == 0 else int(diff[0])


def measure(args: argparse.Namespace, s: Sizes, ctx: dict[str, Any], bar: Progress) -> tuple[list[dict], dict]:
    rank = ctx["rank"]
    torch.manual_seed(0)  # the same weights and prompt on every rank
    base = Llama(s, args.prompt + args.new_tokens).eval()
    prompt = torch.randint(0, s.vocab, (1, args.prompt))
    weights = sum(p.nbytes for p in base.parameters())
    cache = sum(b.nbytes for n, b in base.named_buffers() if "kv_cache" in n)
    info = {"weight_bytes": weights, "kv_cache_bytes": cache}
    if rank == 0:
        print(f"model: {s}, {weights / 2**30:.3f} GiB of float32 weights ({mib(weights)} MiB), KV caches "
              f"{mib(cache)} MiB (max_len {args.prompt + args.new_tokens}); prompt {args.prompt}, "
              f"{args.new_tokens} new tokens", flush=True)
    bar.show("unsharded eager: the reference tokens")
    ref = decode(base, prompt, args.new_tokens).tokens
    bar.step()
    info["reference_tokens"] = ref.tolist()
    if set(HF_SYSTEMS) & set(args.systems):
        path = tempfile.mkdtemp(prefix="bench_decode_hf_") if rank == 0 else None
        ctx["hf_dir"] = gather(path)[0]
        if rank == 0:
            write_hf_checkpoint(base, s, args.prompt + args.new_tokens, ctx["hf_dir"])
        dist.barrier()
    systems: dict[str, System] = {}
    mine: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    wrong: dict[str, dict[str, Any]] = {}
    load = [os.getloadavg()[0]]
    for name in args.systems:
        bar.show(f"building {name} and checking its tokens")
        cold_cache(os.path.join(ctx["cache_root"], name.replace(" ", "-")))
        error, got = None, None
        try:
            dist.barrier()
            t0, g0 = time.perf_counter(), _graphs()
            sys_ = build(name, base, s, prompt, args, ctx)
            first = sys_.run()
            got = {"first_run_s": time.perf_counter() - t0, "tokens": first.tokens.tolist(),
                   "first_mismatch": _first_mismatch(first.tokens, ref), "graphs": _graphs() - g0}
            params = list({id(p): p for p in sys_.model.parameters()}.values())
            got["weight_bytes"] = sum(held(p) for p in params)
            got["kv_cache_bytes"] = (sys_.cache_bytes() if sys_.cache_bytes else
                                     sum(held(b) for n, b in sys_.model.named_buffers() if "kv_cache" in n))
        except Exception as e:  # noqa: BLE001 - reported in the record (and the exit status for ours)
            error = f"{type(e).__name__}: {e}"
        errors = [e for e in gather(error) if e]
        per_rank = gather(got)
        if errors:
            failed[name] = errors[0][:2000]
        elif any(g["first_mismatch"] is not None for g in per_rank):
            wrong[name] = {"per_rank": per_rank}
        else:
            systems[name], mine[name] = sys_, got
        sys_ = None
        bar.step()
    runs: dict[str, list[Run]] = {n: [] for n in systems}
    calls = {n: (lambda n=n: runs[n].append(systems[n].run())) for n in systems}
    bar.show(f"timing {len(calls)} systems")
    load.append(os.getloadavg()[0])
    g0 = _graphs()
    time_interleaved(calls, args.warmup, args.reps, on_round=bar.step)
    load.append(os.getloadavg()[0])
    bar.show("counting collectives")
    for n, sys_ in systems.items():
        timed = runs[n][args.warmup:]
        mine[n].update(prefill_s=statistics.median(r.prefill_s for r in timed),
                       decode_s=statistics.median(t for r in timed for t in r.steps_s),
                       decode_mean_s=statistics.mean(t for r in timed for t in r.steps_s),
                       prefill_runs_s=[r.prefill_s for r in timed],
                       tokens_repeated=all(torch.equal(r.tokens, ref) for r in timed))
        mine[n]["collectives"] = decode_collectives(sys_, n in HF_SYSTEMS)
    info["graphs_after_first_runs"] = _graphs() - g0  # recompiles while timing or counting: expect 0
    if args.ceiling and "unsharded inductor" in systems:
        bar.show("unsharded inductor on rank 0 alone")
        alone, cpu = alone_on_rank0(systems["unsharded inductor"].run, args.reps, rank)
        mine_alone = {"waiter_cpu_s": cpu}
        if alone:  # rank 0
            mine_alone = {"decode_s": statistics.median(t for r in alone for t in r.steps_s),
                          "wall_s": sum(r.prefill_s + sum(r.steps_s) for r in alone),
                          "tokens_equal": all(torch.equal(r.tokens, ref) for r in alone)}
        got = gather(mine_alone)
        info["unsharded_alone"] = {"decode_ms": 1e3 * got[0]["decode_s"], "wall_s": got[0]["wall_s"],
                                   "tokens_equal": got[0]["tokens_equal"],
                                   "waiter_cpu_s": max((g["waiter_cpu_s"] for g in got[1:]), default=0.0)}
    systems.clear()
    if args.ceiling:
        bar.show("the machine's ceiling: GEMVs alone and together")
        info["ceiling"] = ceiling(info["weight_bytes"], s, ctx["world"], rank, max(args.reps, 5))
    results = []
    for n in args.systems:
        if n in failed:
            results.append({"system": n, "ok": False, "error": failed[n]})
            continue
        if n in wrong:
            pr = wrong[n]["per_rank"]
            results.append({"system": n, "ok": False, "wrong_tokens": True,
                            "first_mismatch": min(p["first_mismatch"] for p in pr if p["first_mismatch"] is not None),
                            "per_rank": pr})
            continue
        pr = gather({"rank": rank, **mine[n]})
        results.append({
            "system": n,
            "ok": all(p["tokens_repeated"] for p in pr),
            "prefill_ms": 1e3 * max(p["prefill_s"] for p in pr),
            "decode_ms": 1e3 * max(p["decode_s"] for p in pr),
            "decode_mean_ms": 1e3 * max(p["decode_mean_s"] for p in pr),
            "first_run_s": max(p["first_run_s"] for p in pr),
            "graphs": max(p["graphs"] for p in pr),
            "weight_bytes": max(p["weight_bytes"] for p in pr),
            "kv_cache_bytes": max(p["kv_cache_bytes"] for p in pr),
            "collectives": pr[0]["collectives"],
            "per_rank": pr,
        })
    info["loadavg"] = load  # rank 0's 1-minute load average: before building, before and after timing
    if "hf_dir" in ctx:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ctx["hf_dir"], ignore_errors=True)
    return results, info


# --- the report -----------------------------------------------------------------------------------


def _by(results: list[dict], name: str) -> dict | None:
    r = next((r for r in results if r["system"] == name), None)
    return r if r is not None and "decode_ms" in r else None


def table(results: list[dict], info: dict, world: int, args: argparse.Namespace) -> str:
    bound, whole = _by(results, "bound"), _by(results, "unsharded inductor")
    lines = [
        f"### Decode, world {world}: prompt {args.prompt}, {args.new_tokens} new tokens, greedy, batch 1 "
        "(slowest rank)",
        "",
        "| system | prefill ms | decode ms/token | decode vs bound | decode speedup vs unsharded | weights MiB/rank "
        "| KV cache MiB/rank | collectives per decode step | graphs | first run s |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['system']} | FAILED: {r['error'][:300]} |")
            continue
        if r.get("wrong_tokens"):
            lines.append(f"| {r['system']} | WRONG TOKENS (first differs at new token {r['first_mismatch']}): "
                         "not timed |")
            continue
        vs_bound = f"{r['decode_ms'] / bound['decode_ms']:.2f}" if bound else "n/a"
        speedup = f"{whole['decode_ms'] / r['decode_ms']:.2f}" if whole else "n/a"
        lines.append(
            f"| {r['system']} | {r['prefill_ms']:.1f} | {r['decode_ms']:.2f}{'' if r['ok'] else ' (tokens changed)'} "
            f"| {vs_bound} | {speedup} | {mib(r['weight_bytes'])} | {mib(r['kv_cache_bytes'])} "
            f"| {r['collectives']['text']} | {r['graphs']} | {r['first_run_s']:.1f} |"
        )
    lines.append(f"\nUnsharded: {mib(info['weight_bytes'])} MiB of weights, {mib(info['kv_cache_bytes'])} MiB of "
                 "KV cache per rank. Tokens: every row above was checked equal to unsharded eager's. Graphs "
                 f"compiled after the first runs (while timing and counting): {info['graphs_after_first_runs']}.")
    lines += ceiling_lines(results, info, world)
    return "\n".join(lines)


def ceiling_lines(results: list[dict], info: dict, world: int) -> list[str]:
    """The machine's ceiling and the unsharded model run alone, beside the decode times."""
    lines, d = [], _by(results, "dynashard")
    if "unsharded_alone" in info:
        a = info["unsharded_alone"]
        vs = f"; dynashard's decode is {a['decode_ms'] / d['decode_ms']:.2f}x faster than that" if d else ""
        if not a["tokens_equal"]:
            vs = "; NOT A VALID BASELINE: its tokens differ from unsharded eager's"
        lines.append(f"\nUnsharded inductor on rank 0 alone (the others waiting, {a['waiter_cpu_s']:.2f} CPU s "
                     f"in {a['wall_s']:.1f} s): {a['decode_ms']:.2f} ms/token{vs}. (The table's unsharded row "
                     f"runs on every rank at once, sharing the memory bus as the sharded systems do.)")
    if "ceiling" in info:
        c = info["ceiling"]
        lines.append(f"Machine ceiling (GEMVs over {mib(c['bytes'])} MiB of float32, 1 thread per rank): rank 0 "
                     f"alone reads {c['alone_gbps']:.1f} GB/s; {world} ranks at once, 1/{world} each, "
                     f"{c['together_gbps']:.1f} GB/s together: weight reads can get at most {c['speedup']:.2f}x "
                     f"faster with {world}-way TP on this machine (waiting rank: {c['waiter_cpu_s']:.2f} CPU s in "
                     f"{c['alone_wall_s']:.1f} s). The bound's collectives of one decode step on their own "
                     f"({c['collectives']}, every rank at once): {c['collectives_ms']:.2f} ms.")
    return lines


def verdict(results: list[dict], info: dict) -> tuple[str, dict[str, Any]]:
    d = _by(results, "dynashard")
    lines = ["dynashard's decode against the targets:"]
    met: dict[str, Any] = {}
    if d is None:
        return lines[0] + " dynashard has no decode time (failed, wrong tokens or not run)", met
    whole = _by(results, "unsharded inductor")
    if whole:
        x = whole["decode_ms"] / d["decode_ms"]
        met[f">= {SPEEDUP_TARGET}x faster than unsharded inductor (on every rank at once)"] = (x, x >= SPEEDUP_TARGET)
    if info.get("unsharded_alone", {}).get("tokens_equal"):  # the baseline a user has: one process alone
        x = info["unsharded_alone"]["decode_ms"] / d["decode_ms"]
        met[f">= {SPEEDUP_TARGET}x faster than unsharded inductor alone"] = (x, x >= SPEEDUP_TARGET)
    for label, other, limit in TARGETS:
        o = _by(results, other)
        if o:
            x = d["decode_ms"] / o["decode_ms"]
            met[label] = (x, x <= limit)
    for label, (x, ok) in met.items():
        lines.append(f"  {label}: {x:.2f}x ({'met' if ok else 'missed'})")
    for label, other, _ in TARGETS:
        if _by(results, other) is None:
            r = next((r for r in results if r["system"] == other), None)
            why = "not run" if r is None else (r.get("error") or "wrong tokens")[:200]
            lines.append(f"  {label}: n/a ({why})")
    return "\n".join(lines), {k: {"ratio": x, "met": ok} for k, (x, ok) in met.items()}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Sizes()
    for name in ("layers", "dim", "heads", "kv_heads", "ffn", "vocab"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated (the prefill's, then decode steps)")
    ap.add_argument("--systems", default=None,
                    help="comma-separated subset of: " + ", ".join(SYSTEMS) + " (default: all but unsharded eager "
                         "and dynashard unchecked; --smoke: also not dtensor compiled and hf dynashard static)")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds (one generation of every system each)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds after the first (checked) run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--min-shard-numel", type=int, default=1 << 16, help="dynashard option (its default: 65536)")
    ap.add_argument("--compiler", choices=("inductor", "aot_eager", "eager"), default=None,
                    help="what the compiled systems use (default: inductor; --smoke: eager, Dynamo alone)")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                    help="skip the machine's ceiling (GEMVs alone and together) and the unsharded model run alone")
    ap.add_argument("--out", default=None, help=OUT_HELP.replace("<script>", "decode_w<world>"))
    ap.add_argument("--smoke", action="store_true",
                    help="CI sizes: 2 layers, hidden 64, 4 heads / 2 KV heads, ffn 128, vocab 256, prompt 8, "
                         "4 new tokens, 1 timed round, compiler eager, min_shard_numel 0, fewer systems")
    args = ap.parse_args()
    args.compiler = args.compiler or ("eager" if args.smoke else "inductor")
    args.systems = [x.strip() for x in args.systems.split(",")] if args.systems else list(
        SMOKE_SYSTEMS if args.smoke else DEFAULT_SYSTEMS)
    if set(args.systems) - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(set(args.systems) - set(SYSTEMS))}; expected some of {list(SYSTEMS)}")
    if args.smoke:
        for name in ("layers", "dim", "heads", "kv_heads", "ffn", "vocab"):
            setattr(args, name, getattr(SMOKE, name))
        args.prompt, args.new_tokens, args.reps, args.warmup = 8, 4, 1, 0
        args.min_shard_numel = 0  # the smoke weights are below dynashard's default threshold
    return args


def main() -> None:
    args = parse()
    source = source_version()  # at the start: the code this run loads (dynashard/ may be edited meanwhile)
    s = Sizes(args.layers, args.dim, args.heads, args.kv_heads, args.ffn, args.vocab)
    cache = tempfile.mkdtemp(prefix="decode_inductor_cache_")
    cold_cache(os.path.join(cache, "toolchain"))
    # every compiled system is the same module class (prefill and decode each): raise rather than fall back
    torch._dynamo.config.recompile_limit = 32
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    rank, world = init(args.threads)
    for what, n in (("heads", s.heads), ("kv_heads", s.kv_heads), ("ffn", s.ffn), ("vocab", s.vocab)):
        if n % world:
            raise SystemExit(f"bench_decode: {what} {n} does not split over {world} ranks (the bound and DTensor)")
    out = out_path(args.out, f"decode_w{world}", args.smoke)
    bar = Progress(1 + len(args.systems) + args.warmup + args.reps, enabled=rank == 0)
    bar.show("warming up the compiler toolchain")
    warm_up_toolchain(args.compiler)
    ctx = {"rank": rank, "world": world, "cache_root": cache}
    try:
        with torch.no_grad():
            results, info = measure(args, s, ctx, bar)
    finally:
        bar.close()
        shutil.rmtree(cache, ignore_errors=True)
    text, met = verdict(results, info)
    if rank == 0:
        print(table(results, info, world, args) + "\n\n" + text, flush=True)
        config = {k: getattr(args, k) for k in ("prompt", "new_tokens", "systems", "reps", "warmup", "smoke",
                                                "compiler", "min_shard_numel")}
        config.update(
            sizes=dataclasses.asdict(s), head_dim=s.head_dim, max_len=args.prompt + args.new_tokens,
            dtype="float32", backend="gloo", source=source, **info,
            bound_vocab="embedding vocab-parallel (masked lookup + all_reduce), LM head colwise + all_gather",
            hf_weights="the same weights (wqkv split into q/k/v_proj), compared with unsharded eager's tokens",
            timing="interleaved rounds, a barrier before each generation; prefill: median over reps; decode: "
                   "median over every step of every rep; slowest rank",
            collectives="c10d:: op events in a torch.profiler session around one decode step",
        )
        write_json(out, record(config, {"systems": results, "targets": met}, world, args.threads))
        print(f"wrote {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    bad = [f"{r['system']}: " + (r.get("error") or "tokens differ from unsharded eager's") for r in results
           if not r["ok"] and (r["system"] in OURS or "error" not in r)]
    if bad:
        raise SystemExit("bench_decode: failed or mismatched systems:\n  " + "\n  ".join(bad))


if __name__ == "__main__":
    main()
