"""Group-wise quantized linears cut on group boundaries (capture/match_quantized.py finds them).

Before (``down`` rowwise, int4 in groups of 32 columns, fed by ``up`` colwise at world 3)::

    up: Split((256,), 1) -> ranks hold 86/85/85 columns of down's input: 86 is no whole number of groups
After: ``down``'s rule asks ``up`` for units of 32 (a COARSEN wish; plan/recut.py grants it), so the next round
deals up's 8 groups 3/3/2 (96/96/64 columns) and down reads its input as it is::

    q3 = view(qdata_local, [out, 3, 32]); s3 = view(scale_local, [out, 3, 1]); ...; view(w, [out, 96])

Where no such cut exists (fewer groups than ranks; an origin that cannot be re-cut so) the auto plan keeps the
origin whole (a REPLICATE wish, with the reason), and a user plan's rowwise layer reads its input gathered and
takes its own whole groups: exact either way, never a split group.

Invariants: the weight's split (``record.weight_split``) is the one the dequantization's views are resized to;
the scales and zero points are cut by the same split, in groups (analysis.py, ``companion_split``).
"""

from __future__ import annotations

import math

import torch.fx

from dynashard.capture.match_quantized import groups_of
from dynashard.capture.records import GroupQuantized, LinearMatch
from dynashard.layout.shard import LayoutMap, Record, Resize, Shard, WishKind
from dynashard.layout.split import Split
from dynashard.options import Style


def rowwise_split(lm: LayoutMap, match: LinearMatch, src_split: Split | None) -> Split:
    """The columns a rowwise group-quantized linear cuts: its input's own cut (``src_split``) when that is in
    whole groups, else its groups dealt balanced (the input then narrowed or gathered first). Asks the input's
    origins for whole groups where they could give them."""
    g = match.kind.group
    if src_split is not None and groups_of(src_split, g, lm.world) is not None:
        return src_split
    if src_split is not None:
        _ask_for_groups(lm, match, lm.layouts[match.input])
    return Split((match.in_features // g,), g)


def _ask_for_groups(lm: LayoutMap, match: LinearMatch, src: Shard) -> None:
    g, unit = match.kind.group, src.split.unit
    k = math.lcm(unit, g) // unit
    target = src.split.coarsen(k)
    why = f"{match.fqn} is quantized by groups of {g} input columns: a rank's columns must be whole groups"
    if target is not None and target.fewest_units(lm.world) >= 1:
        lm.wish(src.origins, WishKind.COARSEN, k, why)
    else:
        lm.wish(src.origins, WishKind.REPLICATE, 0 if target is None else k,
                f"{why}, and {src.size // math.lcm(unit, g) if target is not None else 'no whole number of'} such "
                f"units of its input cannot give all {lm.world} ranks some")


def dequantization_views(match: LinearMatch) -> tuple[torch.fx.Node, ...]:
    """The views a group-quantized linear's dequantization takes (of qdata, scale, zero point, and back to
    ``[out, in]``), each emitted at this rank's sizes once the linear is cut; none for a form left whole."""
    kind = match.kind
    if not isinstance(kind, GroupQuantized) or kind.source.refused is not None:
        return ()
    return (*kind.source.views, match.operand_path[len(kind.source.path) - 1])  # (last: the [out, in] view)


def dequantization_resizes(lm: LayoutMap, match: LinearMatch, style: Style, record: Record
                           ) -> dict[torch.fx.Node, Resize]:
    """The dequantization's views at this rank's sizes: its rows (colwise), or its groups of columns
    (rowwise); ``record`` is the linear's."""
    assert isinstance(match.kind, GroupQuantized) and match.kind.source.refused is None, f"{match.fqn}: {match.kind}"
    local = record.weight_split.local(lm.world, lm.rank)
    if style == Style.COLWISE:
        return {view: Resize(0, match.out_features, local) for view in dequantization_views(match)}
    out = {}
    for view in dequantization_views(match):  # (dim 1 is the groups, or the columns of a 2-D view of qdata)
        full = int(view.meta["val"].shape[1])
        out[view] = Resize(1, full, local * full // match.in_features)
    return out
