"""Pure tests, no process group: options, shard arithmetic, explain's plans and table."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dynashard
from dynashard.layout.split import Split, shard_bounds
from dynashard.options import Options, parse_options
from tests import models

pytestmark = pytest.mark.unit


def test_shard_bounds_are_balanced_and_cover_the_dim():
    for size in (1, 6, 7, 50, 90, 96):
        for world in (1, 2, 3, 4):
            parts = [shard_bounds(size, world, r) for r in range(world)]
            lengths = [p[1] for p in parts]
            assert max(lengths) - min(lengths) <= 1 and sorted(lengths, reverse=True) == lengths
            assert [p[0] for p in parts] == [sum(lengths[:r]) for r in range(world)] and sum(lengths) == size
    assert [shard_bounds(6, 4, r)[1] for r in range(4)] == [2, 2, 1, 1]  # 6 heads on 4 ranks


def test_split_components_and_units():
    # A fused [q | k | v] of 3 x 6 heads of 16 on 4 ranks: every rank holds whole heads of each.
    split = Split((6, 6, 6), 16)
    assert split.size == 288 and split.fewest_units(4) == 1
    assert split.pieces(4, 0) == [(0, 32), (96, 32), (192, 32)]
    assert split.pieces(4, 3) == [(80, 16), (176, 16), (272, 16)]
    covered = sorted(i for r in range(4) for s, n in split.pieces(4, r) for i in range(s, s + n))
    assert covered == list(range(288))
    assert Split((96,), 1).cut({32, 64}) == Split((32, 32, 32), 1)
    assert Split((32, 32, 32), 1).coarsen(16) == Split((2, 2, 2), 16)
    assert Split((6,), 16).coarsen(4) is None  # 6 heads are not whole groups of 4


def test_options_validation():
    assert parse_options(None) == Options()
    opts = parse_options({"plan": {"a.*": "colwise"}, "compiler": "eager", "weights": "rank0"})
    assert opts.plan_dict == {"a.*": "colwise"} and opts.compiler == "eager"
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['nope'\]; valid options are \['plan'"):
        parse_options({"nope": 1})
    with pytest.raises(ValueError, match=r"plan\['x'\] is 'sideways'; expected one of"):
        parse_options({"plan": {"x": "sideways"}})
    with pytest.raises(TypeError, match="option 'plan' is a list"):
        parse_options({"plan": ["x"]})
    with pytest.raises(TypeError, match="min_shard_numel"):
        parse_options({"min_shard_numel": "big"})
    with pytest.raises(TypeError, match="expected a ProcessGroup or a 1-D DeviceMesh"):
        parse_options({"group": 3})
    assert Options().check_inputs == "ids" and parse_options({"check_inputs": "off"}).check_inputs == "off"
    expected = r"'check_inputs' is True; expected one of \['ids', 'shapes', 'values', 'off'\]"
    with pytest.raises(ValueError, match=expected):
        parse_options({"check_inputs": True})


def test_dtensor_styles_accepted():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    opts = parse_options({"plan": {"up": ColwiseParallel(), "down": RowwiseParallel()}})
    assert opts.plan_dict == {"up": "colwise", "down": "rowwise"}


def test_explain_without_process_group_leaves_weights_and_no_group():
    torch.manual_seed(0)
    model = models.ResidualBlock(512, 1024)
    report = dynashard.explain(model, torch.randn(2, 8, 512), world_size=4)
    assert report.layers == {"gate": "colwise", "up": "colwise", "down": "rowwise"}
    assert not dist.is_initialized()
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    text = str(report)
    for column in ("layer", "weight", "style", "collectives", "comm/call", "weight/rank", "reason"):
        assert column in text
    down = next(r for r in report.rows if r.fqn == "down")
    assert down.collectives == "all_reduce" and down.comm_bytes == 2 * 8 * 512 * 4
    assert down.weight_bytes == 512 * 1024 * 4 // 4


def test_explain_auto_plan_reasons():
    torch.manual_seed(0)
    model = models.Head(32, 90)  # a lone small linear: replicated, and the reason says why
    report = dynashard.explain(model, torch.randn(3, 32), world_size=2)
    assert report.layers == {"proj": "replicate"}
    assert "min_shard_numel" in report.rows[0].reason
    report = dynashard.explain(model, torch.randn(3, 32), world_size=2, options={"min_shard_numel": 0})
    assert report.layers == {"proj": "replicate"} and "a gather would not pay" in report.rows[0].reason
    report = dynashard.explain(model, torch.randn(3, 32), world_size=4, options={"plan": {"proj": "colwise"}})
    row = report.rows[0]
    assert row.style == "colwise" and row.collectives.startswith("all_gather") and row.comm_bytes == 3 * 90 * 4


def test_explain_hf_style_plan_and_errors():
    torch.manual_seed(0)
    model = models.MLPStack(64, 256, depth=2)
    plan = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}
    report = dynashard.explain(model, torch.randn(4, 64), world_size=2, options={"plan": plan})
    assert set(report.layers.values()) == {"colwise", "rowwise"} and len(report.layers) == 4
    # Keys relative to a base model (HF base_model_tp_plan) match as a dotted suffix.
    plan = {"*.up": "colwise", "down": "rowwise"}
    report = dynashard.explain(model, torch.randn(4, 64), world_size=2, options={"plan": plan})
    assert report.layers["layers.1.down"] == "rowwise"
    with pytest.raises(Exception, match="plan key 'layers.*.upp' matches no linear"):
        dynashard.explain(model, torch.randn(4, 64), world_size=2, options={"plan": {"layers.*.upp": "colwise"}})
    with pytest.raises(ValueError, match="world_size"):
        dynashard.explain(model, torch.randn(4, 64))


class _WeightAlsoReadElsewhere(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(512, 512)

    def forward(self, x):
        return self.proj(x) * self.proj.weight.sum()


def test_weight_read_by_other_ops_is_replicated_or_refused():
    model = _WeightAlsoReadElsewhere()
    x = torch.randn(3, 512)
    report = dynashard.explain(model, x, world_size=2)
    assert report.layers == {"proj": "replicate"} and "also read by aten.sum" in report.rows[0].reason
    with pytest.raises(Exception, match="plan asks for colwise on 'proj', but its weight is also read by aten.sum"):
        dynashard.explain(model, x, world_size=2, options={"plan": {"proj": "colwise"}})


def test_explain_per_rank_layout():
    torch.manual_seed(0)
    report = dynashard.explain(models.ResidualBlock(512, 1024), torch.randn(2, 8, 512), world_size=2,
                               options={"inputs": "per_rank"})
    rows = {r.fqn: r for r in report.rows}
    # gate and up read the same normalised input: one row all-gather, charged once.
    assert rows["gate"].collectives.startswith("all_gather_rows") and rows["up"].collectives == "-"
    assert rows["down"].collectives == "reduce_scatter" and rows["down"].comm_bytes == 2 * 2 * 8 * 512 * 4


class _WritesThroughSlice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 64)

    def forward(self, x):
        h = self.up(x)
        h[:, :8] = 0  # through a slice: into the gather of h, this rank's part copied back into the shard
        return self.down(h)


class _WritesThroughViewBetweenGathers(_WritesThroughSlice):
    def forward(self, x):
        h = self.up(x)
        a = h.amax(-1, keepdim=True)
        h.view(-1, 1024).mul_(2.0)  # one cached gather of h would be stale for amin below
        return self.down(h) + a + h.amin(-1, keepdim=True)


class _WritesInPlace(_WritesThroughSlice):
    def forward(self, x):
        h = self.up(x)
        h.mul_(2)  # directly on the shard: followed
        return self.down(h)


@pytest.mark.parametrize(
    "cls,up_style",
    [(_WritesThroughSlice, "colwise"), (_WritesThroughViewBetweenGathers, "replicate"), (_WritesInPlace, "colwise")],
)
def test_in_place_writes_are_followed_or_kept_whole(cls, up_style):
    torch.manual_seed(0)
    report = dynashard.explain(cls(), torch.randn(4, 64), world_size=2, verify=True)
    assert report.layers["up"] == up_style
    if up_style == "replicate":
        assert "in-place" in next(r.reason for r in report.rows if r.fqn == "up")


def test_in_place_write_a_user_plan_cannot_keep_is_refused():
    with pytest.raises(Exception, match="in-place op aten.mul_.(Tensor|Scalar) writes into the output of \\['up'\\]"):
        dynashard.explain(_WritesThroughViewBetweenGathers(), torch.randn(4, 64), world_size=2,
                          options={"plan": {"up": "colwise", "down": "rowwise"}})


class _TiedAcrossBreak(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(1024, 128), torch.nn.Linear(128, 1024, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.emb(ids))
        torch._dynamo.graph_break()
        return self.head(h)


def test_tied_weight_split_in_one_graph_is_followed_in_the_next():
    """The head alone would be replicated (in_features 128); it follows the embedding's split."""
    from dynashard import _torch as private

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TiedAcrossBreak()
    ids = torch.randint(0, 1024, (2, 5))
    private.init_fake_process_group(2)  # graph shapes only: the fake group moves no data
    try:
        with torch.no_grad():
            out = torch.compile(model, backend="dynashard", options={"compiler": "eager"})(ids)
    finally:
        dist.destroy_process_group()
    assert out.shape == (2, 5, 1024) and model.emb.weight.untyped_storage().nbytes() == 0


