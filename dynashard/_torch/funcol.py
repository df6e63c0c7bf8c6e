"""The functional collectives whose names changed between the supported torch releases (see
``_torch/__init__.py``): ``collectives.py`` calls the rest of ``torch.distributed._functional_collectives``
directly.

NOTE: torch 2.13 added ``all_gather_single`` / ``reduce_scatter_single`` and deprecated
``all_gather_tensor`` / ``reduce_scatter_tensor`` (a ``FutureWarning`` on each eager call; under Dynamo
the old names trace straight through to the new ones); 2.11 and 2.12 have only the old names. Both
emit the same ``_c10d_functional.all_gather_into_tensor`` / ``reduce_scatter_tensor`` ops, so the
sharded graphs are the same on every release. Chosen by what the installed torch has, not by its
version number.
"""

from __future__ import annotations

import torch.distributed._functional_collectives as _funcol

# (gather_dim=0 / scatter_dim=0 is the only form dynashard emits; the signatures agree on every release:
# (tensor, dim, group) and (tensor, op, dim, group))
all_gather_single = getattr(_funcol, "all_gather_single", None) or _funcol.all_gather_tensor
reduce_scatter_single = getattr(_funcol, "reduce_scatter_single", None) or _funcol.reduce_scatter_tensor
