"""The suite's workloads, their Megatron plan, and the hand-written tensor-parallel bound.

One plan per workload, written once as ``{module FQN glob: style}`` and applied two ways:

- DTensor: ``parallelize_module`` with the matching ``ColwiseParallel`` / ``RowwiseParallel``
  styles, plus the head-count edit DTensor needs (``n_heads //= world``, ``n_kv_heads //= world``);
- the bound: a deep copy of the model whose planned layers are replaced by this rank's shard
  (``ColwiseShard`` / ``RowwiseShard`` / ``VocabShard`` / ``ExpertsShard`` below) with the minimal
  collectives written in by hand -- one all_reduce per rowwise layer, per vocab-parallel embedding
  and per MoE block, one all_gather for a gathered head -- plus the same head-count edit.
  Everything else in the model (norms, RoPE, attention, routing, residuals) is the model's own
  code on local shards. ``shard_by_hand(..., copies=workload.copies)`` is the same bound for
  training (``bench_train.py``): Megatron's conversions as autograd Functions -- ``f`` (identity
  forward, all_reduce backward) once on each value the colwise layers read (the workload's
  ``copies``), ``g`` (all_reduce forward, identity backward) after each rowwise layer and vocab
  embedding, and the LM head's all_gather whose backward keeps this rank's columns.

dynashard gets no plan: ``plan="auto"`` must find this one (the suite reports its collectives).

Styles: ``colwise`` (output features split; the output stays sharded), ``rowwise`` (input features
split; one all_reduce, bias added after it), ``vocab`` (embedding rows split: masked local lookup,
one all_reduce; DTensor ``RowwiseParallel(input_layouts=Replicate())``), ``gather`` (colwise with
the output all-gathered: the LM head; DTensor ``ColwiseParallel(output_layouts=Replicate())``),
``experts`` (a ``tests.models.MoE`` block, its FQN ``""`` when it is the whole model: every expert of
the 3-D ``gate_up_proj`` colwise per component, of ``down_proj`` rowwise, the router whole, one
all_reduce of the summed expert output; no DTensor style: ``ColwiseParallel`` / ``RowwiseParallel``
take ``nn.Linear`` / ``nn.Embedding`` modules, and the experts are 3-D parameters of the block
itself, so a workload using it lists the DTensor systems in ``not_applicable``).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from benchmarks._common import MLP
from tests.models import LlamaAttention, LlamaBlock, LlamaDecoder, MoE, rope_tables


@dataclasses.dataclass(frozen=True)
class Sizes:
    hidden: int = 1024
    mlp_ffn: int = 4096
    llama_ffn: int = 2816
    n_heads: int = 8
    vocab: int = 32000
    n_layer: int = 4
    moe_ffn: int = 1408  # per expert
    experts: int = 8  # top 2 per token


SMOKE = Sizes(hidden=64, mlp_ffn=256, llama_ffn=176, n_heads=4, vocab=512, n_layer=1, moe_ffn=48, experts=4)

_BLOCK_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "gate_proj": "colwise",
    "up_proj": "colwise",
    "down_proj": "rowwise",
}

_BLOCK_COPIES = {"self_attn": "input", "post_attention_layernorm": "output"}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    plan: dict[str, str]
    build: Callable[[Sizes, int], nn.Module]  # (sizes, max tokens) -> model
    inputs: Callable[[Sizes, int, int], tuple[Any, ...]]  # (sizes, tokens, max tokens) -> call args
    # system kind ("dtensor", ...) -> why the workload cannot run it; the suite reports those n/a
    not_applicable: dict[str, str] = dataclasses.field(default_factory=dict)
    # the training bound's f: {module FQN glob: "input" | "output"}, the one value each group of colwise
    # layers reads (q/k/v share self_attn's input; gate/up the post-attention norm's output)
    copies: dict[str, str] = dataclasses.field(default_factory=dict)


def _block_inputs(s: Sizes, tokens: int, max_tokens: int) -> tuple[Any, ...]:
    cos, sin = rope_tables(s.hidden // s.n_heads, max_tokens)
    return torch.randn(1, tokens, s.hidden), cos, sin


WORKLOADS = {
    w.name: w
    for w in (
        Workload("mlp", {"up": "colwise", "down": "rowwise"}, lambda s, _: MLP(s.hidden, s.mlp_ffn),
                 lambda s, t, _: (torch.randn(1, t, s.hidden),), copies={"up": "input"}),
        Workload("block", _BLOCK_PLAN, lambda s, _: LlamaBlock(s.hidden, s.n_heads, ffn=s.llama_ffn), _block_inputs,
                 copies=_BLOCK_COPIES),
        Workload(
            "decoder",
            {"embed_tokens": "vocab", **{f"layers.*.{k}": v for k, v in _BLOCK_PLAN.items()}, "lm_head": "gather"},
            lambda s, m: LlamaDecoder(s.vocab, s.hidden, s.n_heads, ffn=s.llama_ffn, n_layer=s.n_layer, max_len=m),
            lambda s, t, _: (torch.randint(0, s.vocab, (1, t)),),
            copies={**{f"layers.*.{k}": v for k, v in _BLOCK_COPIES.items()}, "lm_head": "input"},
        ),
        Workload(
            "moe", {"": "experts"}, lambda s, _: MoE(s.hidden, s.moe_ffn, experts=s.experts, top_k=2),
            lambda s, t, _: (torch.randn(1, t, s.hidden),),
            not_applicable={"dtensor": "parallelize_module's ColwiseParallel / RowwiseParallel shard nn.Linear and "
                                       "nn.Embedding modules only; the experts are 3-D parameters of the MoE module"},
        ),
    )
}


def split_heads(model: nn.Module, world: int) -> None:
    """The edit DTensor (and any hand-written TP) needs: each rank computes ``1/world`` of the heads."""
    for m in model.modules():
        if isinstance(m, LlamaAttention):
            if m.n_heads % world or m.n_kv_heads % world:
                raise ValueError(f"{m.n_heads} heads / {m.n_kv_heads} kv heads do not split over {world} ranks")
            m.n_heads //= world
            m.n_kv_heads //= world


def _planned(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, str]]:
    names = [fqn for fqn, _ in model.named_modules()]
    found = [(fqn, style) for fqn in names for key, style in plan.items() if fnmatch.fnmatch(fqn, key)]
    missing = [k for k in plan if not any(fnmatch.fnmatch(f, k) for f, _ in found)]
    if missing:
        raise ValueError(f"plan keys {missing} match no module")
    return found


def sharded_parameters(model: nn.Module, plan: dict[str, str]) -> set[str]:
    """Names of the parameters ``plan`` cuts: every planned layer's weight, and the bias of a colwise
    or gathered layer (a rowwise layer adds its bias whole, after the sum)."""
    planned = _planned(model, plan)
    names = {f"{fqn}.weight" for fqn, _ in planned}
    names |= {f"{fqn}.bias" for fqn, style in planned if style in ("colwise", "gather")}
    return names & {name for name, _ in model.named_parameters()}


def dtensor_parallelize(model: nn.Module, plan: dict[str, str], mesh: Any) -> nn.Module:
    if "experts" in plan.values():
        raise NotImplementedError("no DTensor parallel style shards 3-D expert parameters")
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "vocab": lambda: RowwiseParallel(input_layouts=Replicate()),
        "gather": lambda: ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, {k: styles[v]() for k, v in plan.items()})
    split_heads(model, mesh.size())
    return model


# --- the bound: this rank's shards and the minimal collectives, by hand ----------------------------


class _CopyToShards(torch.autograd.Function):
    """Megatron's f, before a colwise layer: identity forward, all_reduce of the gradient backward
    (each rank's colwise shard contributes a partial gradient of the replicated input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group_name)), None


class _ReduceFromShards(torch.autograd.Function):
    """Megatron's g, after a rowwise layer: all_reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromShards(torch.autograd.Function):
    """The gathered LM head: all_gather of the last dim forward, this rank's columns backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, world: int, rank: int, group_name: str) -> torch.Tensor:
        ctx.rank, ctx.width = rank, y.shape[-1]
        g = funcol.wait_tensor(funcol.all_gather_single(y.contiguous(), 0, group_name))  # [world * d0, ...]
        return g.view(world, *y.shape).movedim(0, -2).reshape(*y.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width), None, None, None


class _Shard(nn.Module):
    """Holds this rank's shard. ``comm=False`` skips the collective (the compute alone); a list in
    ``record`` collects ``(kind, shape, dtype)`` of every collective a call makes (eager calls only).
    ``differentiable``: trainable shards and collectives with Megatron's backward (f/g above)."""

    def __init__(self, world: int, group_name: str, comm: bool, differentiable: bool = False) -> None:
        super().__init__()
        self.world, self.group_name, self.comm, self.differentiable = world, group_name, comm, differentiable
        self.record: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None

    def _note(self, kind: str, t: torch.Tensor) -> None:
        if self.record is not None:
            self.record.append((kind, tuple(t.shape), t.dtype))

    def _param(self, t: torch.Tensor | None) -> nn.Parameter | None:
        return None if t is None else nn.Parameter(t.detach().clone(), requires_grad=self.differentiable)

    def _sum(self, y: torch.Tensor) -> torch.Tensor:
        """The partial sums' all_reduce (skipped when ``comm=False``)."""
        self._note("all_reduce", y)
        if not self.comm:
            return y
        if self.differentiable:
            return _ReduceFromShards.apply(y, self.group_name)
        return funcol.all_reduce(y, "sum", self.group_name)


class ColwiseShard(_Shard):
    def __init__(self, linear: nn.Linear, world: int, rank: int, group_name: str, comm: bool, gather: bool,
                 differentiable: bool = False) -> None:
        super().__init__(world, group_name, comm, differentiable)
        if linear.out_features % world:
            raise ValueError(f"{linear.out_features} output features do not split over {world} ranks")
        self.gather, self.rank = gather, rank
        self.weight = self._param(linear.weight.chunk(world, 0)[rank])
        self.bias = self._param(None if linear.bias is None else linear.bias.chunk(world, 0)[rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.gather:
            return y
        self._note("all_gather", y)
        if not self.comm:
            return y
        if self.differentiable:
            return _GatherFromShards.apply(y, self.world, self.rank, self.group_name)
        g = funcol.all_gather_single(y.contiguous(), 0, self.group_name)  # [world * d0, ..., out/world]
        return g.view(self.world, *y.shape).movedim(0, -2).reshape(*y.shape[:-1], -1)


class RowwiseShard(_Shard):
    def __init__(self, linear: nn.Linear, world: int, rank: int, group_name: str, comm: bool,
                 differentiable: bool = False) -> None:
        super().__init__(world, group_name, comm, differentiable)
        if linear.in_features % world:
            raise ValueError(f"{linear.in_features} input features do not split over {world} ranks")
        self.weight = self._param(linear.weight.chunk(world, 1)[rank])
        self.bias = self._param(linear.bias)  # added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._sum(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabShard(_Shard):
    """Megatron's vocab-parallel embedding: rows this rank owns, zeros for the rest, one all_reduce."""

    def __init__(self, emb: nn.Embedding, world: int, rank: int, group_name: str, comm: bool,
                 differentiable: bool = False) -> None:
        super().__init__(world, group_name, comm, differentiable)
        if emb.num_embeddings % world:
            raise ValueError(f"a vocabulary of {emb.num_embeddings} does not split over {world} ranks")
        self.weight = self._param(emb.weight.chunk(world, 0)[rank])
        self.start = rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        y = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self._sum(y)


class ExpertsShard(_Shard):
    """A ``tests.models.MoE`` block (its ``batched_mm`` form) on this rank's slice of every expert:
    ``gate_up_proj`` holds rows ``[r * ffn/N, (r + 1) * ffn/N)`` of each expert's gate part and the
    same rows of its up part, side by side (``[E, 2 * ffn/N, hidden]``), ``down_proj`` the same
    columns of each expert (``[E, hidden, ffn/N]``); the router is whole, so every rank routes alike.
    ``forward`` is ``MoE.forward``'s ``batched_mm`` path line for line, plus one all_reduce (sum) of
    the summed expert output ``[tokens, hidden]`` before the residual add."""

    def __init__(self, moe: MoE, world: int, rank: int, group_name: str, comm: bool) -> None:
        super().__init__(world, group_name, comm)
        if not isinstance(moe, MoE) or moe.loop:
            raise ValueError(f"experts: expected a tests.models.MoE with loop=False, got {moe!r}")
        if moe.ffn % world:
            raise ValueError(f"an expert ffn of {moe.ffn} does not split over {world} ranks")
        self.e, self.k, self.ffn = moe.e, moe.k, moe.ffn // world
        self.router = copy.deepcopy(moe.router)
        gate, up = moe.gate_up_proj.chunk(2, 1)  # [E, ffn, hidden] each
        self.gate_up_proj = self._param(torch.cat([gate.chunk(world, 1)[rank], up.chunk(world, 1)[rank]], 1))
        self.down_proj = self._param(moe.down_proj.chunk(world, 2)[rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, ids = torch.topk(F.softmax(self.router(h), -1), self.k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        pairs = h.repeat_interleave(self.k, dim=0)  # [tokens * top_k, hidden]
        flat = ids.reshape(-1)
        gate, up = torch.bmm(self.gate_up_proj[flat], pairs.unsqueeze(-1)).squeeze(-1).chunk(2, -1)
        y = torch.bmm(self.down_proj[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        y = (y * weights.reshape(-1, 1)).view(-1, self.k, shape[-1]).sum(1)  # this rank's partial sum
        return x + self._sum(y).view(shape)


def shard_by_hand(model: nn.Module, plan: dict[str, str], world: int, rank: int, comm: bool = True,
                  copies: dict[str, str] | None = None) -> nn.Module:
    """``model`` (a copy) with every planned layer replaced by this rank's shard module (the model
    itself replaced when its FQN ``""`` is planned, e.g. a lone MoE block). With ``copies`` (a
    workload's ``copies``) the bound is for training: trainable shards, differentiable collectives,
    and f on each value the colwise layers read."""
    model = copy.deepcopy(model)
    group_name = dist.group.WORLD.group_name
    planned = _planned(model, plan)
    if any(not fqn for fqn, _ in planned) and len(planned) > 1:
        raise ValueError("a plan that replaces the whole model can hold nothing else")
    grad = copies is not None
    for fqn, style in planned:
        parent_fqn, _, attr = fqn.rpartition(".")
        old = model.get_submodule(fqn)
        if style == "experts":
            if grad:
                raise NotImplementedError("the bound has no backward for the experts' partial sums")
            new = ExpertsShard(old, world, rank, group_name, comm)
        elif style == "vocab":
            new = VocabShard(old, world, rank, group_name, comm, grad)
        elif style == "rowwise":
            new = RowwiseShard(old, world, rank, group_name, comm, grad)
        else:
            new = ColwiseShard(old, world, rank, group_name, comm, style == "gather", grad)
        if fqn:
            setattr(model.get_submodule(parent_fqn), attr, new)
        else:
            model = new
    if grad:
        _place_copies(model, copies, group_name)
    split_heads(model, world)
    return model


def _place_copies(model: nn.Module, copies: dict[str, str], group_name: str) -> None:
    """Megatron's f on the first input or on the output of each module ``copies`` names, by hooks
    (Dynamo inlines them): one all_reduce in backward per value the colwise layers read, however
    many of them read it."""

    def on_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_CopyToShards.apply(args[0], group_name), *args[1:])

    def on_output(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return _CopyToShards.apply(out, group_name)

    for fqn, where in _planned(model, copies):
        module = model.get_submodule(fqn)
        if where == "input":
            module.register_forward_pre_hook(on_input)
        else:
            module.register_forward_hook(on_output)


def collectives_of(model: nn.Module, *args: Any) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The collectives a ``shard_by_hand`` model makes on ``args``: one eager call, recorded."""
    shards = [m for m in model.modules() if isinstance(m, _Shard)]
    log: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for m in shards:
        m.record = log
    try:
        with torch.no_grad():
            out = model(*args)
            if isinstance(out, funcol.AsyncCollectiveTensor):
                out.wait()  # the gathered LM head's logits: leave no collective in flight
    finally:
        for m in shards:
            m.record = None
    return log


class CommOnly:
    """The bound's collectives alone, on preallocated tensors of the same shapes (c10d, in order)."""

    def __init__(self, collectives: list[tuple[str, tuple[int, ...], torch.dtype]], world: int) -> None:
        self.calls: list[Callable[[], Any]] = []
        for kind, shape, dtype in collectives:
            buf = torch.randn(shape).to(dtype)
            if kind == "all_reduce":
                self.calls.append(lambda b=buf: dist.all_reduce(b))
            else:
                out = torch.empty((world * shape[0], *shape[1:]), dtype=dtype)
                self.calls.append(lambda b=buf, o=out: dist.all_gather_single(o, b))
        self.description = ", ".join(f"{k} {list(s)}" for k, s, _ in collectives)

    def __call__(self, *_: Any) -> None:
        for call in self.calls:
            call()