def test_tied_embedding_with_per_rank_weights_stays_whole():
    torch.manual_seed(0)
    model = models.TinyLM(32, 50)
    report = dynashard.explain(model, torch.randint(0, 50, (2, 7)), world_size=2, verify=True,
                               options={"min_shard_numel": 0, "inputs": "per_rank", "weights": "per_rank"})
    assert [r.style for r in report.rows if r.fqn == "embed"] == ["replicate", "replicate"]


def test_attention_heads_split_across_ranks_with_one_all_reduce():
    """q/k/v colwise, o rowwise through views into heads, transposes and SDPA, no head-count edit."""
    torch.manual_seed(0)
    report = dynashard.explain(models.AttentionBlock(512, 8), torch.randn(2, 6, 512), world_size=4, verify=True)
    assert report.layers == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
    assert [r.collectives for r in report.rows] == ["-", "-", "-", "all_reduce"]
    # 6 heads on 4 ranks: 2/2/1/1 whole heads each, still one all_reduce.
    report = dynashard.explain(models.AttentionBlock(384, 6), torch.randn(2, 6, 384), world_size=4, verify=True)
    assert [r.collectives for r in report.rows] == ["-", "-", "-", "all_reduce"]
    assert "cut in 6 units of 64" in report.rows[0].reason
    # 3 heads on 4 ranks would leave a rank without heads: the auto plan keeps q/k/v whole and says
    # why; a plan that insists on colwise meets a gather before attention. Both correct.
    report = dynashard.explain(models.AttentionBlock(384, 3), torch.randn(2, 6, 384), world_size=4, verify=True)
    assert [r.style for r in report.rows[:3]] == ["replicate"] * 3
    assert "3 heads of 128 cannot be cut over 4 ranks" in report.rows[0].reason
    plan = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
    report = dynashard.explain(models.AttentionBlock(384, 3), torch.randn(2, 6, 384), world_size=4, verify=True,
                               options={"plan": plan})
    assert report.rows[0].collectives.startswith("all_gather")


