"""Rank-side bodies of the numerics and faults tests: compile with dynashard, compare with the unsharded model.

Every rank builds the same model (seed 0) and the same inputs, keeps the unsharded output as
the reference, then compiles with dynashard and runs every input shape through one compiled
model. Results go back to the parent as plain data (a numerics case's as a ``CaseResult``); the
tests assert on them. ``lose_rank1`` is the faults' rank dying before or after a compile (test_faults,
test_host_group). (Behaviours that assert where they run, on every rank: tests/scenarios.py.)
"""

from __future__ import annotations

import dataclasses

import torch

from tests import models

_PER_RANK = {"inputs": "per_rank", "weights": "per_rank"}

# (case name, model name, hidden, ffn, input shapes, extra options)
CASES = {
    "mlp_2d": ("mlp", 32, 96, [(3, 32), (5, 32), (8, 32)], {}),
    "mlp_3d": ("mlp", 32, 96, [(2, 3, 32), (4, 5, 32), (3, 7, 32)], {}),
    "mlp_nobias": ("mlp_nobias", 32, 96, [(2, 3, 32), (4, 5, 32)], {}),
    "mlp_stack": ("mlp_stack", 32, 96, [(2, 3, 32), (4, 5, 32)], {}),
    "residual": ("residual", 32, 80, [(2, 3, 32), (4, 5, 32), (3, 6, 32)], {}),
    "functional": ("functional", 32, 96, [(3, 32), (6, 32)], {}),
    "matmul": ("matmul", 32, 96, [(2, 3, 32), (4, 5, 32)], {}),
    "conv1d": ("conv1d", 32, 96, [(2, 3, 32), (4, 5, 32)], {}),
    "head_gather": ("head", 32, 90, [(3, 32), (2, 5, 32)], {"plan": {"proj": "colwise"}}),
    "uneven": ("mlp", 30, 50, [(2, 3, 30), (4, 5, 30)], {}),
    "uneven_empty_rank": ("mlp", 16, 3, [(2, 3, 16), (4, 5, 16)], {}),  # 3 features on 4 ranks: 1/1/1/0
    "user_plan_dtensor_styles": ("mlp", 32, 96, [(2, 3, 32), (4, 5, 32)], {"plan": "dtensor"}),
    "inplace": ("inplace", 32, 96, [(2, 3, 32), (4, 5, 32)], {}),
    # inputs="per_rank": every rank its own batch; weights="per_rank": every rank its own model too.
    "pr_seed": ("seed", 64, 24, [(100, 64), (37, 64), (5, 64)], {**_PER_RANK, "plan": {"*": "rowwise"}}),
    "pr_seed_colwise": ("seed", 64, 24, [(100, 64), (37, 64), (5, 64)], {**_PER_RANK, "plan": {"*": "colwise"}}),
    "pr_mlp_3d": ("mlp", 32, 96, [(2, 3, 32), (4, 5, 32), (3, 7, 32)], {"inputs": "per_rank"}),
    "pr_mlp_own_weights": ("mlp_stack", 32, 90, [(2, 3, 32), (4, 5, 32), (3, 2, 32)], _PER_RANK),
    "pr_residual": ("residual", 32, 70, [(6, 32), (9, 32), (4, 32)], {"inputs": "per_rank"}),
    "pr_matmul": ("matmul", 32, 96, [(2, 3, 32), (4, 5, 32)], {"inputs": "per_rank"}),
    "pr_conv1d_own_weights": ("conv1d", 32, 96, [(2, 3, 32), (4, 5, 32)], _PER_RANK),
    # ids in: a vocab-parallel embedding tied to a colwise LM head (50 = 13+13+12+12 on 4 ranks).
    "tiny_lm": ("tiny_lm", 32, 50, [(2, 7), (3, 5)], {}),
    "pr_tiny_lm": ("tiny_lm", 32, 50, [(2, 7), (3, 5)], {"inputs": "per_rank"}),
    # 4 heads (a hard-coded head count in the model), heads split across ranks: one all_reduce.
    "attention": ("attention", 32, 4, [(2, 5, 32), (3, 7, 32)], {}),
    "inverted_plan": ("mlp", 32, 96, [(2, 3, 32), (4, 5, 32)], {"plan": {"up": "rowwise", "down": "colwise"}}),
    # Whole transformers as written (hard-coded head counts, fused c_attn, GQA, RoPE), ids in,
    # several sequence lengths with one dynamic graph; the vocabulary (second number) is uneven.
    "nanogpt": ("nanogpt", 64, 90, [(2, 7), (3, 11), (2, 16)], {}),
    "nanogpt_manual": ("nanogpt_manual", 64, 90, [(2, 7), (3, 11)], {}),
    "llama": ("llama", 128, 90, [(2, 7), (3, 11), (2, 16)], {}),  # 8 query heads, 4 KV heads
    "llama_complex": ("llama_complex", 128, 90, [(2, 7), (3, 11)], {}),
    "llama_manual": ("llama_manual", 128, 90, [(2, 7), (3, 11)], {}),
    "llama_6_heads": ("llama_6_heads", 96, 90, [(2, 7), (3, 11)], {}),  # 2/2/1/1 heads on 4 ranks
    "llama_few_kv": ("llama_few_kv", 128, 90, [(2, 7), (3, 11)], {}),  # 2 KV heads: replicated on 4 ranks
    # K/V not repeated (SDPA enable_gqa): each rank's K/V heads are those of its query heads
    "llama_sdpa_gqa": ("llama_sdpa_gqa", 128, 90, [(2, 7), (3, 11)], {}),
    "llama_mqa": ("llama_mqa", 128, 90, [(2, 7), (3, 11)], {}),  # 1 KV head: replicated, query heads cut
    # Phi-3 style fused qkv with 2 KV heads: on 4 ranks q is cut, k and v are held whole in the one
    # weight; "probe" also reads the fused output whole (a gather that skips the whole parts)
    "fused_gqa": ("fused_gqa", 128, 2, [(2, 5, 128), (3, 7, 128)], {}),
    "fused_gqa_probe": ("fused_gqa_probe", 128, 2, [(2, 5, 128), (3, 7, 128)], {}),
    "fused_gqa_heads": ("fused_gqa_heads", 128, 2, [(2, 5, 128), (3, 7, 128)], {}),  # viewed whole into heads
    # q split into one-head pieces, scaled per head, concatenated back (head_dim given or inferred):
    # once a silent wrong result under eager and aot_eager (CPU flash attention fed a strided q)
    "per_head_scale": ("per_head_scale", 256, 4, [(2, 5, 256), (3, 7, 256)], {}),
    "per_head_scale_infer": ("per_head_scale_infer", 256, 4, [(2, 5, 256), (3, 7, 256)], {}),
    # q/k normalised over head_dim (Qwen3 RMSNorm; LayerNorm + GPT-J rotate_every_two): heads stay cut
    "qk_norm": ("qk_norm", 128, 4, [(2, 5, 128), (3, 7, 128)], {}),
    "qk_layernorm_rot2": ("qk_layernorm_rot2", 128, 4, [(2, 5, 128), (3, 7, 128)], {}),
    # BLOOM: fused qkv interleaved per head, ALiBi added by baddbmm on merged batch*heads
    "bloom_alibi": ("bloom_alibi", 64, 4, [(2, 5, 64), (3, 7, 64)], {}),
    # HF Falcon (new decoder architecture): qkv grouped per KV head, k/v taken by qkv[..., [-2], :]
    "falcon_gqa": ("falcon_gqa", 128, 4, [(2, 5, 128), (3, 7, 128)], {}),
    # the same with 2 KV groups of 4 query heads: on 4 ranks each group is cut into its components, every
    # rank holding one query head of each group (heads r and 4 + r) and every group's k and v whole
    "falcon_few_groups": ("falcon_gqa", 128, 2, [(2, 5, 128), (3, 7, 128)], {}),
    # Falcon-7B multi-query: k and v held whole inside the fused weight, 6 query heads (2/2/1/1 on 4 ranks)
    "falcon_mqa": ("falcon_mqa", 96, 6, [(2, 5, 96), (3, 7, 96)], {}),
    # two colwise outputs concatenated along their features into one rowwise linear (a dealt cut)
    "cat_mlp": ("cat_mlp", 48, 42, [(2, 3, 48), (4, 5, 48)], {}),
    # Mixture-of-experts: every expert cut (42 features: 11/11/10/10 on 4 ranks), one all_reduce per block.
    "moe": ("moe", 64, 42, [(2, 5, 64), (3, 7, 64)], {}),  # HF's batched_mm form: bmm of W[ids]
    "moe_loop": ("moe_loop", 64, 42, [(2, 5, 64), (3, 7, 64)], {}),  # F.linear(x, W[e]) in a python loop
    "hf_mixtral": ("hf_mixtral", 64, 96, [(2, 7), (3, 5)], {}),  # transformers' grouped_mm experts (its fp32 op)
}

