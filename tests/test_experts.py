"""Mixture-of-experts: expert weights (one 3-D parameter per projection) cut inside every expert.

Planned and simulated in one process (``explain(verify=True)`` runs every rank's sharded program
against the unsharded model); real gloo ranks run the ``moe`` (world 2 and 4, eager and Inductor)
and ``hf_mixtral`` (world 2, eager) battery cases (test_numerics.py). Forms: HF
transformers 5.23's ``batched_mm`` (``bmm`` of ``W[ids]``) and ``grouped_mm`` experts (its fp32
fallback op, ``aten._grouped_mm`` in bf16), a python loop over experts (``F.linear(x, W[e])``),
Llama4's ``bmm`` of the whole ``[E, in, out]`` parameter (its shared expert added in place) and
GPT-OSS's (biases added in place into the partial sums), each also under bf16 autocast. The gloo
scenario for Llama4 and GPT-OSS is in test_forms.py (its spawn). Unmatched, every expert weight
would stay whole on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as T

import dynashard
from dynashard.errors import UsageError
from tests import models
from tests.test_graphs import _count, rewritten

pytestmark = pytest.mark.unit

HIDDEN, TOKENS = 64, 14  # every input below is [2, 7, 64]: 14 tokens


def _mixtral(impl: str, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    cfg = T.MixtralConfig(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          num_local_experts=4, num_experts_per_tok=2, vocab_size=96, num_hidden_layers=2,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, experts_implementation=impl)
    return T.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def _experts_rows(report) -> dict[str, tuple[str, str, int]]:
    return {r.fqn: (r.style, r.collectives, r.comm_bytes) for r in report.rows if ".experts." in f".{r.fqn}"}


@pytest.mark.parametrize("impl,world", [("grouped_mm", 2), ("grouped_mm", 4), ("batched_mm", 2), ("batched_mm", 3)])
def test_hf_mixtral_experts_are_sharded_with_one_all_reduce_per_block(impl, world):
    """Every expert's gate_up cut per component (colwise), its down on the same features (rowwise);
    the down projections' partial sums pass the routing weights, the un-permutation and the top-k
    sum before one all_reduce of [tokens, hidden] (not [tokens * top_k, hidden])."""
    model = _mixtral(impl)
    report = dynashard.explain(model, torch.randint(3, 96, (2, 7)), world_size=world, verify=True,
                               options={"min_shard_numel": 0}, use_cache=False)
    rows = _experts_rows(report)
    assert len(rows) == 4, str(report)
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        assert rows[f"{prefix}.gate_up_proj"][:2] == ("colwise", "-"), str(report)
        assert rows[f"{prefix}.down_proj"] == ("rowwise", "all_reduce", TOKENS * HIDDEN * 4), str(report)
    gate_up = next(r for r in report.rows if r.fqn.endswith("0.mlp.experts.gate_up_proj"))
    assert gate_up.weight_bytes * world <= 4 * 256 * HIDDEN * 4 * 1.1, str(report)  # ~1/N of the experts each
    assert "cut in 2 components of 128/128" in gate_up.reason, str(report)  # gate and up cut alike
    router = next(r for r in report.rows if r.fqn.endswith("0.mlp.gate"))
    assert router.style == "replicate", str(report)


def test_hf_mixtral_plan_as_shipped():
    """Mixtral's base_model_tp_plan (packed_colwise / rowwise experts under a moe_tp_experts
    container) is what dynashard does: no warning, the same layers cut, verified."""
    import warnings

    model = _mixtral("grouped_mm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = dynashard.explain(model, torch.randint(3, 96, (2, 7)), world_size=2, verify=True,
                                   options={"plan": T.MixtralConfig.base_model_tp_plan}, use_cache=False)
    styles = {r.fqn.split("layers.0.")[-1]: r.style for r in report.rows if "layers.0." in r.fqn}
    assert styles == {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                      "self_attn.o_proj": "rowwise", "mlp.gate": "replicate", "mlp.experts.gate_up_proj": "colwise",
                      "mlp.experts.down_proj": "rowwise"}, str(report)
    assert "cut in 2 components" in next(r.reason for r in report.rows if r.fqn.endswith("0.mlp.experts.gate_up_proj"))


@pytest.mark.parametrize("world", [3, 4])
def test_grouped_mm_cuts_keep_16_byte_parts(world):
    """``aten._grouped_mm`` (HF's bf16 path) refuses strides that are not multiples of 16 bytes:
    128 features over 3 ranks (43/43/42) raised 'strides should be multiple of 16 bytes'. Cuts are
    coarsened to units of 8 bf16 elements. One MoE block (a whole model in bf16 can route a token
    to another expert on rounding noise alone, which no sharding can reproduce)."""
    block = _mixtral("grouped_mm", torch.bfloat16).model.layers[0].mlp
    x = torch.randn(2, 7, HIDDEN, dtype=torch.bfloat16)
    report = dynashard.explain(block, x, world_size=world, verify=True, options={"min_shard_numel": 0})
    rows = {r.fqn: r for r in report.rows}
    assert rows["experts.gate_up_proj"].style == "colwise" and "units of 8" in rows["experts.gate_up_proj"].reason
    assert rows["experts.down_proj"].style == "rowwise", str(report)


@pytest.mark.parametrize("loop", [False, True], ids=["batched", "loop"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_moe_forms_sharded_and_verified(loop, world):
    """tests.models.MoE: HF's batched form written out, and a python loop over experts with
    ``F.linear(x, W[e])`` (every use of a weight re-cut together, one all_reduce for the sum)."""
    torch.manual_seed(0)
    model = models.MoE(HIDDEN, 42, loop=loop).eval()  # 42 features: 11/11/10/10 on 4 ranks
    report = dynashard.explain(model, torch.randn(2, 7, HIDDEN), world_size=world, verify=True,
                               options={"min_shard_numel": 0})
    styles = {(r.fqn, r.style) for r in report.rows}
    assert styles == {("router", "replicate"), ("gate_up_proj", "colwise"), ("down_proj", "rowwise")}, str(report)
    down = sum(r.comm_bytes for r in report.rows if r.fqn == "down_proj")
    assert down == TOKENS * HIDDEN * 4, str(report)  # one all_reduce of [tokens, hidden] in both forms


def test_the_one_all_reduce_follows_the_top_k_sum():
    """Rank 1's graph: the expert matmuls on local shards, no collective before the sum over
    top-k, one all_reduce, then the residual add."""
    torch.manual_seed(0)
    gm = rewritten(models.MoE(HIDDEN, 48), torch.randn(2, 7, HIDDEN), world=2, rank=1)
    assert _count(gm, "all_reduce") == 1 and _count(gm, "all_gather") == 0, gm.code
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    reduce = next(i for i, n in enumerate(order) if "all_reduce" in str(n.target))
    last_sum = max(i for i, n in enumerate(order) if n.target is torch.ops.aten.sum.dim_IntList)
    last_bmm = max(i for i, n in enumerate(order) if n.target is torch.ops.aten.bmm.default)
    add = max(i for i, n in enumerate(order) if n.target is torch.ops.aten.add.Tensor)
    assert last_bmm < last_sum < reduce < add, gm.code
    shapes = [tuple(n.meta["val"].shape) for n in gm.graph.nodes
              if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    weights = sorted(s for s in shapes if len(s) == 3 and all(isinstance(d, int) for d in s))
    assert weights == [(4, 48, HIDDEN), (4, HIDDEN, 24)], shapes  # [E, 2 x 24, hidden], [E, hidden, 24]


def _llama4(layers: int = 2) -> nn.Module:
    """Llama4's text model: every layer an MoE (``x @ W[E, in, out]`` experts, top-1, a shared expert)."""
    torch.manual_seed(0)
    cfg = T.Llama4TextConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=64, intermediate_size_mlp=128,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2, attention_chunk_size=64)
    return T.Llama4ForCausalLM(cfg).eval()


