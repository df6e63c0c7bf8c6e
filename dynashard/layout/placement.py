"""Where a tensor of one rank's pieces sits in its whole tensor, carried by the tensor itself.

After ``parallelize``, a model's ``state_dict()`` values for the weights it cut are this rank's pieces
of them, and so are its optimizer's states for those weights (``exp_avg``, momentum). A plain tensor
cannot say so: saved on rank 0 and loaded on rank 1 it would be taken for rank 1's pieces. So each
such tensor carries its placement, as a DTensor carries its spec::

    up.weight [45, 32] = rows [0, 45) of [90, 32]  ->  t._dynashard_placement ==
        {"shape": [90, 32], "dim": 0, "pieces": [[0, 45]], "world": 2, "rank": 0}

- plain data (ints and lists), so ``torch.save`` writes it with the tensor and ``torch.load`` (also
  with ``weights_only=True``) gives it back (dcp_planners' ``__reduce_ex__`` keeps it);
- a load into a parallelized model takes a tensor only if it is whole, or holds exactly the pieces
  this rank holds (:func:`check_loadable`): another rank's pieces, or pieces saved at another world
  size, are refused, and so is a shard-shaped tensor that carries no placement (whose pieces it
  holds cannot be told);
- DCP's ``get_state_dict(..., full_state_dict=True)`` gathers such tensors whole, and its
  ``set_state_dict(..., full_state_dict=True)`` cuts whole ones into this rank's pieces
  (``_torch.follow_placements_in_dcp``, with :func:`gather_placed` and :func:`cut_placed`).
"""

from __future__ import annotations

from typing import Any

import torch

from dynashard.errors import UsageError

KEY = "_dynashard_placement"


def describe(shape: torch.Size, dim: int, pieces: list[tuple[int, int]], world: int, rank: int) -> dict:
    return {"shape": [int(n) for n in shape], "dim": int(dim), "pieces": [[int(s), int(n)] for s, n in pieces],
            "world": int(world), "rank": int(rank)}


def of(t: Any) -> dict | None:
    """The placement ``t`` carries, if any."""
    return getattr(t, KEY, None) if isinstance(t, torch.Tensor) else None


def words(p: dict) -> str:
    ranges = ", ".join(f"[{s}, {s + n})" for s, n in p["pieces"] if n)
    return f"rank {p['rank']} of {p['world']}'s pieces {ranges or '(none)'} of dim {p['dim']} of {p['shape']}"


_FIX = ("Expected a whole state dict: get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) "
        "(or get_state_dict(model, optimizer, ...)) saved on one rank, dynashard.export_safetensors(model, path), "
        "or the sharded checkpoint of torch.distributed.checkpoint: dcp.save(model.state_dict(), checkpoint_id=path) "
        "and dcp.load into the parallelized model at any world size. A file each rank saved of its own "
        "state_dict() loads on that same rank.")


def check_loadable(name: str, value: torch.Tensor, full_shape: torch.Size, local_shape: torch.Size,
                   mine: dict) -> None:
    """``value`` may be loaded into the shard ``name`` (this rank's pieces ``mine`` of ``full_shape``): it is
    whole, or carries exactly ``mine``'s pieces. Raises naming whose pieces it holds otherwise."""
    placed = of(value)
    if placed is not None:
        if [placed[k] for k in ("shape", "dim", "pieces")] == [mine[k] for k in ("shape", "dim", "pieces")]:
            return
        raise UsageError(
            f"dynashard: load_state_dict of {name!r}: the value holds {words(placed)}, and this rank holds "
            f"{words(mine)}. A state_dict() of a parallelized model saved on one rank holds only that rank's "
            f"pieces: loading it on another rank would train on the wrong weights. Nothing was loaded. {_FIX}")
    if list(value.shape) == list(full_shape):
        return
    if list(value.shape) == list(local_shape):
        raise UsageError(
            f"dynashard: load_state_dict of {name!r}: a tensor of shape {list(value.shape)}, this rank's shard "
            f"shape, that says nothing of whose pieces it holds (rank 0's saved by an earlier dynashard, or a "
            f"copy of a state_dict() value). Expected the whole tensor of shape {list(full_shape)}, or a "
            f"state_dict() value of this rank. Nothing was loaded. {_FIX}")
    raise UsageError(
        f"dynashard: load_state_dict of {name!r}: expected the whole tensor of shape {list(full_shape)} (this rank "
        f"takes its pieces) or this rank's pieces of shape {list(local_shape)}; found shape {list(value.shape)} "
        f"(a shard saved at another world size?). Nothing was loaded. {_FIX}")


def gather_placed(state: Any, gather: Any) -> Any:
    """``state`` (a state dict, nested) with every tensor that carries a placement replaced by
    ``gather(tensor)``, its whole value: a collective, every rank walks the same keys in the same order."""
    if isinstance(state, dict):
        return {k: gather_placed(v, gather) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(gather_placed(v, gather) for v in state)
    if of(state) is not None:
        return gather(state)
    return state


def cut_placed(loaded: dict, local: dict, cut: Any) -> None:
    """After DCP distributed a whole state dict: each whole value whose local counterpart carries a
    placement becomes this rank's pieces, carrying it (``cut(value, placed)``)."""
    for key, value in list(loaded.items()):
        placed = of(local.get(key))
        if placed is not None and isinstance(value, torch.Tensor) and list(value.shape) == placed["shape"] and \
                list(value.shape) != list(local[key].shape):
            loaded[key] = cut(value, local[key])
