"""Linears in other clothes: forms a model writes a linear in that are not ``nn.Linear``,
rewritten before matching into the form match.py reads (dynashard/capture/linear_forms.py) and then cut
like one: colwise then rowwise by the auto plan, one all_reduce per pair.

einsum: ``torch.einsum("bsd,hd->bsh", x, W)`` (W stored ``[out, in]``), ``"bsd,dh->bsh"`` (W stored
``[in, out]``) and ``"...d,hd->...h"``. Traced, each is a batch-1 ``bmm`` behind unsqueeze / permute /
view chains that differ by equation; the weight's chain is recognised by its strides (W.t() or W).
With the features before the tokens in the output (``"hd,bds->bhs"``, channels first), W is the bmm's
first operand: ``W @ x``, rewritten as ``(x^T W^T)^T``.

bmm with an expanded weight: ``torch.bmm(x, W.t().expand(B, -1, -1))`` and
``torch.bmm(x, W.unsqueeze(0).expand(B, -1, -1))``: one matrix broadcast over the batch is one linear.

Conv1d(kernel_size=1) on ``[B, C, L]`` and Conv2d(kernel_size=1) on ``[B, C, H, W]``: the weight
``[out, in, 1(, 1)]`` is cut on out-channels (colwise) or in-channels (rowwise); a conv with a wider
kernel, padding, stride or groups is left as written.

A tied autoencoder: the encoder ``F.linear(x, W)`` and the decoder ``F.linear(h, W.t())`` read one W,
the decoder as stored. The encoder colwise cuts W on dim 0, which is the decoder's input dim: it is
then rowwise on the same cut, one all_reduce, and W's gradient is the sum of both uses' (gloo).

``weight_norm(dim=d)`` (``torch.nn.utils.parametrizations``): the weight ``v * g / ||v||`` has one norm
per slice along d, so v and g cut alike on d give this rank's slices exactly: d=0 colwise, d=1 rowwise.
Cut on the other dim (across the norms), v alone is cut, g whole, and each norm's sum of squares is
every rank's partial sum all-reduced (its backward summed too); refused under inputs='per_rank'.
``dim=None`` (one norm) is left whole, the reason logged at debug level (never cut wrongly); so is the
deprecated hook form ``torch.nn.utils.weight_norm``, its reason naming the parametrization.

``spectral_norm`` (dim=0): W cut either way, its buffers u and v whole on every rank. Sigma
``vdot(u, W v)`` is every rank's term summed (a scalar all_reduce; with gradients its backward sums
too); in train mode each power step's product is made whole (its block all-gathered, or its partial
sum all-reduced), so u and v are written with the unsharded values.

Simulated at worlds 2, 3 and 4 (dims that do not divide) against the model, goldens counting the
collectives, and on 2 real gloo ranks: forward and SGD gradients (and spectral_norm's buffers)
against the unsharded twin.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dynashard
from dynashard.errors import UsageError
from dynashard.load.registered import facades as facades_of
from dynashard.weights.store import STORE, cut
from tests import models
from tests.scenarios import Scenarios
from tests.test_graphs import _count, rewritten

SCENARIOS_DEADLINE_S = 180  # one spawn at world 2: ~10 s quiet; 3x slower machine, 2x margin, plus startup
pytestmark = pytest.mark.timeout(SCENARIOS_DEADLINE_S + 60)
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=SCENARIOS_DEADLINE_S)
PAIRED = {"up": "colwise", "down": "rowwise"}


def _layers(model: nn.Module, x: torch.Tensor, world: int, **kwargs) -> dict[str, str]:
    """Style per layer; every rank simulated against the model (raises on a mismatch)."""
    report = dynashard.explain(model, x, world_size=world, options={"min_shard_numel": 0}, verify=True, **kwargs)
    return {fqn: str(style) for fqn, style in report.layers.items()}


def _collectives(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(all_reduces, all_gathers) in rank 0's rewritten graph at world 2, sizes symbolic."""
    gm = rewritten(model, x)
    return _count(gm, "all_reduce"), _count(gm, "all_gather")