@pytest.mark.parametrize("world", [2, 4])
def test_fused_projections_are_cut_per_component(world):
    """[gate | up] chunked, and a Phi-3 style fused qkv with GQA sliced apart: each rank holds its
    part of every component, so the pair costs one all_reduce and no gather."""
    torch.manual_seed(0)
    report = dynashard.explain(models.FusedGateUp(64, 96), torch.randn(2, 5, 64), world_size=world, verify=True,
                               options={"min_shard_numel": 0})
    assert [r.collectives for r in report.rows] == ["-", "all_reduce"]
    assert "2 components of 96/96 units of 1" in report.rows[0].reason
    report = dynashard.explain(models.FusedGQAAttention(128, 8, 4), torch.randn(2, 5, 128), world_size=world,
                               verify=True, options={"min_shard_numel": 0})
    assert [r.collectives for r in report.rows] == ["-", "all_reduce"]
    assert "3 components of 8/4/4 units of 16" in report.rows[0].reason


@pytest.mark.parametrize("per_head", [True, False])
def test_masked_attention_keeps_heads_sharded(per_head):
    """An explicit SDPA mask: one with a head dim is narrowed to this rank's heads, one without is
    broadcast; either way the block costs one all_reduce (6 heads on 4 ranks: 2/2/1/1)."""
    torch.manual_seed(0)
    report = dynashard.explain(models.MaskedAttention(96, 6, per_head), torch.randn(2, 5, 96), world_size=4,
                               verify=True, options={"min_shard_numel": 0})
    assert [r.collectives for r in report.rows] == ["-", "-", "-", "all_reduce"]


def test_auto_plan_finds_megatron_for_whole_decoders():
    """From the graph alone: per block q/k/v (or c_attn) and gate/up (c_fc) colwise, o/down rowwise,
    one all_reduce after attention and one after the MLP. At world 8 a Llama with 2 KV heads keeps
    k/v whole (each rank narrows them to its one query head) and still shards everything else."""
    torch.manual_seed(0)
    ids = torch.randint(0, 90, (2, 6))
    report = dynashard.explain(models.NanoGPT(vocab=90, n_embd=64, n_head=4, n_layer=2), ids, world_size=2,
                               verify=True, options={"min_shard_numel": 0})
    block = {r.fqn: (r.style, r.collectives) for r in report.rows if r.fqn.startswith("h.1.")}
    assert block == {"h.1.attn.c_attn": ("colwise", "-"), "h.1.attn.c_proj": ("rowwise", "all_reduce"),
                     "h.1.c_fc": ("colwise", "-"), "h.1.c_proj": ("rowwise", "all_reduce")}
    model = models.LlamaDecoder(vocab=90, hidden=128, n_heads=8, n_kv_heads=2, n_layer=2)
    report = dynashard.explain(model, ids, world_size=8, verify=True, options={"min_shard_numel": 0})
    block = {r.fqn.split(".")[-1]: (r.style, r.collectives) for r in report.rows if r.fqn.startswith("layers.1.")}
    assert block == {"q_proj": ("colwise", "-"), "k_proj": ("replicate", "-"), "v_proj": ("replicate", "-"),
                     "o_proj": ("rowwise", "all_reduce"), "gate_proj": ("colwise", "-"),
                     "up_proj": ("colwise", "-"), "down_proj": ("rowwise", "all_reduce")}


