"""What a matched linear is: one :class:`LinearMatch` record, whatever form the model wrote it in.

Every matcher (``match.py`` and the ``match_*`` modules beside it) builds these records; the plan, the
rules and the rewrite read them. A :class:`LinearKind` says what the computation is (dense, embedding,
experts, weight_norm, spectral_norm, group-quantized); nothing downstream asks for its name.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx

from dynashard.capture.match_normed import Spectral
from dynashard.capture.match_quantized import Dequantized, Scaled, groups_of
from dynashard.layout.split import Split


class LinearKind:
    """What a matched computation is: the plan, the rules and the checks ask it, never its name.
    A dense linear (``nn.Linear``, ``x @ W.t()``, Conv1D) is the base kind."""

    name = "linear"
    weight_dims = 0  # weight dims in front of [out, in] (experts: one per expert)
    cuts_bias = True  # a colwise bias only colwise layers read is held cut with the weight
    experts = False  # one weight per expert: a loop's uses W[e] are re-cut together

    def __str__(self) -> str:
        return self.name

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        """Why this kind stays whole under weights="per_rank" (``stacked``) or inputs="per_rank"."""
        return None

    def auto_style(self, reduce: str) -> tuple[str, str] | None:
        """The auto plan's style and reason for this kind whatever its input (None: by pairing)."""
        return None

    def sparse(self, node: torch.fx.Node) -> bool:
        """Its backward makes sparse gradients (``embedding(..., sparse=True)``)."""
        return False

    def refused_dim(self, dim: int, per_rank: bool = False) -> str | None:
        """Why this kind's weight may not be cut on its ``dim`` (None: it may); ``per_rank``: under
        inputs="per_rank"."""
        return None

    def cuts_companions(self, dim: int) -> bool:
        """Whether the parameters its path reads besides the weight (``companions``) are cut with the
        weight when it is cut on ``dim``."""
        return True

    def refused_world(self, dim: int, world: int) -> str | None:
        """Why its weight may not be cut on ``dim`` over ``world`` ranks (None: it may)."""
        return None

    def refused_input(self, split: Split, world: int) -> str | None:
        """Why the auto plan should not cut it rowwise on an input cut by ``split`` (None: it may)."""
        return None

    def companion_split(self, dim: int, in_dim: int, split: Split, world: int) -> Split:
        """How the companions are cut when the weight is cut by ``split`` on ``dim`` (``in_dim``: its input dim)."""
        return split


class Embedding(LinearKind):
    """A lookup is ``one_hot(ids) @ W``, W stored ``[in=vocab, out]``: rowwise is vocab-parallel."""

    name = "embedding"
    cuts_bias = False

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        return "with weights='per_rank' every rank's own embedding stays whole" if stacked else None

    def auto_style(self, reduce: str) -> tuple[str, str] | None:
        return "rowwise", f"vocab-parallel embedding: masked local lookup, one {reduce}"

    def sparse(self, node: torch.fx.Node) -> bool:
        return embedding_options(node)[2]


class Experts(LinearKind):
    """One ``[out, in]`` weight per expert in a 3-D parameter, cut alike in every expert."""

    name = "experts"
    weight_dims = 1
    cuts_bias = False
    experts = True

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        if stacked or per_rank:
            return f"experts do not support {'weights' if stacked else 'inputs'}='per_rank' yet"
        return None


class WeightNormed(LinearKind):
    """``weight_norm``'s v and g (match_normed.py): v and g cut alike on the dim its norms are per slice
    of; v cut on the other dim (across the norms), g whole, and each norm's sum of squares all-reduced."""

    name = "weight_norm"

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        return "weight_norm's v and g stay whole under weights='per_rank'" if stacked else None

    def refused_dim(self, dim: int, per_rank: bool = False) -> str | None:
        if dim == self.dim or not per_rank:
            return None
        return (f"weight_norm(dim={self.dim}) divides each slice by a norm summed over weight dim {dim}, "
                f"and a cut there sums the norms over the ranks, which inputs='per_rank' does not support "
                f"(a cut on dim {self.dim} is exact)")

    def cuts_companions(self, dim: int) -> bool:
        return dim == self.dim  # (g is [out, 1] or [1, in]: nothing of it lies along the other dim)


class SpectralNormed(LinearKind):
    """``spectral_norm``'s W (match_normed.py): cut either way, sigma and the power steps on the cut."""

    name = "spectral_norm"

    def __init__(self, reads: Spectral) -> None:
        self.reads = reads

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        if stacked or per_rank:
            return f"spectral_norm's W stays whole under {'weights' if stacked else 'inputs'}='per_rank'"
        return None


