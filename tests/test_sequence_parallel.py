"""Sequence parallelism (``options={"sequence_parallel": True}``): between the TP regions
activations are cut along the sequence; each rowwise all_reduce becomes a reduce_scatter and each
colwise input an all_gather. Checked against the unsharded model: every rank simulated at worlds
2, 3, 4 (``explain(verify=True)``, sequence lengths the world does not divide), collective counts
of the rewritten graph, refusals, and training on real gloo ranks (gradients, clipped norms, SGD).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dynashard
from dynashard import _torch as private
from dynashard.dynamo_backend import dynashard_backend
from dynashard.errors import UsageError
from dynashard.weights.store import STORE, cut
from tests import models
from tests.scenarios import Scenarios, raised
from tests.test_graphs import _count, rewritten

SP = {"sequence_parallel": True, "min_shard_numel": 0}
# one spawn at world 2: ~15 s quiet (two models, three steps each); 3x slower machine, 2x margin, plus startup
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=180)


def _llama() -> nn.Module:
    return models.LlamaDecoder(vocab=96, hidden=64, n_heads=8, n_kv_heads=4).eval()


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))


class BiasedBlocks(nn.Module):
    """Two pre-norm SwiGLU blocks (LayerNorm) whose rowwise down projection has a bias (added to
    every rank's part of the sequence: its gradient summed over the parts), the branch dropped out
    before the residual add (in train mode), a residual stream in ``[B, S, H]``."""

    def __init__(self, hidden: int = 32, ffn: int = 80, dropout: float = 0.1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(models.ResidualBlock(hidden, ffn) for _ in range(2))
        self.dropout = dropout

    def forward(self, x):
        for b in self.blocks:
            h = b.norm(x)
            x = x + F.dropout(b.down(F.silu(b.gate(h)) * b.up(h)), self.dropout, self.training)
        return x


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("seq", [8, 7])
@pytest.mark.parametrize("name", ["llama", "mlp_stack", "biased_blocks"])
def test_forward_equals_unsharded(name, seq, world):
    """Every rank simulated against the unsharded model (explain raises beyond the dtype's tolerance);
    7 tokens are cut 4/3, 3/2/2, 2/2/2/1. Every rowwise output is reduce-scattered, none all-reduced."""
    torch.manual_seed(0)
    model, x = {
        "llama": lambda: (_llama(), _ids(2, seq)),
        "mlp_stack": lambda: (models.MLPStack(32, 96, 3), torch.randn(2, seq, 32)),
        "biased_blocks": lambda: (BiasedBlocks().eval(), torch.randn(3, seq, 32)),
    }[name]()
    report = dynashard.explain(model, x, world_size=world, options=SP, verify=True)
    assert "reduce_scatter" in str(report) and "all_reduce" not in str(report), report


class SequenceOps(nn.Module):
    """Ops along the sequence on the cut residual stream: a position table added (narrowed to each
    rank's tokens), a mean over the sequence (partial sums, one all_reduce), shifted slices (carved
    pieces), a cumsum and a last-token select (gathered)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = models.MLP(32, 96), models.MLP(32, 96)
        self.pos = nn.Parameter(torch.randn(16, 32))

    def forward(self, x):
        x = x + self.a(x)
        x = x + self.pos[: x.shape[1]]
        pooled = x.mean(1, keepdim=True)
        x = x[:, 1:] + x[:, :-1]
        x = x + self.b(x) + pooled
        return x.cumsum(1), x[:, -1], x.flatten(0, 1)[3:9]


class _Logits(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(ids, use_cache=False).logits


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", ["sequence_ops", "nanogpt", "hf_llama"])
def test_more_forms_forward_equal_unsharded(name, world):
    """9 tokens (5/4, 3/3/3, 3/2/2/2): ops along the cut dim; nanoGPT's learned position embedding
    (vocab-parallel too: its output cut like the tokens'); HF Llama (its own masks, RoPE, GQA)."""
    import transformers as T

    torch.manual_seed(0)
    model, x = {
        "sequence_ops": lambda: (SequenceOps(), torch.randn(2, 9, 32)),
        "nanogpt": lambda: (models.build("nanogpt", 64, 97), torch.randint(0, 97, (2, 9))),
        "hf_llama": lambda: (_Logits(T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=96))), _ids(2, 9)),
    }[name]()
    report = dynashard.explain(model.eval(), x, world_size=world, options=SP, verify=True)
    assert "reduce_scatter" in str(report), report


@pytest.mark.unit
def test_training_conversions_forward_equals_unsharded():
    """The graph a training compile emits (reduce_scatter_to_shards, gather then copy): its forward."""
    torch.manual_seed(0)
    dynashard.explain(_llama().train(), _ids(2, 7), world_size=3, options=SP, verify=True, train=True)


@pytest.mark.unit
def test_a_sequence_shorter_than_the_world_is_not_cut():
    """3 tokens on 4 ranks: a merged cut would leave a rank without rows, so the sums are all-reduced."""
    torch.manual_seed(0)
    dynashard.explain(_llama(), _ids(2, 3), world_size=4, options=SP, verify=True)
    gm = _rewritten(_llama(), _ids(2, 3), 4, sequence_parallel=True)
    assert (_count(gm, "all_reduce"), _count(gm, "reduce_scatter"), _count(gm, "all_gather")) == (5, 0, 0)


def _rewritten(model: nn.Module, x: torch.Tensor, world: int, **options) -> torch.fx.GraphModule:
    """Rank 0's rewritten graph on a fake group, sizes static (as sequence_parallel needs)."""
    return rewritten(model, x, world, dynamic=False, **options)


@pytest.mark.unit
def test_collectives_per_layer():
    """Llama, 2 layers at world 3, 7 tokens: without SP one all_reduce per rowwise linear and the
    vocab-parallel embedding (5). With SP none: a reduce_scatter for each of them (the embedding's is
    where the cut enters), an all_gather before each colwise group (q/k/v, gate/up: 2 per layer) and
    one for the LM head's input (left whole: 64 < 256 features), where the cut leaves."""
    torch.manual_seed(0)
    model, x = _llama(), _ids(2, 7)
    plain = _rewritten(model, x, 3)
    assert (_count(plain, "all_reduce"), _count(plain, "reduce_scatter"), _count(plain, "all_gather")) == (5, 0, 0)
    sp = _rewritten(model, x, 3, sequence_parallel=True)
    assert (_count(sp, "all_reduce"), _count(sp, "reduce_scatter"), _count(sp, "all_gather")) == (0, 5, 5)
    # between the regions each rank holds its 3 of the 7 tokens: the norms' inputs are [2, 3, 64]
    norms = [n for n in sp.graph.nodes if n.target is torch.ops.aten.rsqrt.default]
    assert norms and all(tuple(n.meta["val"].shape) == (2, 3, 1) for n in norms), [n.meta["val"].shape for n in norms]


def _step_collectives(monkeypatch, model: nn.Module, x: torch.Tensor, world: int) -> dict[str, dict[str, int]]:
    """Collectives by kind in the forward and backward graphs AOTAutograd makes of one training step
    (the output's mean square) on rank 0 of a fake group (test_training_graphs.py's capture, with SP)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: dict[str, torch.fx.GraphModule] = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def compile_graph(compiler, gm, example_inputs, mode="default", **kwargs):  # (Inductor's partitioner)
        return aot_module_simplified(gm, example_inputs, fw_compiler=capture("forward"),
                                     bw_compiler=capture("backward"), partition_fn=min_cut_rematerialization_partition)

    monkeypatch.setattr(private, "compile_graph", compile_graph)
    torch._dynamo.reset()
    private.init_fake_process_group(world, 0)
    try:
        fast = torch.compile(model, backend=lambda gm, ex: dynashard_backend(gm, ex, SP), dynamic=False)
        fast(x).float().pow(2).mean().backward()
    finally:
        dist.destroy_process_group()
    kinds = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter"}
    counts = {k: {kind: sum(1 for n in gm.graph.nodes if n.op == "call_function" and "_c10d_functional" in str(n.target)
                            and op in str(n.target)) for kind, op in kinds.items()} for k, gm in graphs.items()}
    out = next(n for n in graphs["forward"].graph.nodes if n.op == "output")
    saved = [tuple(a.meta["val"].shape) for a in out.args[0] if isinstance(a, torch.fx.Node)
             and isinstance(a.meta.get("val"), torch.Tensor)]
    return counts, saved


@pytest.mark.unit
def test_training_step_collectives(monkeypatch):
    """Llama, 2 layers at world 3, 7 tokens, one training step, AOTAutograd's min-cut partition (as
    Inductor and aot_eager partition). Forward as inference: 5 reduce_scatters, 5 all_gathers. Backward,
    Megatron's: an all_gather for each reduce_scatter, each colwise input gathered again (4; the LM
    head's input, read whole, is saved) and reduce-scattered back (4), one all_reduce per norm weight
    (5: each rank's gradient of it is its tokens' part). Saved for the backward: the gathered inputs
    (``[14, 64]``) only for the LM head; this rank's 3 tokens (``[2, 3, 64]``) otherwise."""
    torch.manual_seed(0)
    counts, saved = _step_collectives(monkeypatch, _llama().train(), _ids(2, 7), 3)
    assert counts["forward"] == {"all_reduce": 0, "all_gather": 5, "reduce_scatter": 5}, counts
    assert counts["backward"] == {"all_reduce": 5, "all_gather": 9, "reduce_scatter": 4}, counts
    assert saved.count((14, 64)) == 1 and saved.count((2, 3, 64)) >= 4, saved


