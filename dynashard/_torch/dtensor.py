"""Private torch APIs for DTensor (``_StridedShard``, a DTensor's local tensor object); see
``_torch/__init__.py``, which re-exports these."""

from __future__ import annotations

from typing import Any


def strided_shard(dim: int, split_factor: int) -> Any:
    """DTensor's placement of equal components side by side on ``dim`` (a fused ``[q | k | v]``), each cut
    in torch.chunk's blocks: a rank holds its block of every component, in order."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def dtensor_local(t: Any) -> Any:
    """The local tensor object a DTensor holds (``to_local()`` may return another object: a view for autograd),
    to carry DCP's protocol, which DTensor's own asks it for first."""
    return t._local_tensor


_FOLLOWING: list[Any] = []  # (gather, cut) while DCP's full state dicts follow placements (process-wide, once)


def follow_placements_in_dcp(gather: Any, cut: Any) -> None:
    """DCP's ``get_state_dict`` / ``get_model_state_dict`` / ``get_optimizer_state_dict`` with
    ``full_state_dict=True`` gather DTensors and ShardedTensors only, and take any other tensor as whole
    (``torch.distributed.checkpoint.state_dict._maybe_full_or_cpu_state_dict`` calls
    ``_gather_state_dict``); their ``set_*`` twins hand the whole tensors on (``_distribute_state_dict``,
    ``_broadcast_state_dict``). A tensor carrying dynashard's placement (placement.py) is one rank's pieces:
    each of those module functions, as ``state_dict.py`` names it, is wrapped once for the process so
    that ``gather(state_dict)`` makes such tensors whole first (a collective: DCP's gather already is) and
    ``cut(loaded, local)`` makes the whole values in ``loaded`` this rank's pieces again, as the tensors in
    ``local`` (the state dict before the load) were. NOTE: relies on ``state_dict.py`` calling these three
    by their module-level names (torch 2.11 to 2.15)."""
    import torch.distributed.checkpoint.state_dict as dsd

    if _FOLLOWING:
        _FOLLOWING[:] = [(gather, cut)]
        return
    _FOLLOWING.append((gather, cut))
    gather_state, distribute, broadcast = dsd._gather_state_dict, dsd._distribute_state_dict, \
        dsd._broadcast_state_dict

    def _gather_state_dict(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        return gather_state(_FOLLOWING[0][0](state_dict), *args, **kwargs)

    def _distribute_state_dict(full: Any, local: Any, *args: Any, **kwargs: Any) -> Any:
        before = dict(local)
        out = distribute(full, local, *args, **kwargs)
        _FOLLOWING[0][1](local, before)
        return out

    def _broadcast_state_dict(full: Any, local: Any, *args: Any, **kwargs: Any) -> Any:
        before = dict(local)
        out = broadcast(full, local, *args, **kwargs)
        _FOLLOWING[0][1](local, before)
        return out

    dsd._gather_state_dict = _gather_state_dict
    dsd._distribute_state_dict = _distribute_state_dict
    dsd._broadcast_state_dict = _broadcast_state_dict