@pytest.mark.parametrize("world", [2, 3])
def test_inputs_sharded_off_their_features_are_gathered_not_used(world):
    """A linear fed a shard on another dim (a per-head linear, a merged token dim) must not be made
    rowwise on it (it crashes). Auto plans treat such an input as replicated; a plan
    that insists on rowwise gathers it and takes this rank's features. A shard of every token's
    features merged into one feature dim (static sizes) is the same cut repeated per token: the
    rowwise weight is cut so, nothing gathered (as HF Falcon's query heads of every KV group)."""
    torch.manual_seed(0)
    for model, x, plan, gathered in (
        (models.PerHeadLinear(), torch.randn(2, 3, 16), {"q": "colwise", "head": "rowwise", "o": "rowwise"}, True),
        (models.MergedTokens(), torch.randn(2, 5, 48), {"up": "colwise", "down": "rowwise"}, False),
    ):
        dynashard.explain(model, x, world_size=world, verify=True, options={"min_shard_numel": 0})
        options = {"min_shard_numel": 0, "plan": plan}
        report = dynashard.explain(model, x, world_size=world, verify=True, options=options)
        assert report.rows[0].collectives.startswith("all_gather") == gathered, str(report)


@pytest.mark.parametrize("n_kv,world,kv_style", [(4, 2, "colwise"), (4, 4, "colwise"), (2, 4, "replicate"),
                                                 (1, 2, "replicate"), (4, 3, "colwise")])
@pytest.mark.parametrize("repeat", ["sdpa", "expand"])
def test_gqa_and_mqa_keep_query_heads_sharded(n_kv, world, kv_style, repeat):
    """K/V repeated in the model (repeat_kv) or by SDPA itself (enable_gqa): query heads are cut,
    K/V cut with them when every rank gets whole K/V heads of its own query heads, else kept
    whole (2 KV heads on 4 ranks, MQA). 4 KV heads on 3 ranks are 2/1/1 with 4/2/2 query heads.
    One all_reduce per attention either way."""
    torch.manual_seed(0)
    model = models.LlamaAttention(64, 8, n_kv, repeat=repeat)
    cos, sin = models.rope_tables(8, 16)
    report = dynashard.explain(model, torch.randn(2, 5, 64), cos, sin, world_size=world, verify=True,
                               options={"min_shard_numel": 0})
    styles = {r.fqn: (r.style, r.collectives) for r in report.rows}
    assert styles == {"q_proj": ("colwise", "-"), "k_proj": (kv_style, "-"), "v_proj": (kv_style, "-"),
                      "o_proj": ("rowwise", "all_reduce")}, str(report)


@pytest.mark.parametrize("world,n_kv", [(4, 2), (8, 2), (3, 2), (4, 1), (2, 1)])
@pytest.mark.parametrize("probe", [None, "mean", "heads"])
def test_fused_qkv_with_fewer_kv_heads_than_ranks_holds_kv_whole(world, n_kv, probe):
    """Phi-3 / Falcon style fused qkv: with fewer KV heads than ranks each rank holds its query heads
    and all of k and v in the one weight, rather than the whole projection whole. ``probe``
    reads the fused output whole too: its gather sends only the cut part. Viewed into heads first
    ("heads"), the view must not deal the whole k/v heads out as if cut (error 3.1 when it does)."""
    torch.manual_seed(0)
    model = models.FusedGQAAttention(128, 8, n_kv, probe=probe)
    report = dynashard.explain(model, torch.randn(2, 5, 128), world_size=world, verify=True,
                               options={"min_shard_numel": 0})
    qkv, o = report.rows
    assert (qkv.style, o.style, o.collectives) == ("colwise", "rowwise", "all_reduce"), str(report)
    assert f"cut in 3 components of 8/{n_kv}/{n_kv} units of 16; components 2, 3 held whole" in qkv.reason
    assert qkv.collectives.startswith("all_gather") if probe else qkv.collectives == "-", str(report)


@pytest.mark.parametrize("infer_head_dim", [False, True], ids=["view_dh", "view_minus_one"])
@pytest.mark.parametrize("world", [2, 4])
def test_per_head_pieces_of_q_are_right_and_balanced(world, infer_head_dim):
    """q split into one-head pieces, scaled, concatenated back: q is cut evenly and gathered at
    the split, the attention stays on each rank's heads, o is rowwise. Guards against cutting q into
    one-unit components all dealt to rank 0 (which then holds the whole of q), with the gathered,
    permuted q fed to CPU flash attention as if contiguous (max err 1.4, 1e20 on real ranks under
    eager), and with ``view(B, T, h, -1)`` a compile error on the empty rank."""
    torch.manual_seed(0)
    model = models.PerHeadScaleAttention(256, 4, infer_head_dim)
    report = dynashard.explain(model, torch.randn(2, 5, 256), world_size=world, verify=True)
    rows = {r.fqn: r for r in report.rows}
    assert rows["q"].style == "colwise" and rows["q"].weight_bytes == 256 * 256 * 4 // world, str(report)
    assert report.layers == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}, str(report)


