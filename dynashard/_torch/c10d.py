"""Private torch APIs for process groups (``torch.distributed.distributed_c10d`` internals); see
``_torch/__init__.py``, which re-exports these."""

from __future__ import annotations

from typing import Any


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A single-process default group of ``world_size`` whose collectives move no data."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def is_fake_group(group: Any) -> bool:
    import torch.distributed as dist

    return dist.get_backend(group) == "fake"


def default_store() -> Any:
    """The key-value store the default process group was created with (None if unavailable)."""
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store is a missing diagnostic, never an error
        return None


def group_by_name(name: str) -> Any:
    """The process group registered under ``name`` (``ProcessGroup.group_name``, what funcol takes)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def moves_cpu_tensors(group: Any) -> bool:
    """Whether ``group`` has a backend for CPU tensors (gloo, ``"cpu:gloo,cuda:nccl"``; not NCCL alone).

    NOTE: ``ProcessGroup._device_types`` is the pybind property torch's own c10d reads
    (``distributed_c10d._get_pg_default_device``)."""
    return any(d.type == "cpu" for d in group._device_types)


def group_timeout(group: Any) -> Any:
    """The timeout ``group``'s collectives wait for (a timedelta), or None (torch's default) if unknown.

    NOTE: read from the backend's ``options._timeout``, as ``distributed_c10d._set_pg_timeout`` does."""
    for device in group._device_types:
        try:
            return group._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001 - a backend without options: torch's default applies
            continue
    return None


def group_count() -> int | None:
    """How many process groups this process belongs to: what torch names a ``use_local_synchronization``
    group by (``distributed_c10d._hash_ranks_to_str``: its ranks and ``len(_world.pg_names)``)."""
    from torch.distributed import distributed_c10d

    try:
        return len(distributed_c10d._world.pg_names)
    except Exception:  # noqa: BLE001 - unknown: the names are not compared
        return None