@pytest.mark.unit
def test_options_refused():
    assert "inputs='per_rank'" in str(raised(lambda: dynashard.explain(
        models.MLP(), torch.randn(2, 4, 32), world_size=2, options={"sequence_parallel": True, "inputs": "per_rank"})))
    assert "expected True or False" in str(raised(lambda: dynashard.explain(
        models.MLP(), torch.randn(2, 4, 32), world_size=2, options={"sequence_parallel": 1})))


@pytest.mark.unit
def test_a_symbolic_sequence_length_is_refused_at_compile():
    error = raised(lambda: dynashard.explain(models.MLPStack(), torch.randn(2, 5, 32), world_size=2, options=SP,
                                             dynamic=True))
    assert isinstance(error, UsageError) and "dynamic=False" in str(error), error


@pytest.mark.unit
def test_dropout_of_the_cut_residual_stream_keeps_the_cut():
    """Each rank draws the whole mask (the unsharded model's, from the same seed: the gloo scenario
    trains through it) and keeps its part: no gather before the dropout, the cut reaches the next
    block's colwise input (its one all_gather) as without dropout."""
    torch.manual_seed(0)
    report = str(dynashard.explain(BiasedBlocks().train(), torch.randn(2, 5, 32), world_size=2, options=SP, train=True))
    assert "native_dropout" not in report, report
    assert "blocks.1.down  32x80   rowwise  all_gather (before output), reduce_scatter" in report, report