@pytest.mark.parametrize("norm,rot2", [("rms", False), ("layer", False), ("rms", True), ("layer", True)])
@pytest.mark.parametrize("world", [2, 4])
def test_qk_norm_over_head_dim_keeps_heads_sharded(world, norm, rot2):
    """q/k normalised over head_dim (Qwen3's RMSNorm: mean over the last dim; Phi/StableLM's
    LayerNorm(head_dim): native_layer_norm) and GPT-J's rotate_every_two (stack on a new last dim)
    reduce or stack along dims that are not the cut one: local, with no gather of q and k and no
    replicated attention."""
    torch.manual_seed(0)
    model = models.QKNormAttention(128, 4, norm, rot2)
    report = dynashard.explain(model, torch.randn(2, 5, 128), world_size=world, verify=True,
                               options={"min_shard_numel": 0})
    assert report.layers == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}, str(report)
    assert all(r.collectives in ("-", "all_reduce") for r in report.rows), str(report)


def test_a_replicated_layer_names_the_op_that_gathered_it():
    """'no rowwise partner and in_features 32 < 256' hid why: the reason names the op no rule keeps
    the shard through."""
    torch.manual_seed(0)
    report = dynashard.explain(models.Head(32, 90), torch.randn(3, 32), world_size=2, options={"min_shard_numel": 0})
    assert "its shard is gathered before _softmax" in report.rows[0].reason, report.rows[0].reason


class _MathSDPA(torch.nn.Module):
    """SDPA forced onto its math path, which traces to ``_safe_softmax`` between two matmuls."""

    def __init__(self, hidden: int = 128, heads: int = 4):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b, t, d = x.shape
        q, k, v = (lin(x).view(b, t, self.h, d // self.h).transpose(1, 2) for lin in (self.q, self.k, self.v))
        with sdpa_kernel(SDPBackend.MATH):
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


def test_sdpa_math_path_keeps_heads_sharded():
    """SDPA's math path (``_safe_softmax``) keeps q and k cut by heads, not replicated ('its shard is
    gathered before _safe_softmax.default')."""
    torch.manual_seed(0)
    report = dynashard.explain(_MathSDPA(), torch.randn(2, 5, 128), world_size=2, verify=True,
                               options={"min_shard_numel": 0})
    assert report.layers == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}, str(report)


# base_model_tp_plan entries as transformers 5.23 ships them (configuration_qwen3.py, _phi3.py,
# _mixtral.py), with the "layers.*.self_attn." / "layers.*.mlp." prefixes of the test modules dropped.
QWEN3_ATTENTION_PLAN = {"q": "colwise", "k": "colwise", "v": "colwise", "q_norm": "replicated_with_grad_allreduce",
                        "k_norm": "replicated_with_grad_allreduce", "o": "rowwise"}
PHI3_PLAN = {"qkv_proj": "colwise_gather_output", "o_proj": "rowwise_split_input",
             "gate_up": "colwise_gather_output", "down": "rowwise_split_input"}
# An expert-parallel plan (what base_model_ep_plan dicts hold): dynashard shards experts tensor-parallel.
EP_PLAN = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise", "experts": "ep_dispatch_experts",
           "experts.gate_up_proj": "grouped_gemm"}


def test_hf_plan_styles_as_they_ship():
    """Qwen3, Phi-3 and Mixtral plan dicts raised ValueError ('replicated_with_grad_allreduce',
    'colwise_gather_output', 'rowwise_split_input', 'packed_colwise', 'moe_tp_experts'). Mixtral's
    as shipped is in test_experts.py; an expert-parallel plan's entries warn."""
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a style whose meaning dynashard keeps is accepted silently
        report = dynashard.explain(models.QKNormAttention(128, 4), torch.randn(2, 5, 128), world_size=2, verify=True,
                                   options={"plan": QWEN3_ATTENTION_PLAN})
    assert report.layers == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}, str(report)
    for model in (models.FusedGQAAttention(128, 8, 2), models.FusedGateUp(64, 96)):
        x = torch.randn(2, 5, 128 if isinstance(model, models.FusedGQAAttention) else 64)
        plan = {k: v for k, v in PHI3_PLAN.items() if any(n == k for n, _ in model.named_modules())}
        report = dynashard.explain(model, x, world_size=2, verify=True, options={"plan": plan})
        assert sorted(report.layers.values()) == ["colwise", "rowwise"], str(report)
    with pytest.warns(UserWarning) as caught:
        report = dynashard.explain(models.AttentionBlock(64, 4), torch.randn(2, 5, 64), world_size=2, verify=True,
                                   options={"plan": EP_PLAN})
    assert report.layers == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}, str(report)
    said = " | ".join(str(w.message) for w in caught)
    for key in ("experts", "experts.gate_up_proj"):
        assert f"plan entry {key!r}" in said and "not expert-parallel" in said, said
    with pytest.raises(ValueError, match=r"plan\['q'\] is 'colwise_sideways'; expected one of .*Hugging Face"):
        parse_options({"plan": {"q": "colwise_sideways"}})


