"""flex_attention on this rank's heads, its score_mod and mask_mod told which heads those are.

Before (q, k, v Shards on the head dim; Dynamo's higher-order op, retraced to aten)::

    out, lse, max = flex_attention(q, k, v, sdpa_score0, (T, S, kv_num_blocks, ..., sdpa_mask0),
                                   scale, options, (slopes,), ())
After (rank r holds query heads ``first .. first + n``)::

    out, lse, max = flex_attention(q_r, k_r, v_r, score_mod(h -> h + first), (T, S, kv_num_blocks_r, ...,
                                   mask_mod(h -> h + first)), scale, options, (slopes,), ())

Outputs are Shards on the head dim (the log-sum-exp and max too); nothing is gathered. Invariants:

* ``h`` inside score_mod and mask_mod is the global head index: a mod that reads it is wrapped to
  add this rank's first head (``first``), so a per-head bias or mask reads the same head as
  unsharded. Where this rank's heads are not one consecutive run, such a mod runs on whole heads.
* The buffers the mods capture stay whole (a gathered Shard where one is cut): the global ``h``
  indexes them as it did unsharded. They are per-head tables, small next to q/k/v.
* A block mask with one row per query head is narrowed to this rank's heads; one of H 1 is every
  head's and stays as it is. Any other head count runs whole.
* GQA (fewer K/V heads, flex_attention's ``enable_gqa``) as SDPA's: K/V cut to this rank's groups,
  or whole and narrowed to them (``Read.NARROW_GROUPS``, rules/attention.py).
Where the rule declines, the graph gathers (q/k/v then stay whole in the plan) and the reason is
logged at debug level under ``dynashard``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard.layout.nodes import all_args, op_name, val
from dynashard.layout.shard import LayoutMap, Lowering, Read, Record, Shard
from dynashard.plan.rules.attention import gqa_heads, heads_alike, kv_groups, off_heads_wish
from dynashard.plan.rules.registry import rule
from dynashard.rewrite.local_conversions import take

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FlexOnHeads(Lowering):
    """flex_attention on this rank's query heads (``heads``): the mods that read ``h`` shifted to
    the global index, a per-head block mask narrowed."""

    heads: Shard
    shift_score: bool  # score_mod reads h
    shift_mask: bool  # mask_mod reads h
    per_head_mask: bool  # the block mask's tensors have one row per query head

    def emit(self, sharder: Any, node: torch.fx.Node) -> Any:
        q, k, v = (_own(sharder.read(node, a, self.heads)) if sharder.lm.read_of(node, a) != Read.LOCAL
                   else sharder.read(node, a, self.heads) for a in node.args[:3])
        args = list(node.args)
        score_mod = sharder.held(args[private_aten.FLEX_SCORE_MOD])
        mask = list(args[private_aten.FLEX_BLOCK_MASK])
        for i, item in enumerate(mask):
            if isinstance(item, torch.fx.Node):
                value = sharder.held(item)
                mask[i] = self._block(value) if i in private_aten.FLEX_BLOCK_TENSORS else value
        if self.shift_score or self.shift_mask:
            (first, _), = self.heads.split.owned(self.heads.world)[self.heads.rank]  # one run: the rule checked
            if self.shift_score:
                score_mod = _shifted(score_mod, private_aten.FLEX_SCORE_HEAD, first)
            if self.shift_mask:
                mask[-1] = _shifted(mask[-1], private_aten.FLEX_MASK_HEAD, first)
        buffers = [tuple(sharder.read(node, b, self.heads) for b in args[i])
                   for i in (private_aten.FLEX_SCORE_BUFFERS, private_aten.FLEX_MASK_BUFFERS)]
        scale, options = torch.fx.node.map_arg(args[private_aten.FLEX_BLOCK_MASK + 1:private_aten.FLEX_SCORE_BUFFERS],
                                               sharder.held)
        return node.target(q, k, v, score_mod, tuple(mask), scale, options, *buffers)

    def _block(self, value: Any) -> Any:
        if value is None or not self.per_head_mask:
            return value
        return _own(take(value, self.heads.moved(1 - value.dim())))  # [B, H, ...]: this rank's rows of H


def _own(value: torch.Tensor) -> torch.Tensor:
    """A narrowed operand in a buffer of its own.

    NOTE: Inductor's CPU flex_attention template (torch 2.13) reads its tensor inputs from the start of
    their buffer, ignoring a view's storage offset: measured, rows 2..3 of a block mask (a view, and
    ``contiguous()`` keeps it one where B is 1) were read as rows 0..1, and a head slice of q as heads
    0..1, both silently wrong. A clone is a buffer of its own under every compiler (a few bytes for a
    block mask; q/k/v only where they were narrowed from whole ones)."""
    return value.clone(memory_format=torch.contiguous_format)


def _shifted(mod: Callable[..., Any], at: int, first: int) -> Callable[..., Any]:
    """``mod`` with its ``at``-th argument (the local head index) made global; traced into the new
    subgraph by the op itself."""
    if first == 0:
        return mod

    def shifted(*args: Any) -> Any:
        args = list(args)
        args[at] = args[at] + first
        return mod(*args)

    return shifted


def _reads_head(mod: torch.fx.GraphModule | None, at: int) -> bool | None:
    """Whether a mod's subgraph uses its head-index argument (None: not a subgraph we can read)."""
    if mod is None:
        return None
    inputs = [n for n in mod.graph.nodes if n.op == "placeholder"]
    return len(inputs) > at and bool(inputs[at].users)


