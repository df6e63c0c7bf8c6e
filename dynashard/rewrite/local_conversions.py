"""The conversions on an edge that move no data between ranks: this rank's pieces of a replicated
value, and a converted value given back the memory layout its consumer was traced with.

Before (a replicated ``value``, a :class:`~dynashard.layout.shard.Shard` of 6 heads on 4 ranks, rank 1)::

    take(value, shard)              -> aten.narrow(value, dim, 2 * head, 2 * head)
    take_groups(kv, q_shard)        -> the K/V heads rank 1's query heads read (repeated where a
                                       piece starts or ends inside a GQA group)
    as_traced(sdpa, (q, k, v), {})  -> q.contiguous() where the traced q had a unit-stride last
                                       dim and the gathered one does not

The gathers and reductions are ``collectives.py``; the rewrite decides which conversion an edge
gets (its :class:`~dynashard.layout.shard.Read`). Invariants: every function here emits aten ops on this
rank's values only (no collective), and a layout the rewrite keeps (a local shard through views)
is never copied.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard.layout.nodes import is_size
from dynashard.layout.shard import Shard

aten = torch.ops.aten


def take(value: Any, shard: Shard) -> Any:
    """This rank's pieces of a replicated ``value`` along ``shard``'s dim (repeated over a batch
    dim merged in front of it)."""
    d, size = shard.dim, shard.size
    merged = not is_size(value.shape[d], size)
    if merged:
        value = value.unflatten(d, (value.shape[d] // size, size))
    pieces = [aten.narrow(value, d, start, length) for start, length in shard.pieces]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
    return out.flatten(d - 1, d) if merged else out


def take_groups(value: Any, shard: Shard) -> Any:
    """Of whole K/V heads (dim ``shard.dim``), those this rank's query heads read: query head
    ``h`` reads K/V head ``h // n``. Where a piece starts or ends inside a group of ``n`` query
    heads, its K/V heads are repeated to one per query head (the kernel then sees no GQA)."""
    d = value.dim() + shard.dim
    n = shard.size // value.shape[d]
    pieces = shard.pieces
    if all(start % n == 0 and length % n == 0 for start, length in pieces):
        out = [aten.narrow(value, d, start // n, length // n) for start, length in pieces]
    else:
        out = []
        for start, length in pieces:
            lo, hi = start // n, (start + length - 1) // n + 1
            part = aten.narrow(value, d, lo, hi - lo).unsqueeze(d + 1)
            sizes = [-1] * part.dim()
            sizes[d + 1] = n
            out.append(aten.narrow(part.expand(sizes).flatten(d, d + 1), d, start - lo * n, length))
    return out[0] if len(out) == 1 else torch.cat(out, d)


def as_traced(node: torch.fx.Node, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Inputs given the memory layout the op was traced with, where a conversion changed it.

    NOTE: some aten kernels rely on the layout their caller checked, without checking it
    themselves: CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``) reads its
    inputs as if the last dim had unit stride, which is why the composite SDPA picked it when
    Dynamo traced the model. A converted input (gathered and moved back, narrowed, or built from
    such pieces by cat) can have another layout; such an input is made contiguous wherever the
    traced one had a unit-stride last dim and the converted one does not. Layouts the rewrite
    keeps (a local shard through views) never copy.
    """
    def fix(value: Any, traced: Any) -> Any:
        if not (isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor)) or value.dim() == 0:
            return value
        if traced.dim() != value.dim() or not private_aten.known_equal(traced.stride(-1), 1):
            return value
        if private_aten.known_equal(value.stride(-1), 1) or private_aten.known_equal(value.shape[-1], 1):
            return value
        return value.contiguous()

    def fix_all(new: Any, old: Any) -> Any:
        if isinstance(old, torch.fx.Node):
            return fix(new, old.meta.get("val"))
        if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)) and len(old) == len(new):
            return type(new)(fix_all(n, o) for n, o in zip(new, old))
        return new

    return fix_all(args, node.args), {k: fix_all(v, node.kwargs.get(k)) for k, v in kwargs.items()}