# Parameters each case must actually shard: a case that silently replicated would prove nothing.
# A colwise linear's 1-D bias is held cut like its output (and freed) as well: plan._held_biases.
SHARDED = {
    "mlp": {"up.weight", "up.bias", "down.weight"},
    "mlp_nobias": {"up.weight", "down.weight"},
    "mlp_stack": {f"layers.{i}.{n}" for i in range(3) for n in ("up.weight", "up.bias", "down.weight")},
    "residual": {"gate.weight", "up.weight", "down.weight"},
    "functional": {"w1", "b1", "w2"},
    "matmul": {"w1", "w2"},
    "conv1d": {"c_fc.weight", "c_fc.bias", "c_proj.weight"},
    "head": {"proj.weight", "proj.bias"},
    "inplace": {"up.weight", "up.bias", "down.weight"},
    "seed": {"weight"},
    "attention": {"q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias", "o.weight"},
    "tiny_lm": {"embed.weight", "mlp.up.weight", "mlp.up.bias", "mlp.down.weight"},
    "nanogpt": {"wte.weight", "wpe.weight"}
    | {f"h.{i}.{n}.weight" for i in range(2) for n in ("attn.c_attn", "attn.c_proj", "c_fc", "c_proj")}
    | {f"h.{i}.{n}.bias" for i in range(2) for n in ("attn.c_attn", "c_fc")},
    "llama": {"embed_tokens.weight"}
    | {f"layers.{i}.{n}.weight" for i in range(2) for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "gate_proj", "up_proj",
        "down_proj")},
}
SHARDED.update({name: SHARDED["llama"] for name in ("llama_complex", "llama_manual", "llama_6_heads")})
SHARDED["nanogpt_manual"] = SHARDED["nanogpt"]
# With fewer KV heads (2) than ranks (4) the KV projections are kept whole (each rank narrows them).
SHARDED["llama_few_kv"] = {n for n in SHARDED["llama"] if "k_proj" not in n and "v_proj" not in n}
SHARDED["llama_sdpa_gqa"] = SHARDED["llama"]
SHARDED["llama_mqa"] = SHARDED["llama_few_kv"]
SHARDED["fused_gqa"] = SHARDED["fused_gqa_probe"] = SHARDED["fused_gqa_heads"] = {"qkv_proj.weight", "o_proj.weight"}
SHARDED["per_head_scale"] = SHARDED["per_head_scale_infer"] = SHARDED["attention"]
SHARDED["qk_norm"] = SHARDED["qk_layernorm_rot2"] = {"q.weight", "k.weight", "v.weight", "o.weight"}
SHARDED["bloom_alibi"] = {"query_key_value.weight", "query_key_value.bias", "dense.weight"}
SHARDED["falcon_gqa"] = SHARDED["falcon_mqa"] = {"query_key_value.weight", "dense.weight"}
SHARDED["cat_mlp"] = {"a.weight", "a.bias", "b.weight", "b.bias", "down.weight"}
SHARDED["moe"] = SHARDED["moe_loop"] = {"gate_up_proj", "down_proj"}
SHARDED["hf_mixtral"] = {"model.model.embed_tokens.weight"} | {
    f"model.model.layers.{i}.{n}" for i in range(2) for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
# weights="per_rank" also exchanges (and frees) colwise biases: every rank's differ.
SHARDED_BY_CASE = {
    "pr_seed_colwise": {"weight", "bias"},
    "pr_mlp_own_weights": SHARDED["mlp_stack"] | {f"layers.{i}.up.bias" for i in range(3)},
    "pr_conv1d_own_weights": SHARDED["conv1d"] | {"c_fc.bias"},
    "inverted_plan": {"up.weight", "down.weight", "down.bias"},  # down is the colwise one
}
# inputs="per_rank" alone keeps colwise biases whole (each rank adds the rows of every rank's batch).
SHARDED_BY_CASE.update({
    case: {n for n in SHARDED[model] if not n.endswith("bias") and n != "b1"}
    for case, (model, *_, extra) in CASES.items()
    if extra.get("inputs") == "per_rank" and extra.get("weights") != "per_rank"
})


def _options(extra: dict, compiler: str) -> dict:
    opts = {"compiler": compiler, "min_shard_numel": 0, **extra}
    if opts.get("plan") == "dtensor":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        opts["plan"] = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return opts


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One case on one rank: the compiled model's outputs against the unsharded model's."""

    max_err: float  # the largest absolute difference over every input shape
    ref_scale: float  # the largest absolute value of the unsharded outputs (for a relative tolerance)
    freed: list[str]  # the parameters whose full-size storage was freed: what the plan sharded
    compiles: int  # how many graphs the backend compiled for all the shapes
    shapes_ok: bool  # every output has the unsharded output's shape and dtype


def run_case(case: str, compiler: str, dtype: torch.dtype, rank: int) -> CaseResult:
    """Compile one case; with per-rank inputs/weights the reference is this rank's own model."""
    model_name, hidden, ffn, shapes, extra = CASES[case]
    torch._dynamo.reset()
    torch.manual_seed(rank if extra.get("weights") == "per_rank" else 0)
    model = models.build(model_name, hidden, ffn).to(dtype)
    torch.manual_seed(100 + (rank if extra.get("inputs") == "per_rank" else 0))
    if model_name in models.IDS_IN:  # token ids
        inputs = [torch.randint(0, ffn, s) for s in shapes]
    else:
        inputs = [torch.randn(s, dtype=dtype) for s in shapes]
    compiles = []

    def counting_backend(gm, example_inputs):
        from dynashard.dynamo_backend import dynashard_backend

        compiles.append(len(gm.graph.nodes))
        return dynashard_backend(gm, example_inputs, _options(extra, compiler))

    with torch.no_grad():
        refs = [model(x) for x in inputs]
        compiled = torch.compile(model, backend=counting_backend)
        outs = [compiled(x) for x in inputs]
    freed = {n for n, p in model.named_parameters() if p.untyped_storage().nbytes() == 0}
    return CaseResult(
        max_err=max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, refs)),
        ref_scale=max(float(r.float().abs().max()) for r in refs),
        freed=sorted(freed),
        compiles=len(compiles),
        shapes_ok=all(o.shape == r.shape and o.dtype == r.dtype for o, r in zip(outs, refs)),
    )