def test_a_tied_weights_reason_names_the_other_use_not_itself():
    """The LM head tied to the embedding read 'shares its weight with embed (colwise), embed
    (rowwise)', listing itself; it names the embedding it follows."""
    torch.manual_seed(0)
    report = dynashard.explain(models.TinyLM(32, 50), torch.randint(0, 50, (2, 7)), world_size=2, verify=True,
                               options={"min_shard_numel": 0})
    shared = [r for r in report.rows if "shares its weight" in r.reason]
    assert len(shared) == 1 and shared[0].style == "colwise", str(report)
    assert "shares its weight with embed (rowwise embedding): split on the same dim" in shared[0].reason, str(report)


@pytest.mark.parametrize("kernel,bias", [("flash", False), ("efficient", False), ("efficient", True), ("cudnn", False),
                                         ("cudnn", True)])
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_sdpa_kernels_keep_heads_sharded(world, kernel, bias):
    """On a GPU, SDPA traces to the CUDA flash, memory-efficient or cuDNN kernel; only the CPU flash
    kernel had a rule, so every attention block would have gathered there. Run on CPU through the
    math-path stand-ins of tests/gpu_attention_on_cpu.py (the CUDA kernels themselves are untested
    here); a per-head additive bias (ALiBi-like) is narrowed to this rank's heads."""
    from tests.gpu_attention_on_cpu import CudaKernelAttention, register

    register()
    torch.manual_seed(0)
    report = dynashard.explain(CudaKernelAttention(kernel, 64, 4, bias), torch.randn(2, 5, 64), world_size=world,
                               verify=True, options={"min_shard_numel": 0})
    assert report.layers == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}, str(report)
    assert [r.collectives for r in report.rows] == ["-", "-", "-", "all_reduce"], str(report)


@pytest.mark.parametrize("full_bias", [False, True], ids=["alibi_row", "alibi_square"])
@pytest.mark.parametrize("world", [2, 4])
def test_bloom_baddbmm_alibi_keeps_heads_sharded(world, full_bias):
    """BLOOM adds ALiBi in torch.baddbmm on the merged batch*heads dim: only bmm had a rule, so the
    fused query_key_value was gathered there. The bias ([B*H, 1, T] or [B*H, T, T]) is narrowed to
    this rank's heads; one all_reduce."""
    torch.manual_seed(0)
    report = dynashard.explain(models.BloomStyleAttention(64, 4, full_bias), torch.randn(2, 5, 64), world_size=world,
                               verify=True, options={"min_shard_numel": 0})
    assert report.layers == {"query_key_value": "colwise", "dense": "rowwise"}, str(report)
    assert [r.collectives for r in report.rows] == ["-", "all_reduce"], str(report)


def test_errors_are_dynashard_errors_and_the_builtins_users_catch():
    from dynashard.errors import DynashardError, OptionTypeError, UsageError

    with pytest.raises(UsageError, match="matches no linear") as bad_key:
        dynashard.explain(models.MLP(32, 96), torch.randn(2, 32), world_size=2, options={"plan": {"nope": "colwise"}})
    assert isinstance(bad_key.value, ValueError) and isinstance(bad_key.value, DynashardError)
    with pytest.raises(OptionTypeError) as bad_type:
        parse_options({"min_shard_numel": "many"})
    assert isinstance(bad_type.value, TypeError) and isinstance(bad_type.value, DynashardError)


def test_the_recut_fixpoint_logs_its_round_limit_and_stays_correct(monkeypatch, caplog):
    """A fused qkv needs two re-cuts (component boundaries, then whole heads). Stopped after one,
    the plan is logged as unfinished and still verifies: the layout follows the cuts it has."""
    import dynashard.plan.recut as recut

    model = models.build("nanogpt", 64, 90)
    ids = torch.randint(0, 90, (2, 7))
    options = {"min_shard_numel": 0}
    with caplog.at_level("WARNING", logger="dynashard.plan.recut"):
        dynashard.explain(model, ids, world_size=2, options=options, verify=True)
    assert not [r for r in caplog.records if "stopped re-cutting" in r.getMessage()]
    monkeypatch.setattr(recut, "_MAX_ROUNDS", 1)
    with caplog.at_level("WARNING", logger="dynashard.plan.recut"):
        dynashard.explain(model, ids, world_size=2, options=options, verify=True)
    assert [r for r in caplog.records if "stopped re-cutting after 1 rounds" in r.getMessage()]