class _FirstOutput(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x)[0]  # (Llama4TextMoe returns the router logits too)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_llama4_experts_are_cut_alike_in_every_expert(world):
    """``bmm(x.view(E, -1, hidden), gate_up_proj)``: the whole [E, in, out] parameter, one batch per
    expert, not transposed (x @ W). gate_up cut per component (gate and up halves), down on the
    same features. Were never matched: 68% of Llama4's bytes whole on every rank."""
    report = dynashard.explain(_llama4(), torch.randint(3, 96, (2, 7)), world_size=world, verify=True,
                               options={"min_shard_numel": 0}, use_cache=False)
    rows = _experts_rows(report)
    for layer in range(2):
        prefix = f"model.layers.{layer}.feed_forward.experts"
        assert rows[f"{prefix}.gate_up_proj"][:2] == ("colwise", "-"), str(report)
        assert rows[f"{prefix}.down_proj"][:2] == ("rowwise", "all_reduce"), str(report)
    gate_up = next(r for r in report.rows if r.fqn.endswith("0.feed_forward.experts.gate_up_proj"))
    assert "cut in 2 components of 64/64" in gate_up.reason, str(report)


def test_llama4_moe_block_takes_one_all_reduce():
    """The routed experts' partial sums (top-k summed) are added in place into the shared expert's
    output (``out.add_(routed)``): both left partial, one all_reduce after the add (was 2: the
    shared expert's own, and the routed sum's before the add_)."""
    block = _FirstOutput(_llama4(1).model.layers[0].feed_forward)
    gm = rewritten(block, torch.randn(2, 7, HIDDEN), world=2, rank=1)
    assert _count(gm, "all_reduce") == 1 and _count(gm, "all_gather") == 0, gm.code
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    add_ = next(i for i, n in enumerate(order) if n.target is torch.ops.aten.add_.Tensor)
    reduce = next(i for i, n in enumerate(order) if "all_reduce" in str(n.target))
    assert add_ < reduce, gm.code
    report = dynashard.explain(_FirstOutput(_llama4(1).model.layers[0].feed_forward), torch.randn(2, 7, HIDDEN),
                               world_size=2, verify=True, options={"min_shard_numel": 0})
    assert report.layers["block.shared_expert.down_proj"] == "rowwise", str(report)


