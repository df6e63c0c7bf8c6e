"""Dynamo's trace-rule maps kept across the fake process groups the unit tests make (applied by
``tests/conftest.py`` in each test process, once the test modules are imported).

``torch.distributed.init_process_group`` clears Dynamo's trace-rule caches (``trace_rules.clear_lru_cache``: a map
built while torch was still importing could lack torch.distributed's own rules, says its comment), and the next
``torch.compile`` call rebuilds them: about 15 ms, mostly the map of torch's functions (``get_torch_obj_rule_map``,
which looks up some 2,800 names). The unit tests make a fake group for nearly every compile (``dynashard.explain``
makes one per call), so the map was rebuilt for each: 960 times in one ``pytest -m unit`` (its two workers: 604 and
356 times), about 14 CPU seconds.

The maps are built from fixed lists of torch's names, each resolved to the object it names when the map is built.
:func:`apply` clears them once, after the test modules' imports and with torch.distributed loaded (what the clears
are for), and makes the later clears keep them: each rebuild would have produced the same maps, so nothing a test
computes or checks changes, unless a test replaced a torch function (``monkeypatch.setattr(F, "linear", ...)``) and
counted on a new group to make Dynamo see the replacement as torch's own. None does; such a test would call
``tests.dynamo_rules.rebuild()``. The gloo ranks make one group each and are left as they are.
"""

from __future__ import annotations

import torch.distributed  # noqa: F401 - loaded before the one clear, as init_process_group has it
from torch._dynamo import trace_rules

# (torch 2.11 to 2.15 have it, and init_process_group calls it; a release without it clears nothing, and
# apply() then leaves it so)
_CLEAR = getattr(trace_rules, "clear_lru_cache", None)


def _keep() -> None:
    """What ``trace_rules.clear_lru_cache`` does once :func:`apply` ran: nothing (the maps are already whole)."""


def rebuild() -> None:
    """Clear the maps (the next compile rebuilds them from the objects torch's names are bound to now)."""
    if _CLEAR is not None:
        _CLEAR()


def apply() -> None:
    """Clear the maps now (torch.distributed is loaded) and keep them through every later group's creation."""
    if _CLEAR is not None:
        _CLEAR()
        trace_rules.clear_lru_cache = _keep
