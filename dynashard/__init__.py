"""dynashard: compile-time tensor parallelism as a ``torch.compile`` backend.

Kept free of imports and side effects: ``TORCH_LOGS=+dynashard`` imports this package while
``import torch`` is still running.
"""

__version__ = "0.1.0"
__all__ = ["LoadPlanner", "backend", "empty_weights", "explain", "export_safetensors", "fsdp_shard_placement",
           "full_tensor", "held_bytes", "parallelize", "__version__"]


def backend(mode=None, **options):
    """Return the dynashard backend with ``options`` and torch.compile's ``mode`` bound (see the README's
    options table)."""
    from dynashard.dynamo_backend import backend as _backend  # lazy: import-free package

    return _backend(mode=mode, **options)


def explain(model, *args, world_size=None, options=None, **kwargs):
    """Plan ``model`` on example inputs and return a report (``str()`` is a table); ``verify=True``
    checks every simulated rank against the model (``train=True``: the graph a training compile
    emits), ``dynamic=True`` captures with symbolic sizes."""
    from dynashard.explainer import explain as _explain  # lazy: import-free package

    return _explain(model, *args, world_size=world_size, options=options, **kwargs)


def held_bytes(model) -> int:
    """Bytes of ``model``'s parameters and buffers this rank holds: its shards of the weights
    dynashard sharded (their full tensors are freed), everything else whole."""
    from dynashard.weights.store import held_bytes as _held_bytes  # lazy: import-free package

    return _held_bytes(model)


def full_tensor(t):
    """The whole value of a tensor dynashard sharded (a weight left on a compiled module, a shard
    ``parallelize`` registered, a cache a compiled graph returned), gathered from every rank: a
    collective, every rank calls it. Any other tensor is returned as it is."""
    from dynashard.weights.facades import full_tensor as _full_tensor  # lazy: import-free package

    return _full_tensor(t)


def parallelize(model, *args, options=None, checkpoint=None, device=None, dtensor=False, **kwargs):
    """Shard ``model`` now, as ``torch.compile(model, backend="dynashard", options=options)`` would
    for these example inputs, and register each rank's shards as its parameters; with ``checkpoint``
    (a meta model) each rank reads only its slices from it, onto ``device`` (default: the inputs').
    ``dtensor=True``: the parameters as DTensors on ``options["group"]``, a DeviceMesh's tp dim, for
    FSDP2's ``fully_shard`` over its dp dim afterwards. Returns ``model``."""
    from dynashard.load.parallelize import parallelize as _parallelize  # lazy: import-free package

    return _parallelize(model, *args, options=options, checkpoint=checkpoint, device=device, dtensor=dtensor,
                        **kwargs)


def fsdp_shard_placement(param):
    """``fully_shard(module, mesh=mesh["dp"], shard_placement_fn=dynashard.fsdp_shard_placement)`` after
    ``parallelize(..., dtensor=True)``: a fused weight (nanoGPT's ``[q | k | v]``, gate/up: each tp rank holds
    its block of every component) sharded over dp on another dim, every other parameter on dim 0. FSDP2's
    default shards it on the fused dim, a layout no DTensor placement describes: refused there."""
    from dynashard.training.fsdp import fsdp_shard_placement as _placement  # lazy: import-free package

    return _placement(param)


def empty_weights():
    """Context manager: parameters built on the meta device, buffers real (for ``parallelize(checkpoint=...)``)."""
    from dynashard.load.parallelize import empty_weights as _empty_weights  # lazy: import-free package

    return _empty_weights()


def export_safetensors(model, path, max_shard_size=None, group=None):
    """Write a sharded model's whole weights as one ``.safetensors`` file, or an HF directory (files
    of at most ``max_shard_size`` and their index). Every rank calls it; rank 0 gathers and writes
    one tensor at a time."""
    from dynashard.load.export import export_safetensors as _export  # lazy: import-free package

    return _export(model, path, max_shard_size=max_shard_size, group=group)


def __getattr__(name):
    if name == "LoadPlanner":  # (a DCP planner class: imported when first asked for, keeping import light)
        from dynashard.weights.dcp_planners import LoadPlanner  # lazy: import-free package

        return LoadPlanner
    raise AttributeError(f"module 'dynashard' has no attribute {name!r}")