def _decline(node: torch.fx.Node, why: str) -> None:
    log.debug("dynashard: %s runs on every head (its q/k/v gathered): %s", op_name(node), why)


@rule(private_aten.FLEX_ATTENTION)
def flex_attention(lm: LayoutMap, node: torch.fx.Node) -> Record | None:
    q, k, v = node.args[:3]
    if not any(lm.layouts.get(a) is not None for a in (q, k, v)):
        return None  # nothing cut reaches it: nothing to decide
    groups = kv_groups(q, k)
    if groups is None:
        return _decline(node, "q and k/v head counts are not a whole multiple")
    first = gqa_heads(lm, node, q, k, v, groups) if groups > 1 else heads_alike(lm, node, [q, k, v], -3)
    if first is None or (lm.layouts.get(q) is None and groups > 1):
        off_heads_wish(lm, node, [q, k, v])
        return _decline(node, "q, k and v are not cut alike by heads (or a rank would hold none)")
    block_mask = node.args[private_aten.FLEX_BLOCK_MASK]
    per_head = _per_head_mask(lm, node, block_mask, val(q).shape[-3])
    if per_head is None:
        return None
    shifts = (_reads_head(private_aten.subgraph(node.args[private_aten.FLEX_SCORE_MOD]), private_aten.FLEX_SCORE_HEAD),
              _reads_head(private_aten.subgraph(block_mask[-1]), private_aten.FLEX_MASK_HEAD))
    if None in shifts:
        return _decline(node, "its score_mod or mask_mod is not a subgraph of the graph")
    if any(shifts) and any(len(ranges) != 1 for ranges in first.split.owned(lm.world)):
        return _decline(node, "its score_mod or mask_mod reads the head index h, and a rank's heads are "
                              "not one consecutive run (no single offset makes them global)")
    origins = frozenset().union(*(lm.layouts[a].origins for a in (q, k, v) if lm.layouts.get(a) is not None))
    out = Shard(first.split, origins, -3, lm.world, lm.rank)
    record = Record(outputs=(out, out.moved(-2), out.moved(-2)),
                    lowering=FlexOnHeads(out, shifts[0], shifts[1], per_head))
    for arg in all_args(node):
        if arg in (q, k, v) and lm.layouts.get(arg) is not None:
            record.read(arg, Read.LOCAL)
        elif arg in (k, v) and groups > 1:
            record.read(arg, Read.NARROW_GROUPS)
        elif arg in (q, k, v):
            record.read(arg, lm.as_shard(arg, out))
        elif lm.layouts.get(arg) is not None:
            record.read(arg, Read.GATHER)  # a captured buffer cut somewhere: the global h indexes it whole
        else:
            record.read(arg, Read.NARROW if per_head and arg in _block_tensors(block_mask) else Read.LOCAL)
    return record


def _block_tensors(block_mask: tuple) -> list[torch.fx.Node]:
    return [block_mask[i] for i in private_aten.FLEX_BLOCK_TENSORS if isinstance(block_mask[i], torch.fx.Node)]


def _per_head_mask(lm: LayoutMap, node: torch.fx.Node, block_mask: tuple, heads: int) -> bool | None:
    """Whether the block mask has one row per query head (True) or one for all (False); None: neither,
    or a layout this rule cannot narrow (declined)."""
    tensors = [a for a in block_mask[:-1] if isinstance(a, torch.fx.Node) and isinstance(val(a), torch.Tensor)]
    if any(lm.layouts.get(a) is not None for a in tensors):
        return _decline(node, "its block mask is itself cut")
    rows = {val(a).shape[1] if val(a).dim() >= 2 else None for a in tensors}
    if rows <= {1}:
        return False
    extra = [a for a in tensors if a not in _block_tensors(block_mask)]
    if rows != {heads} or extra:
        return _decline(node, f"its block mask has {', '.join(sorted(map(str, rows)))} head rows for {heads} heads"
                              + (" and dQ write-order metadata" if extra else ""))
    return True