# float32: the sharded matmuls and the norms' gradient sums (over each rank's tokens, then over the
# ranks) add the same terms in another order; over 3 SGD steps the differences stay at a few ulps of
# each gradient's scale (measured < 1e-6 relative). 1e-4 leaves room for other thread counts.
GRAD_RTOL = 1e-4
# Llama under aot_eager (AOTAutograd's forward and backward graphs, which Inductor would compile), the
# blocks with dropout under eager
COMPILERS = {"llama": "aot_eager", "biased_blocks": "eager"}


@on_ranks(cases=["llama", "biased_blocks"])
def test_sgd_steps_match_the_unsharded_twin(rank, world, case):
    """3 SGD steps with clipping at 7 then 6 then 7 tokens (cut 4/3, 3/3): raw gradients of every
    parameter (the shards against the twin's cut, the norms' and the bias's whole), the clipped
    norm, the loss and the parameters after the steps equal the unsharded twin's; BiasedBlocks
    trains with dropout 0.1 on its residual branches, the twin's masks drawn from the same seed."""
    model = _llama() if case == "llama" else BiasedBlocks()
    model.train()
    twin = copy.deepcopy(model)

    def batch(step):
        seq = (7, 6, 7)[step]
        if case == "llama":
            return _ids(2, seq, step), _ids(2, seq, 50 + step)
        return torch.randn(3, seq, 32, generator=torch.Generator().manual_seed(step)), None

    def loss_of(net, x, target):
        out = net(x)
        return out.pow(2).mean() if target is None else F.cross_entropy(out.flatten(0, 1), target.flatten())

    options = {**SP, "compiler": COMPILERS[case]}
    dynashard.parallelize(model, batch(0)[0], options=options)
    fast = torch.compile(model, backend=dynashard.backend(**options), dynamic=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05)
    facades = {n: f for n, f in _facades(model).items()}
    reference = dict(twin.named_parameters())
    grad_err, loss_err, norms = 0.0, 0.0, []
    for step in range(3):
        x, target = batch(step)
        torch.manual_seed(1000 + step)  # the same dropout masks on both sides (BiasedBlocks)
        loss = loss_of(fast, x, target)
        torch.manual_seed(1000 + step)
        loss_twin = loss_of(twin, x, target)
        loss.backward()
        loss_twin.backward()
        loss_err = max(loss_err, abs(float(loss) - float(loss_twin)) / abs(float(loss_twin)))
        for name, p in model.named_parameters():
            want = reference[name].grad
            if name in facades:
                spec = STORE.spec_of(facades[name])
                want = cut(want, spec.dim, spec.split, spec.world, spec.rank)
            grad_err = max(grad_err, float((p.grad - want).abs().max()) / float(want.abs().max()))
        max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in twin.parameters()]))
        norms.append((float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)),
                      float(torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm))))
        opt.step()
        opt_twin.step()
        opt.zero_grad()
        opt_twin.zero_grad()
    param_err = 0.0
    for name, p in model.named_parameters():
        want = reference[name].detach()
        if name in facades:
            spec = STORE.spec_of(facades[name])
            want = cut(want, spec.dim, spec.split, spec.world, spec.rank)
        param_err = max(param_err, float((p.detach() - want).abs().max()))
    assert grad_err < GRAD_RTOL, grad_err
    assert all(abs(a - b) <= 1e-5 * b for a, b in norms), norms
    assert loss_err < 1e-5 and param_err < 1e-5, (loss_err, param_err)


def _facades(model) -> dict:
    from dynashard.load.registered import facades as facades_of

    out = {}
    for prefix, module in model.named_modules():
        for attr, facade in facades_of(module).items():
            out[f"{prefix}.{attr}" if prefix else attr] = facade
    return out