def _llama4_styles(report) -> dict[str, str]:
    return {r.fqn.split(".layers.")[-1]: r.style for r in report.rows if ".layers." in r.fqn}


@pytest.mark.parametrize("moe_every", [1, 2], ids=["scout", "interleaved"])
def test_hf_llama4_plan_as_shipped(moe_every):
    """Llama4's base_model_tp_plan names its expert parameters by the weight dim HF cuts, stored
    [E, in, out]: gate_up 'packed_rowwise' (its last dim: output features, per component) and down
    'colwise' (dim -2: input features) under a 'moe_tp_experts' container; dynashard's colwise /
    rowwise of those layers, as auto plans them. Refused before ("matches no linear layer"). An
    all-MoE model (Scout) has no dense MLP: those keys warn that they have no effect."""
    import warnings

    torch.manual_seed(0)
    cfg = T.Llama4TextConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=64, intermediate_size_mlp=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=moe_every,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_chunk_size=64)
    model = T.Llama4ForCausalLM(cfg).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = dynashard.explain(model, torch.randint(3, 96, (2, 7)), world_size=2, verify=True,
                                   options={"plan": T.Llama4TextConfig.base_model_tp_plan}, use_cache=False)
    said = sorted({str(w.message).split("'")[1] for w in caught if "dynashard" in str(w.message)})
    assert said == ([f"layers.*.feed_forward.{p}_proj" for p in ("down", "gate", "up")] if moe_every == 1 else [])
    styles = _llama4_styles(report)
    assert styles["1.feed_forward.experts.gate_up_proj"] == "colwise", str(report)
    assert styles["1.feed_forward.experts.down_proj"] == "rowwise", str(report)
    assert styles["1.feed_forward.shared_expert.down_proj"] == "rowwise", str(report)
    auto = dynashard.explain(T.Llama4ForCausalLM(cfg).eval(), torch.randint(3, 96, (2, 7)), world_size=2,
                             options={"min_shard_numel": 0}, use_cache=False)
    named = {k: v for k, v in _llama4_styles(auto).items() if not k.endswith("router")}
    assert {k: styles[k] for k in named} == named, (str(report), str(auto))
    # a plan of dynashard's own styles names the layer's features, however the weight is stored
    own = dynashard.explain(T.Llama4ForCausalLM(cfg).eval(), torch.randint(3, 96, (2, 7)), world_size=2,
                            options={"plan": {"experts.gate_up_proj": "colwise", "experts.down_proj": "rowwise"}},
                            use_cache=False, verify=True)
    assert _llama4_styles(own)["1.feed_forward.experts.gate_up_proj"] == "colwise", str(own)


