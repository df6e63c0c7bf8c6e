"""Heads: keep a colwise projection's shard through an attention block, on the head dim.

Before (q, k, v colwise on [B*T, H*Dh]; o rowwise)::

    q = view(mm_q, [B, T, H, Dh]); q = transpose(q, 1, 2)          # likewise k, v
    y = _scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]
    y = transpose(y, 1, 2); y = view(y, [B, T, H*Dh]); o = mm(view(y), t(w_o))
After: the same ops on this rank's heads (H/N of them); the head count in the views is
rewritten, nothing is gathered, and the output projection's all_reduce is the only collective.

Rules (replicated inputs only; anything else falls back to layout.py's gather). Every condition
depends on sizes only, never on this rank's offsets, so all ranks take the same collectives:
  * a view splitting a sharded last dim ``H*Dh`` into ``[H, Dh]`` keeps the shard on the head
    dim when every rank's part is whole heads; the reverse merge returns it to the last dim;
    a view that leaves the sharded dim and everything after it alone keeps the shard there;
  * transpose / permute of a tensor of 3 or more dims move the shard with its dim;
  * scaled-dot-product attention whose q, k and v are sharded alike on the head dim is computed
    on this rank's heads (a mask broadcast over heads is used as is, one with a head dim is
    narrowed); its outputs keep the shard.
Uneven heads (the split does not fall on head boundaries), GQA and fused qkv are not handled
here yet: they meet a gather, which is correct.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from dynashard.layout import LOCAL, NARROW, LayoutMap, Shard, _all_args, _val, shard_bounds

aten = torch.ops.aten
_TRANSPOSES = (aten.transpose.int, aten.permute.default)
_ATTENTION = (aten._scaled_dot_product_flash_attention_for_cpu.default,)


def _static(shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def _moved(src: Shard, dim: int, size: int, start: int, length: int, chunk: int) -> Shard:
    return Shard(size, start, length, chunk, src.origins, dim)


def view_to_or_from_heads(lm: LayoutMap, node: torch.fx.Node, src: Shard) -> bool:
    """Keep ``src`` through a view that splits, merges or leaves alone the sharded dim."""
    before, after = _val(node.args[0]).shape, _val(node).shape
    d, out = src.dim, None
    if len(after) >= max(3, -d) and _static(before[d:]) and list(after[d:]) == list(before[d:]):
        out = src  # the sharded dim and everything after it unchanged
    elif d == -1 and len(after) >= 3 and _static(after[-2:]) and after[-2] * after[-1] == src.size:
        heads, dh = after[-2], after[-1]  # [.., H*Dh] -> [.., H, Dh]
        if src.chunk % dh == 0:  # every rank's part is whole heads (rank-independent: no rank decides alone)
            out = _moved(src, -2, heads, src.start // dh, src.length // dh, src.chunk // dh)
    elif d == -2 and len(after) == len(before) - 1 and isinstance(before[-1], int):
        dh = before[-1]  # [.., H, Dh] -> [.., H*Dh]
        if after[-1] == src.size * dh:
            out = _moved(src, -1, src.size * dh, src.start * dh, src.length * dh, src.chunk * dh)
    if out is None:
        return False
    for arg in _all_args(node):
        lm.read(node, arg, LOCAL)
    lm.layouts[node] = out
    lm.view_sizes[node] = (out.dim, out.length)
    return True


def propagate_heads(lm: LayoutMap, node: torch.fx.Node) -> bool:
    """Layout for transposes, attention and its outputs; False when the rule does not apply."""
    if node.op != "call_function":
        return False
    if node.target in _TRANSPOSES:
        return _transpose(lm, node)
    if node.target in _ATTENTION:
        return _attention(lm, node)
    if node.target is operator.getitem and node.args[0] in lm.layouts and lm.layouts[node.args[0]] is not None:
        src, index = lm.layouts[node.args[0]], node.args[1]
        if index not in (0, 1):  # output [B, H, T, Dh] and logsumexp [B, H, T] carry the heads
            return False
        lm.read(node, node.args[0], LOCAL)
        lm.layouts[node] = _moved(src, src.dim + index, src.size, src.start, src.length, src.chunk)
        return True
    return False


def _transpose(lm: LayoutMap, node: torch.fx.Node) -> bool:
    src = lm.layouts.get(node.args[0])
    ndim = _val(node.args[0]).dim() if _val(node.args[0]) is not None else 0
    if src is None or ndim < 3:
        return False
    pos = ndim + src.dim
    if node.target is aten.permute.default:
        order = [d % ndim for d in node.args[1]]
        new = order.index(pos)
    else:
        a, b = (int(d) % ndim for d in node.args[1:3])
        new = b if pos == a else a if pos == b else pos
    lm.read(node, node.args[0], LOCAL)
    lm.layouts[node] = _moved(src, new - ndim, src.size, src.start, src.length, src.chunk)
    return True


def _attention(lm: LayoutMap, node: torch.fx.Node) -> bool:
    q, k, v = node.args[:3]
    lays = [lm.layouts.get(a) for a in (q, k, v)]
    first = lays[0]
    if first is None or first.dim != -3 or any(
        lay is None or (lay.dim, lay.size, lay.start, lay.length) != (first.dim, first.size, first.start, first.length)
        for lay in lays
    ):
        return False
    if shard_bounds(first.size, lm.world, lm.world - 1)[1] == 0:
        return False  # a rank without heads: the attention kernels cannot run on zero heads
    mask = node.kwargs.get("attn_mask")
    if mask is not None:
        mv = _val(mask)
        if lm.layouts.get(mask) is not None or mv is None:
            return False
        if mv.dim() >= 3 and mv.shape[-3] == first.size and first.size != 1:
            lm.read(node, mask, NARROW)
        elif mv.dim() < 3 or mv.shape[-3] == 1:
            lm.read(node, mask, LOCAL)
        else:
            return False
    for arg in _all_args(node):
        if arg is not mask:
            lm.read(node, arg, LOCAL)
    origins = frozenset().union(*(lay.origins for lay in lays))
    lm.layouts[node] = Shard(first.size, first.start, first.length, first.chunk, origins, -3)
    return True