def test_a_deep_model_is_cut_in_a_few_rounds_whatever_its_depth(caplog):
    """The same layer of every block is re-cut together: a 10-layer HF Llama (32 heads, 4 K/V heads)
    is cut in a few rounds and only the LM head gathers (its output). A walk that got only as far as
    the first block whose cut is still changing (the blocks after it see a gathered stream) would
    re-cut one block per two rounds and stop at the round limit, its last layers gathering before
    views, norms and matmuls."""
    import transformers as T

    config = T.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=10, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=1000)
    torch.manual_seed(0)
    model = models.HFLogits(T.LlamaForCausalLM(config).eval())
    with caplog.at_level("WARNING", logger="dynashard.plan.recut"):
        report = dynashard.explain(model, torch.randint(0, 1000, (1, 8)), world_size=2)
    assert not [r for r in caplog.records if "stopped re-cutting" in r.getMessage()]
    gathering = [r.fqn for r in report.rows if "all_gather" in r.collectives]
    assert gathering == ["m.lm_head"], str(report)


@pytest.mark.parametrize("world,heads,kv_heads,held,cache,dynamic", [
    (2, 8, 2, 0, False, False), (4, 8, 4, 0, False, False), (2, 8, 4, 0, True, False), (4, 8, 2, 4, False, False),
    (4, 8, 2, 4, False, True), (4, 4, 2, None, False, False)])