def _gpt_oss(impl: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = T.GptOssConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                         num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         layer_types=["full_attention"] * 2, experts_implementation=impl)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # biases as a trained model has them (a zero bias added once per rank is no test)
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("impl,world", [("grouped_mm", 2), ("grouped_mm", 3), ("batched_mm", 2), ("batched_mm", 4)])
def test_gpt_oss_experts_add_their_bias_once(impl, world):
    """GPT-OSS's experts: gate_up [E, hidden, 2 x ffn] with gate and up interleaved ([..., ::2],
    [..., 1::2]: cut in pairs), each projection followed by ``out.add_(bias[ids])``. The down
    projection's bias is added into partial sums: on rank 0 alone, so the one all_reduce holds it
    once. Were whole on every rank (the add_ into partial sums kept them whole)."""
    report = dynashard.explain(_gpt_oss(impl), torch.randint(3, 96, (2, 7)), world_size=world, verify=True,
                               options={"min_shard_numel": 0}, use_cache=False)
    rows = _experts_rows(report)
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        assert rows[f"{prefix}.gate_up_proj"][:2] == ("colwise", "-"), str(report)
        assert rows[f"{prefix}.down_proj"] == ("rowwise", "all_reduce", TOKENS * HIDDEN * 4), str(report)


def test_gpt_oss_moe_block_takes_one_all_reduce():
    """Rank 1's graph of one GPT-OSS MoE block: no gather, one all_reduce after the top-k sum, the
    down projection's bias replaced by zeros here (rank 0 adds it)."""
    gm = rewritten(_FirstOutput(_gpt_oss("batched_mm").model.layers[0].mlp), torch.randn(2, 7, HIDDEN), rank=1)
    assert _count(gm, "all_reduce") == 1 and _count(gm, "all_gather") == 0, gm.code
    assert _count(gm, "zeros_like") == 1 and _count(gm, "add_") == 2, gm.code  # gate_up's bias added as it is


_AUTOCAST_FORMS = {
    "llama4": lambda: (_llama4(), torch.randint(3, 96, (2, 7))),
    "gpt_oss_batched_mm": lambda: (_gpt_oss("batched_mm"), torch.randint(3, 96, (2, 7))),
    "mixtral_batched_mm": lambda: (_mixtral("batched_mm"), torch.randint(3, 96, (2, 7))),
    "loop": lambda: (models.MoE(HIDDEN, 48, loop=True).eval(), torch.randn(2, 7, HIDDEN)),
    "batched": lambda: (models.MoE(HIDDEN, 48).eval(), torch.randn(2, 7, HIDDEN)),
    "whole": lambda: (models.MoE(HIDDEN, 48, whole=True).eval(), torch.randn(2, 7, HIDDEN)),
}


