"""Private torch APIs for DTensor (``_StridedShard``, a DTensor's local tensor object); see
``_torch_private.py``, which re-exports these."""

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
