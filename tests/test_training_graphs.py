"""Collectives of a training step, forward and backward, counted in the graphs AOTAutograd makes
of the rewritten graph, on torch's ``fake`` process group (one process, no data moved).

Megatron's count, which the rewrite must meet exactly: a colwise/rowwise pair costs one all_reduce
forward (g, after the rowwise layer) and one backward (f, before the colwise layer, when its input
needs a gradient, as a norm's output does); a vocab-parallel embedding one all_reduce forward, none
backward; logits gathered for the output one all_gather forward, and a narrow backward; loss
parallel one all_gather of ``[tokens, 2 x world]`` forward and nothing backward. The numerics of the
same programs are checked on real ranks in test_training.py.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dynashard import _torch as private
from dynashard.dynamo_backend import dynashard_backend
from tests import models

pytestmark = pytest.mark.unit

_KINDS = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter",
          "all_to_all": "all_to_all"}


def _collectives(gm: torch.fx.GraphModule) -> tuple[collections.Counter, list[tuple[int, ...]]]:
    """Collectives by kind, and the output shapes of the all_gathers."""
    counts, gathered = collections.Counter(), []
    for node in gm.graph.nodes:
        name = str(node.target) if node.op == "call_function" else ""
        for kind, op in _KINDS.items():
            if "_c10d_functional" in name and op in name:
                counts[kind] += 1
                if kind == "all_gather":
                    gathered.append(tuple(node.meta["val"].shape))
    return counts, gathered


def step_graphs(monkeypatch, model: nn.Module, *args, world: int = 2, **options) -> dict[str, torch.fx.GraphModule]:
    """The forward and backward graphs of one training step of ``model(*args)`` (a scalar loss, or
    the output's mean square) on rank 0 of a fake group of ``world`` ranks; ``options``: dynashard's, besides
    ``min_shard_numel=0``."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: dict[str, torch.fx.GraphModule] = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def compile_graph(compiler, gm, example_inputs, mode="default", **kwargs):  # (on_backward_error: unused)
        return aot_module_simplified(gm, example_inputs, fw_compiler=capture("forward"),
                                     bw_compiler=capture("backward"))

    monkeypatch.setattr(private, "compile_graph", compile_graph)
    torch._dynamo.reset()
    private.init_fake_process_group(world, 0)
    try:
        fast = torch.compile(model, backend=lambda gm, ex: dynashard_backend(gm, ex, {"min_shard_numel": 0, **options}))
        out = fast(*args)
        (out if out.dim() == 0 else out.float().pow(2).mean()).backward()
    finally:
        dist.destroy_process_group()
    assert set(graphs) == {"forward", "backward"}, f"expected one forward and one backward graph, got {set(graphs)}"
    return graphs


class WithLoss(nn.Module):
    """``F.cross_entropy`` of a token model's logits inside the compiled graph."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids, target):
        return F.cross_entropy(self.lm(ids).flatten(0, 1), target.flatten())


def test_a_colwise_rowwise_pair_costs_one_all_reduce_each_way(monkeypatch):
    """Pre-norm residual SwiGLU: g after ``down`` forward, f before ``gate``/``up`` backward (the
    LayerNorm's gradients need every rank's part); one f for both readers of the norm's output."""
    torch.manual_seed(0)
    graphs = step_graphs(monkeypatch, models.ResidualBlock(32, 80), torch.randn(2, 5, 32))
    assert _collectives(graphs["forward"])[0] == {"all_reduce": 1}
    assert _collectives(graphs["backward"])[0] == {"all_reduce": 1}


def test_a_colwise_bias_is_held_cut_so_its_gradient_needs_no_collective(monkeypatch):
    """An MLP with biases on a plain input (no gradient wanted): forward the one all_reduce of
    ``down``; backward nothing at all. ``up``'s bias is this rank's features' part, so its gradient
    is local (held whole and narrowed in the graph, it would be all-reduced every step)."""
    torch.manual_seed(0)
    graphs = step_graphs(monkeypatch, models.MLP(32, 96), torch.randn(2, 5, 32))
    assert _collectives(graphs["forward"])[0] == {"all_reduce": 1}
    assert _collectives(graphs["backward"])[0] == {}


def test_a_decoder_costs_megatrons_collectives(monkeypatch):
    """Llama, 2 layers, logits out (hidden 256: a colwise LM head pays for its gather): forward one
    all_reduce for the vocab-parallel embedding and one per attention and per MLP, one all_gather of
    the logits; backward one all_reduce per attention and per MLP input and one for the LM head's
    input, and no gather (the gather's backward narrows)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 7))
    graphs = step_graphs(monkeypatch, models.build("llama", 256, 96), ids)
    forward, gathered = _collectives(graphs["forward"])
    assert forward == {"all_reduce": 1 + 2 * 2, "all_gather": 1}
    assert gathered == [(2 * 2, 7, 48)]  # [world * batch, tokens, vocab / world]: the logits
    assert _collectives(graphs["backward"])[0] == {"all_reduce": 2 * 2 + 1}


def test_loss_parallel_gathers_two_numbers_per_token_and_nothing_backward(monkeypatch):
    """The same decoder with its cross-entropy in the graph: the logits stay sharded, one all_gather
    of ``[tokens, 2 x world]`` (each rank's log-sum-exp and target logit) replaces the logits'
    gather, and the backward has no collective beyond the f of each colwise input."""
    torch.manual_seed(0)
    ids, target = torch.randint(0, 96, (2, 7)), torch.randint(0, 96, (2, 7))
    graphs = step_graphs(monkeypatch, WithLoss(models.build("llama", 64, 96)), ids, target)
    forward, gathered = _collectives(graphs["forward"])
    assert forward == {"all_reduce": 1 + 2 * 2, "all_gather": 1}
    assert gathered == [(2 * 2 * 7, 2)]  # [world * tokens, 2], never [.., vocab]
    assert _collectives(graphs["backward"])[0] == {"all_reduce": 2 * 2 + 1}


def test_loss_parallel_with_a_tied_head_at_world_4(monkeypatch):
    """nanoGPT (fused qkv, the LM head tied to the vocab-parallel token embedding, 97 tokens on 4
    ranks: 25/24/24/24; a vocab-parallel position embedding) with its loss in the graph: one small
    all_gather, and per block the pair counts of the decoder, its colwise biases' gradients local."""
    torch.manual_seed(0)
    ids, target = torch.randint(0, 97, (2, 7)), torch.randint(0, 97, (2, 7))
    graphs = step_graphs(monkeypatch, WithLoss(models.build("nanogpt", 64, 97)), ids, target, world=4)
    forward, gathered = _collectives(graphs["forward"])
    assert forward == {"all_reduce": 2 + 2 * 2, "all_gather": 1}, forward  # token and position embeddings
    assert gathered == [(4 * 2 * 7, 2)]
    # nanoGPT's colwise layers have biases, held cut like their outputs (as Megatron holds them): their
    # gradients stay local, with no all_reduce (held whole and narrowed, c_attn's and c_fc's would each
    # add one per block)
    assert _collectives(graphs["backward"])[0] == {"all_reduce": 2 * 2 + 1}


def test_compiling_again_leaves_no_conversion_registered(monkeypatch):
    """A training compile traces each conversion (f, g, a gather) as a marker keyed in
    ``state.CONVERSIONS`` only while it traces: compiling the same model again (a recompile, after a reset)
    adds nothing that stays, however often it runs (tests/test_process_state.py: keys per compile)."""
    from dynashard import state

    for _ in range(3):
        torch.manual_seed(0)
        graphs = step_graphs(monkeypatch, models.ResidualBlock(32, 80), torch.randn(2, 5, 32))
        assert _collectives(graphs["forward"])[0] == {"all_reduce": 1}  # g after down (f: in the backward)
        assert state.CONVERSIONS == {}, state.CONVERSIONS


def test_explain_verifies_a_training_compiles_conversions(monkeypatch):
    """``explain(verify=True, train=True)`` runs the rewrite of a training compile, whose
    conversions (Megatron's f, g and gather) go through the same communicator as inference: a
    Llama with loss parallel verifies, and a wrong g (no sum) is caught only in that mode."""
    import dynashard
    import dynashard.report.simulate as simulate

    torch.manual_seed(0)
    model = WithLoss(models.build("llama", 64, 96))
    ids, target = torch.randint(0, 96, (2, 7)), torch.randint(0, 96, (2, 7))
    options = {"min_shard_numel": 0}
    dynashard.explain(model, ids, target, world_size=2, options=options, verify=True, train=True)
    monkeypatch.setattr(simulate.SimulatedCollectives, "reduce_from_shards", lambda self, x, group_name: x)
    dynashard.explain(model, ids, target, world_size=2, options=options, verify=True)  # (inference: no g)
    with pytest.raises(RuntimeError, match="differs from the model"):
        dynashard.explain(model, ids, target, world_size=2, options=options, verify=True, train=True)


def test_a_sequence_parallel_gather_keeps_its_layout_into_the_bound_graph(monkeypatch):
    """sequence_parallel, 2 positions on 2 ranks, two pre-norm residual blocks: block 2's colwise input is
    this rank's position of ``[batch * positions, hidden]``, gathered with the batch merged in front, then
    flattened back. The gather's output is laid out as its blocks land (not contiguous): a marker traced as
    contiguous made that flatten a ``view``, which the bound graph could not take ("Cannot view a tensor
    with shape [10, 2, 2] and strides (2, 1, 20)": an internal error at the first training step). Per block
    Megatron's sequence-parallel count in the forward: each down's reduce_scatter and the gathers of block
    2's input and of the output (block 1 reads ``x``, whole on every rank)."""
    torch.manual_seed(0)
    stack = nn.Sequential(models.ResidualBlock(10, 26), models.ResidualBlock(10, 26))
    graphs = step_graphs(monkeypatch, stack, torch.randn(2, 2, 10), sequence_parallel=True)
    assert _collectives(graphs["forward"])[0] == {"all_gather": 2, "reduce_scatter": 2}
    # backward: the two reduce_scatters' all_gathers and block 2's input gathered again for its weights'
    # gradients (Megatron's regather: 3); block 2's gather's reduce_scatter; all_reduces of the gradients
    # each rank holds for its own positions only: block 1's f (its input, x, is whole on every rank), the
    # norm's weight and bias of block 2 and the down biases of both (5)
    assert _collectives(graphs["backward"])[0] == {"all_gather": 3, "reduce_scatter": 1, "all_reduce": 5}


def _programs(monkeypatch, model: nn.Module, x: torch.Tensor, world: int, ranks: tuple[int, ...],
              **options) -> list[dict[str, list[str]]]:
    """Per rank in ``ranks`` of a fake group of ``world``: the collectives, in order, of the forward and backward
    graphs the product's own compile path (``compile_graph``, aot_eager: AOTAutograd's min-cut partitioner) makes
    of one training step."""
    from torch._dynamo.backends import debugging

    nop, programs = debugging.boxed_nop, []
    for rank in ranks:
        graphs: dict[str, list[str]] = {}

        def capture(gm, example_inputs, graphs=graphs):
            kind = "backward" if "forward" in graphs else "forward"
            graphs[kind] = [str(n.target) for n in gm.graph.nodes
                            if n.op == "call_function" and "_c10d_functional" in str(n.target)
                            and "wait_tensor" not in str(n.target)]
            return nop(gm, example_inputs)

        monkeypatch.setattr(debugging, "boxed_nop", capture)
        torch._dynamo.reset()
        private.init_fake_process_group(world, rank)
        try:
            fast = torch.compile(copy.deepcopy(model), backend=lambda gm, ex: dynashard_backend(
                gm, ex, {"min_shard_numel": 0, "compiler": "aot_eager", **options}))
            fast(x).float().pow(2).mean().backward()
        finally:
            dist.destroy_process_group()
        assert set(graphs) == {"forward", "backward"}, f"rank {rank}: expected a forward and a backward, got {graphs}"
        programs.append(graphs)
    return programs


def test_every_rank_issues_the_same_collectives_where_its_pieces_coincide(monkeypatch):
    """Falcon's grouped qkv, 6 heads in 2 K/V groups on 3 ranks, sequence parallel: rank 0 holds the K/V heads
    and every rank gathers K and V from it; ranks 1 and 2 hold none, so the two gathers they join are of the same
    empty piece, padded alike. AOTAutograd's partitioner runs CSE on the joint graph first and merged those two
    into one on ranks 1 and 2 only: 4 all_gathers forward on rank 0, 3 on the others -- on real ranks a hang or
    gloo's "Received data size doesn't match expected size" (an abort), or, where sizes agree, data swapped
    between collectives (found by tests/test_training_fuzz.py, FUZZ_SEED=3, world 3, case 6). Every rank's forward
    and backward must issue the same collectives, in the same order."""
    torch.manual_seed(0)
    model = models.FalconStyleAttention(24, 6, 2)
    # (rank 2 holds what rank 1 holds)
    programs = _programs(monkeypatch, model, torch.randn(3, 9, 24), 3, (0, 1), sequence_parallel=True,
                         plan={"query_key_value": "colwise", "dense": "colwise"})
    assert programs[0]["forward"].count("_c10d_functional.all_gather_into_tensor.default") == 4, programs[0]
    for rank, program in enumerate(programs[1:], 1):
        assert program == programs[0], f"rank {rank}'s collectives differ from rank 0's:\n{program}\n{programs[0]}"


def test_a_training_compile_keeps_the_cuts_parallelize_made():
    """parallelize plans without gradients and cuts (and frees) the weights; a training compile of the same model
    then plans a graph of other ops (SDPA's CPU flash kernel, for its backward) and must cut every weight as they
    were cut. DiffLlama's attention (8 heads in two halves, 4 K/V heads) at world 3: parallelize deals q_proj's
    half-heads 2/1/1 (units of 8 rows), the training plan asked for whole GQA pairs (units of 16), and the training
    compile raised on every rank ("'attn.q_proj.weight' was sharded as ... and this graph needs ..."; found by
    tests/test_checkpoint_fuzz.py). Now a weight an earlier graph cut keeps that cut in the plan, and an op needing
    another one gathers. Checked on each rank's compile (fake group), then the training plan given parallelize's cuts,
    every rank simulated against the model (``simulate.verify``, Megatron's conversions included)."""
    import dynashard
    from dynashard.analysis import analyse_ranks
    from dynashard.options import parse_options
    from dynashard.report import simulate
    from dynashard.weights.store import STORE, EarlierCuts

    options = {"min_shard_numel": 0, "compiler": "eager"}
    for rank in range(3):
        torch._dynamo.reset()
        private.init_fake_process_group(3, rank)
        try:
            torch.manual_seed(0)
            model, x = _DiffBlock(), torch.randn(1, 2, 64)
            dynashard.parallelize(model, x, options=options)
            cut = {n: STORE.spec_of(p) for n, p in _facades(model).items()}
            torch.compile(model, backend="dynashard", options=options)(x).sum().backward()
            assert {n: STORE.spec_of(p) for n, p in _facades(model).items()} == cut
            assert dict(model.named_parameters())["attn.q_proj.weight"].grad is not None  # (the shard's)
        finally:
            dist.destroy_process_group()
            torch._dynamo.reset()

    private.init_fake_process_group(3, 0)
    opts, found = parse_options(options), {}

    def capture(gm, example_inputs):  # (analysed here: Dynamo drops its placeholders' sources after the compile)
        fakes = private.backend_fakes(gm)
        if "cuts" not in found:  # parallelize's graph, without gradients: the cuts it makes
            (first,) = analyse_ranks(gm, fakes, opts, 3, [0], EarlierCuts())
            found["cuts"] = {id(example_inputs[i]): (dim, split)
                             for i, (_, dim, split) in first.sharded_inputs().items()}
            return gm.forward
        slot = {id(t): i for i, t in enumerate(example_inputs)}
        earlier = found["earlier"] = EarlierCuts(split={slot[k]: cut for k, cut in found["cuts"].items()})
        analyses = found["analyses"] = analyse_ranks(gm, fakes, opts, 3, range(3), earlier)
        found["verified"] = simulate.verify(analyses, example_inputs, train=True)
        return gm.forward

    try:
        torch.manual_seed(0)
        model, x = _DiffBlock(), torch.randn(1, 2, 64)
        with torch.no_grad():
            torch.compile(model, backend=capture)(x)
        torch._dynamo.reset()
        torch.compile(model, backend=capture)(x)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    earlier = found["earlier"]
    assert any(s.parts == (4, 4) and s.unit == 8 for _, s in earlier.split.values()), earlier  # (q's half-heads)
    for a in found["analyses"]:  # every rank's training plan cuts every weight as parallelize cut it
        assert {i: (dim, split) for i, (_, dim, split) in a.sharded_inputs().items()} == earlier.split
    errors, out_error, scale = found["verified"]
    # (float32: the sharded sums in another order; a weight read with another cut is off by its own scale)
    assert out_error < 1e-5 * max(1.0, scale[None]) and all(e < 1e-4 for e in errors.values()), (errors, out_error)


class _DiffBlock(nn.Module):
    """DiffLlama's attention with its RoPE tables and a residual (tests/test_fuzz.py's transformer form)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = models.DiffAttention(64, 8, 4, repeat="expand")
        cos, sin = models.rope_tables(8, 16, False)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        return x + self.attn(x, self.cos, self.sin)


def _facades(model: nn.Module) -> dict[str, torch.Tensor]:
    from dynashard.load.registered import facades

    return {f"{prefix}.{a}" if prefix else a: f for prefix, module in model.named_modules()
            for a, f in facades(module).items()}