class ConvMLP(nn.Module):
    """A 1x1 conv MLP on ``[B, C, L]``: Conv1d(d, 4d, 1) -> GELU -> Conv1d(4d, d, 1); with ``conv=nn.Conv2d``
    on ``[B, C, H, W]`` (``stride``: up's)."""

    def __init__(self, d: int = 16, kernel: int = 1, bias: bool = True, conv=nn.Conv1d, stride: int = 1) -> None:
        super().__init__()
        self.up = conv(d, 4 * d, kernel, padding=kernel // 2, bias=bias, stride=stride)
        self.down = conv(4 * d, d, 1, bias=bias)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class EinsumMLP(nn.Module):
    """up and down each an einsum on the weight, named ``hd`` or ``dh`` in the equation (stored so), and
    the activation, the weight's operand first or second as the equation writes it."""

    def __init__(self, up: str, down: str, d: int = 16, h: int = 40) -> None:
        super().__init__()
        self.equations = up, down
        self.up = nn.Parameter(torch.randn(*self._shape(up, d, h)) / d ** 0.5)
        self.down = nn.Parameter(torch.randn(*self._shape(down, d, h)) / h ** 0.5)

    @staticmethod
    def _shape(equation: str, d: int, h: int) -> tuple[int, int]:
        weight = next(op for op in equation.split("->")[0].split(",") if set(op) == {"h", "d"})
        return {"h": h, "d": d}[weight[0]], {"h": h, "d": d}[weight[1]]

    @staticmethod
    def _apply(equation: str, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        first = set(equation.split(",")[0]) == {"h", "d"}
        return torch.einsum(equation, w, x) if first else torch.einsum(equation, x, w)

    def forward(self, x):
        return self._apply(self.equations[1], self.down, F.gelu(self._apply(self.equations[0], self.up, x)))


class NoLinearBmm(nn.Module):
    """A bmm on a weight that is not one linear's: "reshaped", ``W.reshape(1, in, out)`` with W stored
    ``[out, in]`` (its columns are not W's rows), and "reshaped_left" the same on the left of the bmm;
    "broadcast", ``W.t().expand(B, in, 5)`` with W one row ``[1, in]`` (the expand repeats that output 5
    times, not over the batch alone)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.w = nn.Parameter(torch.randn(1 if form == "broadcast" else 40, 16) / 4)

    def forward(self, x):
        if self.form == "reshaped":
            return torch.bmm(x, self.w.reshape(1, 16, 40).expand(x.shape[0], -1, -1))
        if self.form == "reshaped_left":  # on x [B, 40, N]
            return torch.bmm(self.w.reshape(1, 16, 40).expand(x.shape[0], -1, -1), x)
        return torch.bmm(x, self.w.t().expand(x.shape[0], 16, 5))


@pytest.mark.unit
@pytest.mark.parametrize("up,down", [("bsd,hd->bsh", "bsh,dh->bsd"), ("bsd,dh->bsh", "bsh,hd->bsd"),
                                     ("...d,hd->...h", "...h,dh->...d")])
@pytest.mark.parametrize("world", [2, 3, 4])  # 40 features: 20/20, 14/13/13, 10 x 4
def test_einsum_linears_are_paired_like_nn_linear(up, down, world):
    torch.manual_seed(0)
    assert _layers(EinsumMLP(up, down), torch.randn(2, 3, 16), world) == PAIRED  # was: {} (whole)


@pytest.mark.unit
@pytest.mark.parametrize("up,down,shape", [
    ("hd,bds->bhs", "dh,bhs->bds", (2, 16, 3)), ("dh,bds->bhs", "hd,bhs->bds", (2, 16, 3)),  # channels first
    ("hd,bsd->hbs", "dh,hbs->bsd", (2, 3, 16)), ("hd,d->h", "dh,h->d", (16,)),
    ("hd,bsd->bsh", "dh,bsh->bsd", (2, 3, 16))])  # (torch's einsum puts W second in its bmm: the plain form)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_einsum_with_the_weight_first_is_paired_like_nn_linear(up, down, shape, world):
    """Features before the tokens in the output: traced as ``bmm(W, x)``, W on the left (cut, not kept whole)."""
    torch.manual_seed(0)
    assert _layers(EinsumMLP(up, down), torch.randn(*shape), world, dynamic=world == 3) == PAIRED
    assert _collectives(EinsumMLP(up, down), torch.randn(*shape)) == (1, 0)


@pytest.mark.unit
def test_einsum_linears_cost_one_all_reduce():
    torch.manual_seed(0)
    assert _collectives(EinsumMLP("bsd,hd->bsh", "bsh,dh->bsd"), torch.randn(2, 3, 16)) == (1, 0)


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])  # 64 channels: 32/32, 22/21/21, 16 x 4
@pytest.mark.parametrize("bias", [True, False])
def test_pointwise_conv1d_mlp_is_paired_like_nn_linear(world, bias):
    torch.manual_seed(0)
    assert _layers(ConvMLP(bias=bias), torch.randn(2, 16, 5), world, dynamic=world == 3) == PAIRED  # was: {}
    assert _collectives(ConvMLP(bias=bias), torch.randn(2, 16, 5)) == (1, 0)


@pytest.mark.unit
def test_a_conv1d_with_a_wider_kernel_stays_as_written():
    torch.manual_seed(0)
    assert _layers(ConvMLP(kernel=3), torch.randn(2, 16, 5), 2) == {"down": "replicate"}


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])  # 64 channels: 32/32, 22/21/21, 16 x 4
@pytest.mark.parametrize("bias", [True, False])
def test_pointwise_conv2d_mlp_is_paired_like_nn_linear(world, bias):
    """Conv2d(k=1) on NCHW: out-channels colwise, in-channels rowwise (was: whole, no collective)."""
    torch.manual_seed(0)
    model, x = ConvMLP(bias=bias, conv=nn.Conv2d), torch.randn(2, 16, 3, 5)
    assert _layers(model, x, world, dynamic=world == 3) == PAIRED
    assert _collectives(model, x) == (1, 0)


@pytest.mark.unit
@pytest.mark.parametrize("kernel,stride", [(3, 1), (1, 2)])
def test_a_conv2d_that_is_not_pointwise_stays_as_written(kernel, stride):
    torch.manual_seed(0)
    assert _layers(ConvMLP(kernel=kernel, conv=nn.Conv2d, stride=stride), torch.randn(2, 16, 4, 6), 2) == {
        "down": "replicate"}


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_tied_autoencoder_is_colwise_then_rowwise_on_one_cut(world):
    torch.manual_seed(0)
    report = dynashard.explain(models.TiedAutoencoder(16, 40), torch.randn(2, 3, 16), world_size=world,
                               options={"min_shard_numel": 0}, verify=True)
    assert [(r.fqn, str(r.style)) for r in report.rows] == [("tied", "colwise"), ("tied", "rowwise")], str(report)
    assert _collectives(models.TiedAutoencoder(16, 40), torch.randn(2, 3, 16)) == (1, 0)  # was: W whole


@pytest.mark.unit
def test_a_tied_autoencoder_under_autocast_is_cut_as_without_it():
    """Autocast converts the decoder's transposed view, ``t(_to_copy(t(W)))``: the same plan as without it
    (it kept W whole: "weight is also read by aten.t"; the fuzz found it), every rank verified. bf16: the
    outputs (O(1)) within 3e-2 of the unsharded autocast model's (8 significant bits, sums in another order)."""
    torch.manual_seed(0)
    model, x = models.TiedAutoencoder(16, 40), torch.randn(2, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = dynashard.explain(model, x, world_size=2, options={"min_shard_numel": 0}, verify=True)
    assert [(r.fqn, str(r.style)) for r in report.rows] == [("tied", "colwise"), ("tied", "rowwise")], str(report)
    assert max(g.output_err for g in report.graphs) < 3e-2, str(report)


@pytest.mark.unit
@pytest.mark.parametrize("forms", [("bmm_expand", "bmm_expand"), ("bmm_in_out", "bmm_expand"),
                                   ("bmm_expand", "bmm_in_out")])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_bmm_with_an_expanded_weight_is_paired_like_nn_linear(forms, world):
    torch.manual_seed(0)
    assert _layers(models.ClothedMLP(16, 40, *forms), torch.randn(2, 3, 16), world, dynamic=world == 3) == PAIRED
    assert _collectives(models.ClothedMLP(16, 40, *forms), torch.randn(2, 3, 16)) == (1, 0)


@pytest.mark.unit
@pytest.mark.parametrize("down,world", [(down, world) for down in ("linear", "weight_norm_in") for world in (2, 3, 4)]
                         + [pytest.param("spectral_norm", w, marks=pytest.mark.slow) for w in (2, 4)]
                         + [("spectral_norm", 3)])
def test_a_weight_without_gradient_on_a_transposed_input_is_paired(down, world):
    """``torch.matmul`` of a non-contiguous 3-D x (a 1x1 conv's output, transposed back) and a weight that
    needs no gradient (frozen, or weight_norm's or spectral_norm's under no_grad) traces ``bmm(view(expand(x)),
    view(expand(t(W))))``: one matrix in every batch, paired like nn.Linear (was: down whole)."""
    torch.manual_seed(0)
    model = models.ClothedMLP(4, 8, "conv1x1", down).requires_grad_(down != "linear")
    assert _layers(model, torch.randn(2, 3, 4), world, dynamic=world == 3) == PAIRED


@pytest.mark.unit
@pytest.mark.parametrize("form", ["reshaped", "reshaped_left", "broadcast"])
def test_a_bmm_on_a_weight_that_is_not_a_linear_is_left_as_written(form):
    torch.manual_seed(0)
    x = torch.randn(2, 40, 3) if form == "reshaped_left" else torch.randn(2, 3, 16)
    assert _layers(NoLinearBmm(form), x, 2) == {}


# bfloat16 autocast: verify's own bf16 tolerance serves bf16 models of any scale; these keep activations
# O(1), where sharded and unsharded bf16 results measured within 8e-3 of each other: 3e-2 leaves room,
# and a wrong term is O(1) (test_fuzz's bound).
BF16_ABS = 3e-2


@pytest.mark.unit
@pytest.mark.parametrize("case", ["conv1d", "conv2d", "einsum", "einsum_first", "weight_norm", "bmm_expand"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_forms_under_autocast_are_cut_as_without_it(case, world):
    """Under bf16 autocast a weight reaches its op through a conversion: the conv's W, the bmm's operand
    ``_to_copy(view(W))`` (einsum) or ``_to_copy(expand(t(W)))``; each form is cut as without autocast
    (was: whole, each)."""
    torch.manual_seed(0)
    model, shape = {"conv1d": (ConvMLP(), (2, 16, 5)), "conv2d": (ConvMLP(conv=nn.Conv2d), (2, 16, 3, 5)),
                    "einsum": (EinsumMLP("bsd,hd->bsh", "bsh,dh->bsd"), (2, 3, 16)),
                    "einsum_first": (EinsumMLP("hd,bds->bhs", "dh,bhs->bds"), (2, 16, 3)),
                    "weight_norm": (models.ClothedMLP(16, 40, "conv1x1", "weight_norm_in"), (2, 3, 16)),
                    "bmm_expand": (models.ClothedMLP(16, 40, "bmm_expand", "bmm_in_out"), (2, 3, 16))}[case]
    x, options = torch.randn(*shape), {"min_shard_numel": 0}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = dynashard.explain(model, x, world_size=world, options=options, verify=True, dynamic=world == 3)
    assert {fqn: str(s) for fqn, s in report.layers.items()} == PAIRED, str(report)
    assert max(g.output_err for g in report.graphs) < BF16_ABS, str(report)


# On real ranks, eager: each form's forward against the unsharded model, and for the tied W (read
# twice), a 1x1 conv MLP, weight_norm's v and g (cut on the norm dim; v cut across the norms, g whole)
# and spectral_norm's W (its u and v buffers too), SGD steps whose gradients equal the twin's own cut.
@on_ranks
def test_linears_in_other_clothes_on_real_ranks_equal_unsharded(rank, world):
    torch.manual_seed(0)
    for model, shape in [(EinsumMLP("bsd,hd->bsh", "bsh,dh->bsd"), (3, 5, 16)), (ConvMLP(), (3, 16, 5)),
                         (EinsumMLP("hd,bds->bhs", "dh,bhs->bds"), (3, 16, 5)),
                         (NormedMLP("weight_norm", (0, 1)), (3, 5, 16)),
                         (NormedMLP("weight_norm", (1, 0)), (3, 5, 16)),  # (across the norms, both)
                         (models.ClothedMLP(16, 40, "bmm_expand", "bmm_in_out"), (3, 5, 16))]:
        torch._dynamo.reset()
        reference = copy.deepcopy(model)
        fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0, "compiler": "eager"})
        with torch.no_grad():
            x = torch.randn(*shape)
            # float32 O(1) activations, sums of 16-64 products in another order: a few ulps
            assert float((fast(x) - reference(x)).abs().max()) <= 1e-5, type(model).__name__
        assert dynashard.held_bytes(model) < 0.6 * dynashard.held_bytes(reference), type(model).__name__
    normed = {f"{layer}.parametrizations.weight.original{i}" for layer in ("up", "down") for i in (0, 1)}  # g, v
    across = {f"{layer}.parametrizations.weight.original1" for layer in ("up", "down")}  # v (g whole)
    spectral = {f"{layer}.parametrizations.weight.original" for layer in ("up", "down")}  # (u, v: buffers, whole)
    for model, shape, sharded in [(models.TiedAutoencoder(16, 40), (3, 5, 16), {"tied"}),
                                  (ConvMLP(), (3, 16, 5), {"up.weight", "down.weight"}),
                                  (ConvMLP(conv=nn.Conv2d), (3, 16, 2, 5), {"up.weight", "down.weight"}),
                                  (NormedMLP("weight_norm", (0, 1)), (3, 5, 16), normed),
                                  (NormedMLP("weight_norm", (1, 0)), (3, 5, 16), across),
                                  (NormedMLP("spectral_norm"), (3, 5, 16), spectral)]:  # (train mode: power steps)
        torch._dynamo.reset()
        assert _sgd_gradient_error(model, shape, sharded) < GRAD_RTOL, type(model).__name__


# float32: the sharded step sums the same products in another order, forward and backward (test_training's
# bound: a few ulps of each gradient's scale measured there, 1e-4 leaves room)
GRAD_RTOL = 1e-4


def _sgd_gradient_error(model: nn.Module, shape: tuple[int, ...], sharded: set[str]) -> float:
    """Worst gradient error over 2 SGD steps against the twin, relative to each gradient's largest element,
    and of the buffers after each step (spectral_norm's u and v, written by every call in train mode)."""
    twin, example = copy.deepcopy(model), torch.randn(*shape)
    dynashard.parallelize(model, example, options={"min_shard_numel": 0, "compiler": "eager"})
    with torch.no_grad():
        twin(example)  # (parallelize ran the model once on it: its buffers moved on)
    fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0, "compiler": "eager"})
    sgd, sgd_twin = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    facades = {f"{prefix}.{attr}" if prefix else attr: facade for prefix, module in model.named_modules()
               for attr, facade in facades_of(module).items()}
    shards = dict(model.named_parameters())
    assert set(facades) >= sharded, sorted(facades)  # (else the twin is compared with itself)
    worst = 0.0
    for step in range(2):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
        fast(x).pow(2).mean().backward()
        twin(x).pow(2).mean().backward()
        for name, p in twin.named_parameters():
            g = p.grad
            if name in facades:  # sharded: compared with the same cut of the twin's gradient
                spec = STORE.spec_of(facades[name])
                g = cut(g, spec.dim, spec.split, spec.world, spec.rank)
            worst = max(worst, float((shards[name].grad - g).abs().max()) / float(g.abs().max()))
        buffers = dict(model.named_buffers())
        for name, b in twin.named_buffers():  # whole on every rank
            worst = max(worst, float((buffers[name] - b).abs().max()) / float(b.abs().max()))
        for opt in (sgd, sgd_twin):
            opt.step()
            opt.zero_grad()
    return worst


class NormedMLP(nn.Module):
    """up and down under ``torch.nn.utils.parametrizations.weight_norm`` (``dims``: each layer's dim, None
    a plain nn.Linear, "whole" weight_norm(dim=None)) or ``spectral_norm`` (``dims`` unused; ``iterations``:
    its power steps per call in train mode)."""

    def __init__(self, parametrization: str, dims: tuple = (0, 0), iterations: int = 1) -> None:
        super().__init__()
        wrap = getattr(nn.utils.parametrizations, parametrization)

        def layer(i: int, o: int, dim) -> nn.Module:
            if parametrization == "spectral_norm":
                return wrap(nn.Linear(i, o), n_power_iterations=iterations)
            return nn.Linear(i, o) if dim is None else wrap(nn.Linear(i, o), dim=None if dim == "whole" else dim)

        self.up, self.down = layer(16, 40, dims[0]), layer(40, 16, dims[1])

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


@pytest.mark.unit
@pytest.mark.parametrize("dims", [(0, None), (None, 1), (0, 1)])
@pytest.mark.parametrize("world", [2, 3, 4])  # 40 features: 20/20, 14/13/13, 10 x 4
def test_weight_norm_is_cut_on_its_norm_dim(dims, world):
    """v and g cut alike on the dim the norms are per slice of: up (dim 0) colwise, down (dim 1) rowwise.
    (dim 1 rowwise also needs the shards contiguous: torch's CPU kernel reads a strided v as contiguous.)"""
    torch.manual_seed(0)
    assert _layers(NormedMLP("weight_norm", dims), torch.randn(2, 3, 16), world, dynamic=world == 3) == PAIRED
    assert _collectives(NormedMLP("weight_norm", dims), torch.randn(2, 3, 16)) == (1, 0)  # was: whole, (0, 0)


@pytest.mark.unit
@pytest.mark.parametrize("world", [3, 4])
def test_weight_norm_on_a_rank_holding_no_slice(world):
    """2 features at worlds 3 and 4: a rank holds no slice of v and g (torch's kernel would kill the
    process on the empty v, a floating-point exception: that rank's weight is the empty v * g)."""
    torch.manual_seed(0)
    assert _layers(models.ClothedMLP(4, 2, "weight_norm", "weight_norm_in"), torch.randn(2, 3, 4), world) == PAIRED


@pytest.mark.unit
@pytest.mark.parametrize("dims,collectives", [((0, 0), (2, 0)), ((1, 1), (2, 0)), ((1, 0), (3, 0))])
@pytest.mark.parametrize("world", [2, 3, 4])  # 40 features: 20/20, 14/13/13, 10 x 4
def test_weight_norm_is_cut_across_its_norms(dims, collectives, world):
    """weight_norm(dim=0) on down (rowwise: v's columns cut) and dim=1 on up (colwise: v's rows cut): each
    norm is this rank's partial sum of squares, one all_reduce of the [out, 1] ([1, in]) vector, g whole;
    every rank equal to the model (in a training compile too: its norms' sum has a summed backward).
    Was: kept whole, and its partner with it."""
    torch.manual_seed(0)
    model, x = NormedMLP("weight_norm", dims), torch.randn(2, 3, 16)
    for train in (False, True):
        assert _layers(model, x, world, dynamic=world == 3, train=train) == PAIRED
    assert _collectives(model, x) == collectives  # the linear's all_reduce and one per cut across norms


@pytest.mark.unit
def test_weight_norm_across_its_norms_is_asked_for_and_kept_whole_under_per_rank_inputs():
    """The reversed plan (up rowwise, down colwise) cuts dim=0 on up across its norms: taken as asked.
    Under inputs='per_rank' (no summed backward for the norms there) the cut across is refused: the
    auto plan keeps that layer whole with the reason, a user plan asking for it raises."""
    torch.manual_seed(0)
    model, x = NormedMLP("weight_norm", (0, 0)), torch.randn(2, 3, 16)
    reversed_plan = {"min_shard_numel": 0, "plan": dict(REVERSED)}
    report = dynashard.explain(model, x, world_size=2, options=reversed_plan, verify=True)
    assert {fqn: str(s) for fqn, s in report.layers.items()} == REVERSED, str(report)
    per_rank = {"min_shard_numel": 0, "inputs": "per_rank"}
    report = dynashard.explain(model, x, world_size=2, options=per_rank, verify=True)
    assert str(report.layers["down"]) == "replicate", str(report)
    reason = [r.reason for r in report.rows if r.fqn == "down"][0]
    assert reason.startswith("kept whole: weight_norm(dim=0)") and "per_rank" in reason, str(report)
    with pytest.raises(UsageError, match="plan asks for rowwise on weight_norm 'down'.*inputs='per_rank'"):
        dynashard.explain(model, x, world_size=2, options={**per_rank, "plan": PAIRED})


@pytest.mark.unit
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_weight_norm_across_its_norms_of_a_fused_qkv_with_whole_parts(train):
    """weight_norm(dim=1) on a fused q|k|v (colwise, across its norms) with 2 K/V heads on 4 ranks: k and v
    are whole on every rank and their squares counted once in each norm (rank 0's), not once per rank;
    dim=0 on o_proj (rowwise, across its norms)."""
    torch.manual_seed(0)
    model = models.FusedGQAAttention(128, 8, 2)
    nn.utils.parametrizations.weight_norm(model.qkv_proj, dim=1)
    nn.utils.parametrizations.weight_norm(model.o_proj, dim=0)
    report = dynashard.explain(model, torch.randn(2, 5, 128), world_size=4, options={"min_shard_numel": 0},
                               verify=True, train=train)
    assert {fqn: str(s) for fqn, s in report.layers.items()} == {"qkv_proj": "colwise", "o_proj": "rowwise"}
    assert "held whole by every rank" in report.rows[0].reason, str(report)
    assert report.rows[0].collectives == "all_reduce", str(report)  # (its norms')


class HookNormedMLP(nn.Module):
    """up (dim=1) and down (dim=0) under the deprecated hook form ``torch.nn.utils.weight_norm``."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (its deprecation)
            self.up = nn.utils.weight_norm(nn.Linear(16, 40), dim=1)
            self.down = nn.utils.weight_norm(nn.Linear(40, 16), dim=0)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


@pytest.mark.unit
def test_weight_norm_hook_form_is_left_whole_naming_the_parametrization():
    """The hook form stores the computed weight on the module (Dynamo returns it: a graph output), so
    v is read by more than its linear: whole, the reason naming the parametrizations form, which is cut."""
    torch.manual_seed(0)
    report = dynashard.explain(HookNormedMLP(), torch.randn(2, 3, 16), world_size=2,
                               options={"min_shard_numel": 0}, verify=True)
    assert {r.fqn: str(r.style) for r in report.rows} == {"up.weight_v": "replicate", "down.weight_v": "replicate"}
    assert all("torch.nn.utils.parametrizations.weight_norm form is cut" in r.reason for r in report.rows), str(report)


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3, 4])
def test_weight_norm_over_all_of_v_is_left_whole_with_a_reason(world, caplog):
    """weight_norm(dim=None): one norm over all of v, each rank's term of it not summed: whole."""
    torch.manual_seed(0)
    with caplog.at_level("DEBUG", logger="dynashard.capture.linear_forms"):
        assert _layers(NormedMLP("weight_norm", ("whole", "whole")), torch.randn(2, 3, 16), world) == {}
    reasons = [r.getMessage() for r in caplog.records if "computed from parameters" in r.getMessage()]
    assert len(set(reasons)) == 2 and all("parametrizations.weight.original" in r for r in reasons), reasons  # up, down


def _spectral(mode: bool, world: int, plan: dict | None = None, model: nn.Module | None = None,
              x: torch.Tensor | None = None, **kwargs) -> dynashard.Report:
    """``explain(verify=True)`` of a spectral_norm MLP in train mode (``mode``) or eval mode (``plan``: the
    styles asked for; ``kwargs``: explain's)."""
    model = (model or NormedMLP("spectral_norm")).train(mode)
    options = {"min_shard_numel": 0, **({"plan": plan} if plan else {})}
    x = torch.randn(2, 3, 16) if x is None else x
    return dynashard.explain(model, x, world_size=world, options=options, verify=True, dynamic=world == 3, **kwargs)


# float32: sigma and the power steps sum the same products in another order (a few ulps of O(1) values)
SPECTRAL_ABS = 1e-5
REVERSED = {"up": "rowwise", "down": "colwise"}


@pytest.mark.unit
@pytest.mark.parametrize("world,plan,train", [  # 40 features: 20/20, 14/13/13, 10 x 4; 16: 6/5/5
    (3, None, True), (3, REVERSED, True), (4, None, False),  # (world 4 in train mode: the two tests below)
    *(pytest.param(*c, marks=pytest.mark.slow) for c in [(2, None, True), (4, None, True), (2, None, False),
                                                          (3, None, False), (3, REVERSED, False)])],
    ids=["3-train", "3-reversed-train", "4-eval", "2-train", "4-train", "2-eval", "3-eval", "3-reversed-eval"])
def test_spectral_norm_is_cut_colwise_and_rowwise(plan, train, world):
    """W cut either way, u and v whole on every rank: sigma is every rank's term of ``u . W v`` summed, and
    in train mode each power step's product is made whole, so the buffers take the unsharded values
    (graph outputs here: Dynamo returns them; each simulated rank writes a copy of its own). Was: whole."""
    torch.manual_seed(0)
    report = _spectral(train, world, plan)
    assert {fqn: str(s) for fqn, s in report.layers.items()} == (plan or PAIRED), str(report)
    assert max(g.output_err for g in report.graphs) < SPECTRAL_ABS, str(report)


@pytest.mark.unit
def test_spectral_norm_in_a_training_compile():
    """The graph a training compile emits (sigma's sum with a summed backward), two power steps a call."""
    torch.manual_seed(0)
    model = NormedMLP("spectral_norm", iterations=2)
    report = _spectral(True, 3, model=model, train=True)
    assert {fqn: str(s) for fqn, s in report.layers.items()} == PAIRED, str(report)
    assert max(g.output_err for g in report.graphs) < SPECTRAL_ABS, str(report)


@pytest.mark.unit
@pytest.mark.parametrize("train,world", [pytest.param(False, 3, marks=pytest.mark.slow), (True, 4)],
                         ids=["eval-3", "train-4"])
def test_spectral_norm_on_a_rank_holding_no_rows(train, world):
    """2 hidden features at worlds 3 and 4: a rank holds no row (up) and no column (down) of W; its term
    of sigma is 0 and its block of each power step's product empty."""
    torch.manual_seed(0)
    model = models.ClothedMLP(4, 2, "spectral_norm", "spectral_norm")
    report = _spectral(train, world, model=model, x=torch.randn(2, 3, 4))
    assert {fqn: str(s) for fqn, s in report.layers.items()} == PAIRED, str(report)
    assert max(g.output_err for g in report.graphs) < SPECTRAL_ABS, str(report)


@pytest.mark.unit
@pytest.mark.parametrize("train", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eval", "train"])
def test_spectral_norm_of_a_fused_qkv_with_whole_parts(train):
    """A fused q|k|v with 2 K/V heads on 4 ranks: k and v are whole on every rank, and counted once in
    sigma and in each power step's sum (rank 0's), not once per rank."""
    torch.manual_seed(0)
    model = models.FusedGQAAttention(128, 8, 2)
    nn.utils.parametrizations.spectral_norm(model.qkv_proj)
    report = _spectral(train, 4, model=model, x=torch.randn(2, 5, 128))
    assert {fqn: str(s) for fqn, s in report.layers.items()} == {"qkv_proj": "colwise", "o_proj": "rowwise"}
    assert "held whole by every rank" in report.rows[0].reason, str(report)
    assert max(g.output_err for g in report.graphs) < SPECTRAL_ABS, str(report)


@pytest.mark.unit
@pytest.mark.parametrize("train,collectives", [pytest.param(False, (3, 0), marks=pytest.mark.slow), (True, (5, 2))],
                         ids=["eval", "train"])
def test_spectral_norm_costs_a_scalar_all_reduce_per_layer(train, collectives):
    """Eval: sigma's scalar all_reduce per layer, plus the pair's own. Train: each power step adds one
    vector collective per product: up (rows cut) all-gathers W v and all-reduces W^T u; down (columns
    cut) all-reduces W v and all-gathers W^T u."""
    torch.manual_seed(0)
    assert _collectives(NormedMLP("spectral_norm").train(train), torch.randn(2, 3, 16)) == collectives


@pytest.mark.unit
@pytest.mark.slow
def test_spectral_norm_over_another_dim_is_left_whole_with_a_reason(caplog):
    """spectral_norm(dim=1) reads W through a permute: not a form cut here, whole with the reason logged."""
    torch.manual_seed(0)
    model = NormedMLP("spectral_norm")
    for layer in (model.up, model.down):
        nn.utils.parametrize.remove_parametrizations(layer, "weight")
        nn.utils.parametrizations.spectral_norm(layer, dim=1)
    with caplog.at_level("DEBUG", logger="dynashard.capture.linear_forms"):
        assert _layers(model, torch.randn(2, 3, 16), 2) == {}
    reasons = [r.getMessage() for r in caplog.records if "computed from parameters" in r.getMessage()]
    assert len(set(reasons)) == 2 and all("permute" in r for r in reasons), reasons