class GroupQuantized(LinearKind):
    """An integer weight dequantized by groups of input columns (match_quantized.py): its scale and zero point
    (``companions``, ``[out, in / group]``) cut with its rows, or with its columns in whole groups."""

    name = "group-quantized"

    def __init__(self, source: Dequantized) -> None:
        self.source, self.group = source, source.group

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        if self.source.refused is not None:
            return self.source.refused
        if stacked or per_rank:
            return (f"quantized by groups of {self.group} input columns: kept whole under "
                    f"{'weights' if stacked else 'inputs'}='per_rank' (cut under the default 'replicated')")
        return None

    def refused_world(self, dim: int, world: int) -> str | None:
        groups = self.source.qdata.meta["val"].shape[1] // self.group
        if dim == 1 and groups < world:  # (its columns: [out, in] qdata)
            return (f"its {groups} group(s) of {self.group} input columns (the unit of its quantization) cannot give "
                    f"all {world} ranks some")
        return None

    def refused_input(self, split: Split, world: int) -> str | None:
        if groups_of(split, self.group, world) is not None:
            return None
        k = math.lcm(split.unit, self.group) // split.unit
        coarser = split.coarsen(k)
        if coarser is not None and coarser.fewest_units(world) >= 1:
            return None  # (plan/rules/quantized.py asks its input's origins for whole groups)
        return (f"quantized by groups of {self.group} input columns, and its input cannot be cut in whole groups "
                f"over {world} ranks ({split.size} features in units of {split.unit})")

    def companion_split(self, dim: int, in_dim: int, split: Split, world: int) -> Split:
        """How the scale and zero point are cut when the weight is cut by ``split`` on ``dim``."""
        if dim != in_dim:
            return split
        groups = groups_of(split, self.group, world)
        assert groups is not None, f"columns cut across groups of {self.group}: {split}"  # (plan/rules/quantized.py)
        return groups


class Float8Scaled(LinearKind):
    """A float8 weight dequantized before the matmul (match_quantized.py, ``scaled_source``): its ``[out, 1]``
    scales (``companions``) cut with its rows, held whole when its columns are cut; a ``[1, 1]`` scale whole."""

    name = "float8"

    def __init__(self, source: Scaled) -> None:
        self.source = source

    def refused(self, stacked: bool, per_rank: bool) -> str | None:
        if self.source.refused is not None:
            return self.source.refused
        if stacked or per_rank:
            return (f"a float8 weight: kept whole under {'weights' if stacked else 'inputs'}='per_rank' (cut under "
                    "the default 'replicated')")
        return None

    def cuts_companions(self, dim: int) -> bool:
        return self.source.per_row and dim == 0  # (qdata [out, in]: a row's scale lies along dim 0 only)


DENSE, EMBEDDING, EXPERTS = LinearKind(), Embedding(), Experts()


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """A parameter placeholder: its FQN as in the compiled module's ``named_parameters()``."""

    fqn: str
    module_fqn: str
    is_parameter: bool
    inner: str = ""  # an inner tensor of a subclass parameter (torchao's "qdata", "scale"): fqn ends with it


@dataclasses.dataclass(frozen=True)
class LinearMatch:
    """One linear computation ``y = x @ W' (+ b)`` normalised from whatever the model wrote."""

    node: torch.fx.Node  # the aten.mm / aten.addmm
    fqn: str  # the name plans use: the owning module's FQN (or the parameter's, if not "weight")
    weight: torch.fx.Node  # the weight placeholder
    weight_form: str  # "out_in" (used transposed, nn.Linear) or "in_out" (used as is, Conv1D)
    transpose: torch.fx.Node | None
    input: torch.fx.Node
    bias: torch.fx.Node | None
    in_features: int
    out_features: int
    kind: LinearKind = DENSE
    # experts: the nodes from the 3-D weight to the matmul (expert selection, transposes), the dim of
    # ``input`` that is contracted and the output dim that holds output features (from the end)
    chain: tuple[torch.fx.Node, ...] = ()
    experts: int = 0
    input_dim: int = -1
    output_dim: int = -1
    # embedding with max_norm: the in-place ``embedding_renorm_`` of the looked-up rows, on ``detach(W)``
    renorm: torch.fx.Node | None = None
    # linear: the nodes from the weight to the matmul, in order (a dtype conversion, the transpose)
    operand_path: tuple[torch.fx.Node, ...] = ()
    # parameters the path reads besides the weight, cut with it on the same dim where the kind
    # cuts them (weight_norm's g: cut on its norm dim, whole on the other)
    companions: tuple[torch.fx.Node, ...] = ()

    @property
    def operand(self) -> torch.fx.Node:
        """What the matmul reads: the weight, or the last node of its path (this rank's part, once cut)."""
        return self.operand_path[-1] if self.operand_path else self.weight

    @property
    def out_dim(self) -> int:
        """The weight dim that holds output features (sharded by colwise)."""
        return (0 if self.weight_form == "out_in" else 1) + self.kind.weight_dims

    @property
    def in_dim(self) -> int:
        return (1 if self.weight_form == "out_in" else 0) + self.kind.weight_dims

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features * max(1, self.experts)


def plan_name_of(info: ParamInfo) -> str:
    """The name plans use for a parameter: its module's FQN for a weight, else its own FQN."""
    fqn = info.fqn.removesuffix(f".{info.inner}") if info.inner else info.fqn  # (a quantized weight's qdata)
    return info.module_fqn if fqn.endswith(".weight") or fqn == "weight" else fqn


def embedding_options(node: torch.fx.Node) -> tuple[int, bool, bool]:
    """``(padding_idx, scale_grad_by_freq, sparse)`` of an ``aten.embedding`` node (-1: no padding;
    ``F.embedding`` already turned a negative padding index into its row)."""
    names, defaults = ("padding_idx", "scale_grad_by_freq", "sparse"), (-1, False, False)
    given = node.args[2:5]
    out = [given[i] if i < len(given) else node.kwargs.get(n, d) for i, (n, d) in enumerate(zip(names, defaults))]
    return int(out[0]), bool(out[1]), bool(out[2])