def battery(rank: int, world: int, cases: list[str], compiler: str, dtype_name: str) -> dict[str, CaseResult]:
    dtype = getattr(torch, dtype_name)
    return {case: run_case(case, compiler, dtype, rank) for case in cases}


def battery_of_configs(rank: int, world: int, groups: list[tuple[str, str, tuple[str, ...]]]) -> dict:
    """Several (compiler, dtype, cases) groups in one spawn: ``{(compiler, dtype): battery results}``."""
    return {(compiler, dtype): battery(rank, world, list(cases), compiler, dtype) for compiler, dtype, cases in groups}


def lose_rank1(rank: int, when: str) -> tuple[BaseException, float]:
    """An MLP compiled with dynashard on 2 ranks (eager), rank 1 dying ``when``: "before_compile" (before
    the first call) or "after_compile" (after a call every rank finished). Rank 0's next call (three
    calls after the compile): what it raised, and how many seconds it took to raise it."""
    import os
    import time

    import torch.distributed as dist

    from tests.scenarios import raised

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    compiled = torch.compile(models.MLP(32, 96), backend="dynashard", options={"compiler": "eager",
                                                                               "min_shard_numel": 0})
    with torch.no_grad():
        if when == "after_compile":
            compiled(x)
            dist.barrier()
        if rank == 1:
            os._exit(3)
        if when == "after_compile":
            time.sleep(1)  # (rank 1 gone before rank 0 calls)
        start = time.monotonic()
        error = raised(lambda: [compiled(x) for _ in range(3 if when == "after_compile" else 1)])
    return error, time.monotonic() - start
