"""A vocab-parallel embedding's lookup and ``max_norm`` renorm on this rank's cut, with every option.

Before (the source graph; ``max_norm`` only with ``F.embedding(..., max_norm=m)``)::

    embedding_renorm_(detach(W), ids, m, p)
    rows = embedding(W, ids, padding_idx, scale_grad_by_freq, sparse)
After (this rank holds rows ``[start, start + n)``; the rewrite all-reduces the result)::

    local = ids - start; inside = 0 <= local < n; at = local.clamp(0, n - 1)
    W_shard[at] = W_shard[at] * scale         # rows some inside id looks up, norm above m
    rows = where(inside, embedding(W_shard, at, padding_idx - start or -1, False, sparse), 0)

Forward, the options change nothing; backward, they decide which rows get what, so dropping one is
a silent wrong gradient (tests/test_embeddings.py checks each option's gradient). The padding row gets
no gradient: here, this rank's row of it (on a rank without it, its ids are outside the slice and
masked anyway). ``scale_grad_by_freq`` divides each row's gradient by how often its id occurs;
the local lookup sees other ranks' ids clamped into the slice, so its own counts would be wrong:
with gradients the division is done here, by the counts of the ids inside the slice (the ids are
replicated, so every rank counts all of them; under ``inputs="per_rank"`` each rank's own batch
counts alone, as its own unsharded call would). ``sparse`` is passed on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from dynashard.capture.records import embedding_options
from dynashard.errors import NotSupportedError
from dynashard.layout.shard import Shard

aten = torch.ops.aten


def lookup(node: torch.fx.Node, weight: Any, ids: Any, shard: Shard, train: bool, blocks: int) -> Any:
    """This rank's part of the embedding ``node`` (zeros for ids outside its slice). ``blocks``: the
    batches side by side in ``ids`` that count apart (the world size under ``inputs="per_rank"``)."""
    padding_idx, by_freq, sparse = embedding_options(node)
    if shard.length == 0:
        return torch.zeros(*ids.shape, weight.shape[-1], dtype=weight.dtype, device=weight.device)
    inside, at = _local(ids, shard)
    pad = padding_idx - shard.start if padding_idx >= 0 and 0 <= padding_idx - shard.start < shard.length else -1
    rows = aten.embedding(weight, at, pad, False, sparse)
    if by_freq and train:
        counts = _counts(at, inside, shard.length, blocks)
        rows = rows.detach() + (rows - rows.detach()) / counts.unsqueeze(-1)  # the value exactly, the gradient / count
    return torch.where(inside.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def renorm_rows(node: torch.fx.Node, weight: Any, ids: Any, shard: Shard | None,
                gather: Callable[[Any], Any] | None = None) -> Any:
    """``embedding_renorm_(detach(W), ids, max_norm, norm_type)`` on this rank's cut ``weight``: each
    row some id looks up, whose norm exceeds ``max_norm``, scaled to it in place, as torch's kernel
    does (``max_norm / (norm + 1e-7)``). Every position writes its row's new value; all positions of
    a row write the same one.

    ``shard``: vocab-parallel, the rows this rank holds (only those an id inside the slice looks up).
    None: the embedding dim is cut, and a row's norm combines every rank's part of it: ``gather``
    all-gathers each looked-up row's ``[n, 1]`` partial norm (``[n, world]``)."""
    max_norm, p = float(node.args[2]), float(node.args[3])
    ids = ids.reshape(-1)
    if shard is not None:
        if shard.length == 0:
            return weight
        inside, at = _local(ids, shard)
        hit = torch.zeros(shard.length, dtype=torch.int64, device=ids.device).index_add(0, at, inside.long())
        hit = hit.index_select(0, at) > 0  # the row at each position is looked up by an id inside the slice
        rows = aten.index_select(weight, 0, at)
        norms = torch.linalg.vector_norm(rows, p, dim=-1, keepdim=True)
    else:
        if not p > 0:
            raise NotSupportedError(
                f"dynashard: an embedding with max_norm and norm_type={p} cut on its embedding dim ({node.name}): "
                "only positive norm types combine across ranks; expected 'rowwise' (vocab-parallel) or "
                "'replicate' for it in the plan.")
        at, hit = ids, None
        rows = aten.index_select(weight, 0, at)
        if p == float("inf"):
            norms = gather(rows.abs().amax(-1, keepdim=True).float()).amax(-1, keepdim=True)
        else:
            norms = gather(rows.abs().float().pow(p).sum(-1, keepdim=True)).sum(-1, keepdim=True).pow(1.0 / p)
    one = torch.ones((), dtype=norms.dtype, device=norms.device)
    scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), one)
    if hit is not None:
        scale = torch.where(hit.unsqueeze(-1), scale, one)
    return aten.index_put_(weight, (at,), rows * scale.to(rows.dtype))


def _local(ids: Any, shard: Shard) -> tuple[Any, Any]:
    """``(inside, at)``: which ids are in this rank's slice, and each as a row of it (clamped into it)."""
    assert len(shard.pieces) == 1, f"a vocab-parallel embedding holds one slice, found {shard.pieces}"
    local = ids - shard.start
    return (local >= 0) & (local < shard.length), local.clamp(0, shard.length - 1)


def _counts(at: Any, inside: Any, length: int, blocks: int) -> Any:
    """At each position, how often its row is looked up by ids inside the slice (within its block
    of rows); at least 1 (a position outside gets no gradient: its 0 / 0 must not be NaN)."""
    flat = at.reshape(blocks, -1)
    counts = torch.zeros(blocks, length, dtype=torch.int64, device=at.device)
    counts = counts.scatter_add(1, flat, inside.reshape(blocks, -1).long())
    return counts.gather(1, flat).reshape(at.shape).clamp(min=1)
