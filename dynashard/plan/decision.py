"""What the plan decides for one linear (a :class:`Decision`: style and reason), and what the
several uses of one weight must agree on: one split of it for all of them.

Shared by the auto plan (``plan/auto.py``), the user plan (``plan/user.py``) and the re-cut
fixpoint (``recut.py``); it decides nothing itself.
"""

from __future__ import annotations

import dataclasses

import torch.fx

from dynashard.capture.records import LinearMatch
from dynashard.options import Style


@dataclasses.dataclass(frozen=True)
class Decision:
    style: Style
    reason: str
    fed_by: frozenset[str] = frozenset()  # auto rowwise: the FQNs of the colwise linears sharding its input


def split_dim(m: LinearMatch, style: Style) -> int | None:
    """The dim of ``m``'s weight a style cuts (None: whole)."""
    return None if style == Style.REPLICATE else m.out_dim if style == Style.COLWISE else m.in_dim


def style_along(m: LinearMatch, dim: int) -> Style:
    """The style that cuts ``m``'s weight on ``dim`` (the inverse of :func:`split_dim`)."""
    return Style.COLWISE if m.out_dim == dim else Style.ROWWISE


def shared_conflicts(linears: list[LinearMatch], decisions: dict) -> dict[torch.fx.Node, list[LinearMatch]]:
    """Weights used more than once (a layer called twice, tied embedding and LM head) whose
    uses do not all split it on the same dim: one copy cannot serve them all."""
    by_weight: dict[torch.fx.Node, list[LinearMatch]] = {}
    for m in linears:
        by_weight.setdefault(m.weight, []).append(m)
    return {
        w: ms
        for w, ms in by_weight.items()
        if len({split_dim(m, decisions[m.node].style) for m in ms}) > 1
    }