def test_falcon_grouped_qkv_keeps_each_rank_on_its_kv_groups(world, heads, kv_heads, held, cache, dynamic):
    """HF Falcon's new decoder architecture: q, k and v are taken out of each KV group of the fused
    output by a slice and by ``qkv[:, :, :, [-2]]`` (aten.index on a dim that is not cut). Each rank
    holds whole groups (its query heads with their k and v): one all_reduce, no gather. With fewer
    groups than ranks (2 on 4) each group is cut into its components: every rank holds its part of
    every group's query heads and all groups' k and v (``held``: K/V heads held whole), so the
    attention and ``dense`` stay cut (one all_reduce). With fewer query heads a group than ranks too
    (2 on 4) the fused projection is kept whole, saying so (and the small output projection, left
    without a sharded input, with it). K/V appended to an empty cache (HF's DynamicCache) stay on
    each rank's heads: ``cat`` skips the 1-D empty operand. Under dynamic shapes the same plan (Dynamo
    keeps full slices of the dims in front of the one taken apart)."""
    torch.manual_seed(0)
    model = models.FalconStyleAttention(128, heads, kv_heads, cache=cache)
    report = dynashard.explain(model, torch.randn(2, 5, 128), world_size=world, verify=True,
                               options={"min_shard_numel": 0}, dynamic=dynamic)
    qkv, dense = (next(r for r in report.rows if r.fqn == n) for n in ("query_key_value", "dense"))
    if held is None:
        assert qkv.style == "replicate" and "2 heads of 128 cannot be cut over 4 ranks" in qkv.reason, str(report)
    else:
        assert dense.style == "rowwise" and dense.collectives == "all_reduce", str(report)
        assert qkv.style == "colwise" and qkv.collectives == "-", str(report)
        dh = 128 // heads
        assert qkv.weight_bytes == 128 * dh * 4 * ((heads + 2 * kv_heads - held) // world + held), str(report)


def test_falcon_groups_cut_into_components_refuse_training():
    """The cut above at world 4 holds every group's k and v whole on every rank: each rank's gradient
    of them would be partial, so a backward is refused at compile time (as for any fused output with
    whole parts), naming why. (Planned on one rank of a fake group: the refusal comes before any
    collective runs.)"""
    from dynashard import _torch as private

    torch.manual_seed(0)
    model = models.FalconStyleAttention(128, 8, 2)
    torch._dynamo.reset()
    private.init_fake_process_group(4, 0)
    try:
        # (Dynamo wraps the backend's error: matched by its name and message)
        with pytest.raises(Exception, match="NotSupportedError: dynashard: training .* held whole on every rank"):
            torch.compile(model, backend="dynashard", options={"min_shard_numel": 0})(torch.randn(2, 5, 128))
    finally:
        dist.destroy_process_group()


def test_roll_call_keys_follow_each_point_not_every_failure(monkeypatch):
    """A roll call's key must be the same on every rank. A failed call's diagnosis runs only on the
    ranks whose call failed, so it must not shift the key of the next agreement on those ranks (it
    did while one counter per group numbered every roll call)."""
    from dynashard import _torch as private
    from dynashard.comm import protocol

    monkeypatch.setattr(protocol, "_SEQUENCE", {})
    store = dist.HashStore()
    monkeypatch.setattr(private, "default_store", lambda: store)
    private.init_fake_process_group(2, 0)
    try:
        group = dist.group.WORLD
        first = protocol.RollCall(group, "planning")
        protocol.RollCall(group, "failed-call-1")  # only on a rank whose call failed
        after_failure = protocol.RollCall(group, "planning")
        monkeypatch.setattr(protocol, "_SEQUENCE", {})  # a rank whose calls all succeeded
        protocol.RollCall(group, "planning")
        no_failure = protocol.RollCall(group, "planning")
        assert after_failure.key == no_failure.key != first.key
        store.set(f"{after_failure.key}/1", "1")  # the other rank arrives
        assert after_failure.missing() == []
    finally:
        dist.destroy_process_group()


def test_the_plan_follows_earlier_cuts_it_is_given_and_reads_no_store():
    """State passed, not shared: the plan is a function of (graph, options, earlier cuts passed in). The same
    graph planned with no earlier cuts, with ``up`` split on its input dim, and with ``up`` read whole by an
    earlier graph gives three plans; and a weight the store holds a shard of changes nothing unless it is passed in."""
    from dynashard import _torch as private
    from dynashard.analysis import analyse
    from dynashard.layout.split import even
    from dynashard.weights.store import STORE, EarlierCuts, ShardSpec

    def _styles(plan):
        return {m.fqn.removesuffix(".weight"): plan.decisions[m.node].style for m in plan.linears}

    torch.manual_seed(0)
    model, x, plans = models.MLP(32, 96), torch.randn(4, 32), []

    def backend(gm, example_inputs):
        fakes = private.backend_fakes(gm)
        up = next(i for i, t in enumerate(example_inputs) if t is model.up.weight)
        opts = parse_options({"min_shard_numel": 0})
        for earlier in (EarlierCuts(), EarlierCuts(split={up: (1, even(32))}), EarlierCuts(whole=frozenset([up]))):
            plans.append(_styles(analyse(gm, fakes, opts, 2, 0, earlier).plan))
        # a shard in the store, not passed in: the plan is the first one
        STORE.shard(model.up.weight, ShardSpec(1, even(32), 2, 0, "G"), "up.weight", None)
        plans.append(_styles(analyse(gm, fakes, opts, 2, 0, EarlierCuts()).plan))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    assert plans[0] == {"up": "colwise", "down": "rowwise"}, plans
    assert plans[1]["up"] == "rowwise", plans  # follows the earlier split (its full value is gone)
    assert plans[2]["up"] == "replicate", plans  # an earlier graph reads it whole
    assert plans[3] == plans[0], plans


def test_importing_dynashard_registers_nothing_with_torch_serialization():
    """No import-time registration. The tagger that refuses to save a freed storage is registered
    when dynashard first frees one; until then, importing dynashard leaves torch.save as it is."""
    import subprocess
    import sys

    code = (
        "import torch, io, dynashard, dynashard.weights.freed as w\n"
        "t = torch.zeros(0)\n"
        "setattr(t.untyped_storage(), w.FREED, True)\n"  # what a freed storage carries
        "torch.save(t, io.BytesIO())\n"  # no tagger yet: saved
        "w.mark_storage_less(torch.nn.Parameter(torch.zeros(0)))\n"  # dynashard frees its first storage
        "try:\n    torch.save(t, io.BytesIO())\n"
        "except ValueError as e:\n    print('refused:', 'cannot save' in str(e))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "refused: True", (out.stdout, out.stderr[-2000:])


def test_a_sharded_weight_another_graph_needs_whole_is_refused_naming_why():
    """A second code path reading a cut weight another way (here its norm) is refused with an error
    naming the reader (not "were the options different?", when the options are the same)."""
    from dynashard import _torch as private
    from dynashard.errors import UsageError

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = models.MLP(32, 96), torch.randn(4, 32)
    private.init_fake_process_group(2)  # graph shapes only: the fake group moves no data
    try:
        opts = {"compiler": "eager", "min_shard_numel": 0}
        with torch.no_grad():
            torch.compile(model, backend="dynashard", options=opts)(x)  # up and down cut
            norm = torch.compile(_Normed(model), backend="dynashard", options=opts)
            with pytest.raises(Exception) as info:
                norm(x)
    finally:
        dist.destroy_process_group()
    error = private.backend_error(info.value) or info.value
    assert isinstance(error, UsageError), repr(info.value)
    assert "'mlp.up.weight' was sharded by an earlier dynashard compile" in str(error), str(error)
    assert "were the options different" not in str(error), str(error)
    assert "weight is also read by aten.linalg_vector_norm.default" in str(error), str(error)


class _Normed(torch.nn.Module):
    """Another code path over the same MLP: its output scaled by the up projection's norm."""

    def __init__(self, mlp) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x) * torch.linalg.vector_norm(self.mlp.up.weight)