@pytest.mark.parametrize("form", sorted(_AUTOCAST_FORMS))
def test_experts_under_autocast_are_cut_as_without_it(form):
    """Under bf16 autocast the expert weight reaches its matmul through a dtype conversion
    (``_to_copy(W[ids])``, ``_to_copy(W)``, ``t(_to_copy(W[e]))``): seen through as a linear's
    is, so every form is cut as without autocast (were whole: only the grouped_mm forms, whose
    op autocast leaves alone, were matched). Verified at bf16's tolerance (explain)."""
    torch.manual_seed(0)
    model, x = _AUTOCAST_FORMS[form]()
    kwargs = {"use_cache": False} if x.dtype == torch.long else {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = dynashard.explain(model, x, world_size=2, verify=True, options={"min_shard_numel": 0}, **kwargs)
    experts = {(r.fqn.rsplit(".", 1)[-1], r.style, r.collectives) for r in report.rows
               if r.fqn.endswith(("gate_up_proj", "down_proj")) and "shared" not in r.fqn}
    assert experts == {("gate_up_proj", "colwise", "-"), ("down_proj", "rowwise", "all_reduce")}, str(report)


class _Autocast(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.block(x)


def test_llama4_moe_block_under_autocast_takes_one_all_reduce():
    gm = rewritten(_Autocast(_FirstOutput(_llama4(1).model.layers[0].feed_forward)), torch.randn(2, 7, HIDDEN))
    assert _count(gm, "all_reduce") == 1 and _count(gm, "all_gather") == 0, gm.code
    shapes = [tuple(n.meta["val"].shape) for n in gm.graph.nodes
              if n.op == "placeholder" and getattr(n.meta.get("val"), "ndim", 0) == 3]
    weights = sorted(s for s in shapes if all(isinstance(d, int) for d in s))  # (the input's are symbolic)
    assert weights == [(4, 32, HIDDEN), (4, HIDDEN, 64)], shapes  # each rank's half of down and of gate + up


class _WritesIntoExperts(models.MoE):
    """The experts' output changed in place before the top-k sum: ``y += bias`` (HF's expert biases)
    is added on one rank only (the partial sums' memory is read by nothing else); ``y *= scale``
    and a write into memory another op reads cannot be kept partial (the reads see one all-reduced
    copy)."""

    def __init__(self, write: str):
        super().__init__(HIDDEN, 48)
        self.write = write
        self.bias = nn.Parameter(torch.randn(HIDDEN))

    def forward(self, x):
        h = x.reshape(-1, HIDDEN)
        weights, ids = torch.topk(F.softmax(self.router(h), -1), self.k, -1)
        flat = ids.reshape(-1)
        gate, up = torch.bmm(self.gate_up_proj[flat], h.repeat_interleave(self.k, 0).unsqueeze(-1)).squeeze(-1).chunk(
            2, -1)
        y = torch.bmm(self.down_proj[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        seen = y * 2.0 if self.write == "add_read_before" else None
        if self.write == "scale":
            y *= self.bias
        else:
            y += self.bias
        y = y + seen if self.write == "add_read_before" else y
        return (y * weights.reshape(-1, 1)).view(-1, self.k, HIDDEN).sum(1).view(x.shape)


@pytest.mark.parametrize("write", ["add", "scale", "add_read_before"])
def test_a_write_into_partial_sums(write):
    torch.manual_seed(0)
    report = dynashard.explain(_WritesIntoExperts(write), torch.randn(2, 7, HIDDEN), world_size=2, verify=True,
                               options={"min_shard_numel": 0})
    down = next(r for r in report.rows if r.fqn == "down_proj")
    if write == "add":  # the bias once in the sum (was: kept whole, as the others)
        assert down.style == "rowwise", str(report)
        gm = rewritten(_WritesIntoExperts(write), torch.randn(2, 7, HIDDEN), world=2, rank=1)
        assert _count(gm, "all_reduce") == 1 and _count(gm, "zeros_like") == 1, gm.code
        return
    assert down.style == "replicate" and "in-place" in down.reason, str(report)
    with pytest.raises(UsageError, match="in-place op .*_.* writes into the output of \\['down_proj'\\]"):
        dynashard.explain(_WritesIntoExperts(write), torch.randn(2, 7, HIDDEN), world_size=2,
                          options={"plan": {"gate_up_proj": "colwise", "down_proj": "rowwise"}})


def test_experts_with_per_rank_inputs_stay_whole_and_say_so():
    torch.manual_seed(0)
    model = models.MoE(HIDDEN, 48).eval()
    report = dynashard.explain(model, torch.randn(2, 7, HIDDEN), world_size=2, verify=True,
                               options={"min_shard_numel": 0, "inputs": "per_rank"})
    rows = {r.fqn: r for r in report.rows}
    for name in ("gate_up_proj", "down_proj"):
        assert rows[name].style == "replicate" and "inputs='per_rank'" in rows[name].reason, str(report)
    with pytest.raises(UsageError, match="experts 'gate_up_proj', but experts do not support inputs='per_rank'"):
        dynashard.explain(model, torch.randn(2, 7, HIDDEN), world_size=2,
                          options={"inputs": "per_rank", "plan": {"gate_up_proj": "colwise"}})


def test_experts_run_eagerly_are_named_not_hidden():
    """HF's "eager" experts loop over ``nonzero()`` results: Dynamo breaks the graph and runs the
    experts eagerly, outside every graph dynashard sees, so their weights stay whole. explain names
    the parameters no graph read and why (not only "9/12 layers sharded")."""
    model = _mixtral("eager")
    report = dynashard.explain(model, torch.randint(3, 96, (2, 7)), world_size=2, options={"min_shard_numel": 0},
                               use_cache=False)
    outside = {n for n, _ in report.outside}
    assert {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")} <= outside
    assert "read by no graph, so whole on every rank" in str(report) and "graph break" in str(report)
    whole_graph = dynashard.explain(_mixtral("grouped_mm"), torch.randint(3, 96, (2, 7)), world_size=2,
                                    options={"min_shard_numel": 0}, use_cache=False)
    assert whole_graph.outside == [] and "read by no graph" not in str(whole_graph)


class _Tail(nn.Module):
    """The experts' weighted sum followed by one op (tests/test_fuzz.py MOE_TAILS draws more)."""

    def __init__(self, tail):
        super().__init__()
        self.moe, self.tail = models.MoE(HIDDEN, 48, residual=False), tail

    def forward(self, x):
        return self.tail(self.moe(x), x)


def _written_zeros(y, x):
    acc = torch.zeros_like(x)
    acc[..., :4] = 1.0
    return acc + y


@pytest.mark.parametrize("tail", [lambda y, x: x + (y + 1.0), lambda y, x: x * (y - 1), lambda y, x: x + y * y,
                                  lambda y, x: x + y / (y * y + 1), _written_zeros],
                         ids=["plus_number", "minus_int", "square", "over_itself", "zeros_written"])
@pytest.mark.parametrize("world", [2, 3])
def test_what_is_not_linear_in_partial_sums_reads_them_reduced(tail, world):
    """Each of these, kept as partial sums unreduced, is a silent wrong result (max error 1.0-2.8):
    a number added once per rank, a partial read twice (``y * y``: each rank squares its own term),
    zeros an in-place write has changed. The fuzz draws them too."""
    torch.manual_seed(0)
    report = dynashard.explain(_Tail(tail), torch.randn(2, 7, HIDDEN), world_size=world, verify=True,
                               options={"min_shard_numel": 0})
    assert report.layers["moe.down_proj"] == "rowwise", str(report)


@pytest.mark.parametrize("ffn,world", [(24, 4), (16, 3), (8, 2)])
def test_grouped_mm_experts_too_narrow_for_16_byte_parts_stay_whole(ffn, world):
    """3 parts of 8 bf16 over 4 ranks left rank 3 an empty part, which aten._grouped_mm refuses
    ('strides should be multiple of 16 bytes', a crash at the first call); such experts stay whole."""
    torch.manual_seed(0)
    cfg = T.MixtralConfig(hidden_size=HIDDEN, intermediate_size=ffn, num_attention_heads=4, num_key_value_heads=2,
                          num_local_experts=4, num_experts_per_tok=2, vocab_size=96, num_hidden_layers=1,
                          experts_implementation="grouped_mm")
    block = T.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval().model.layers[0].mlp
    report = dynashard.explain(block, torch.randn(2, 7, HIDDEN, dtype=torch.bfloat16), world_size=world, verify=True,
                               options={"min_shard_numel": 0})
    rows = {r.fqn: r for r in report.rows}
    assert rows["experts.gate_up_proj"].style == "replicate", str(report)
    assert "grouped_mm needs parts of 16 bytes" in rows["experts.gate_up_proj"].reason, str(report)
    with pytest.raises(UsageError, match="need every rank's part in whole 16 bytes.*expected 'replicate'"):
        dynashard.explain(block, torch.randn(2, 7, HIDDEN, dtype=torch.bfloat16), world_size=world,
                          options={"plan": {"experts.down_proj": "rowwise"}})


def test_an_embedding_with_per_rank_weights_stays_whole_and_says_so():
    torch.manual_seed(0)
    model = models.TinyLM(32, 64).eval()
    ids = torch.randint(0, 64, (2, 5))
    per_rank = {"weights": "per_rank", "inputs": "per_rank"}
    report = dynashard.explain(model, ids, world_size=2, options={"min_shard_numel": 0, **per_rank})
    embedding = next(r for r in report.rows if "embed" in r.fqn)
    assert embedding.style == "replicate" and "own embedding stays whole" in embedding.reason, str(report)
    with pytest.raises(UsageError, match=f"on embedding '{embedding.fqn}', but with weights='per_rank'"):
        dynashard.explain(model, ids, world_size=2, options={**per_rank, "plan": {embedding.fqn: "rowwise"}})
