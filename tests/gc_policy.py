"""The garbage collector's settings in the test processes: the xdist workers (``tests/conftest.py``, once the
test modules are imported) and the gloo ranks (inherited from the fork server: ``tests/multiproc.py``).

A compile creates hundreds of thousands of long-lived objects (FX nodes, fake tensors, SymNodes, guards), and
CPython's default thresholds (700, 10, 10) then run a full collection every few compiles, each walking the whole
heap: torch's, transformers' and pytest's modules too (330,000 objects before the first test). In
``tests/test_hf_models.py`` that was 7.9 s of collector time in 53 compiles, 2.1 s with these settings
(``benchmarks/results/ci-times.md`` has the runs).
(PyTorch's own Dynamo defers full collections while compiling for the same reason: pytorch#193289.)

- ``gc.freeze()`` once the imports are done moves what they made to the permanent generation: no collection
  walks it again (nothing there is garbage: modules, classes, functions). Before a fork it also keeps the
  children from writing to the parent's pages (the ``gc.freeze`` documentation's own recommendation).
- A larger first threshold and a tenfold last one: a full collection after about 100 young ones rather than 10.
  Garbage without cycles is still freed by reference counting the moment it dies; only cyclic garbage waits
  longer, and a test that needs it gone calls ``gc.collect()`` (which these settings do not change).

Nothing here changes what a test computes or checks: the collector frees the same garbage, later.
"""

from __future__ import annotations

import gc

THRESHOLDS = (10_000, 10, 100)


def apply() -> None:
    """Freeze what exists now (after a collection, so no garbage is frozen) and set :data:`THRESHOLDS`."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
