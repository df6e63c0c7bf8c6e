"""Prototype for issue 12 (shards as first-class parameters), kept so it can be re-run.

Not product code: it reaches into ``weights.STORE``. It checks the riskiest part of the design in
docs/design.md ("Shards as parameters"): each rank's shards registered as the module's parameters,
the full-shape, storage-freed originals kept as *facades* behind a class-swap property (what Dynamo
reads as ``self.weight``), and the unchanged backend finding the shards by facade identity.

    torchrun --standalone --nproc-per-node 2 tools/proto_parallelize.py [mlp|nanogpt|llama]

Prints, per rank: ``named_parameters()`` / ``state_dict()`` shapes (the shards), the compiled
output's max error against the unsharded model, the number of compiles, and what an eager call
of the parallelized model raises.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynashard import _torch_private as private  # noqa: E402
from dynashard import analysis  # noqa: E402
from dynashard.collectives import resolve_group  # noqa: E402
from dynashard.dynamo_backend import dynashard_backend  # noqa: E402
from dynashard.options import parse_options  # noqa: E402
from dynashard.weights import STORE, ShardSpec, _Entry, cut  # noqa: E402
from tests import models  # noqa: E402


def parallelize_sketch(model: nn.Module, x: torch.Tensor, options: dict) -> None:
    """Plan as the backend would, cut, register shards as parameters, keep facades for Dynamo."""
    opts, group = parse_options(options), resolve_group(None)
    world, rank = dist.get_world_size(), dist.get_rank()
    captured = []

    def capture(gm, example_inputs):
        fake = [private.example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
        captured.append((analysis.analyse(gm, fake, opts, world, rank, example_inputs), example_inputs))
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=capture)(x)
    torch._dynamo.reset()
    swapped: dict[type, type] = {}
    for a, example_inputs in captured:
        for i, (_, dim, split) in a.sharded_inputs().items():
            facade = example_inputs[i]
            names = [n for n, q in model.named_parameters(remove_duplicate=False) if q is facade]
            shard = nn.Parameter(cut(facade.detach(), dim, split, world, rank).clone(),
                                 requires_grad=facade.requires_grad)
            STORE._shards[facade] = _Entry(ShardSpec(dim, split, world, rank, group.group_name), shard, names[0])
            for name in names:  # a tied weight: every owner gets the one shard and the one facade
                owner_name, _, attr = name.rpartition(".")
                owner = model.get_submodule(owner_name)
                owner._parameters[attr] = shard
                owner.__dict__.setdefault("_ds_facades", {})[attr] = facade
                cls = type(owner)
                new = swapped.setdefault(cls, type(f"Sharded{cls.__name__}", (cls,), {}))
                setattr(new, attr, property(lambda self, attr=attr: self.__dict__["_ds_facades"][attr]))
                owner.__class__ = new
            facade.untyped_storage().resize_(0)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    name = sys.argv[1] if len(sys.argv) > 1 else "mlp"
    torch.manual_seed(0)
    model = models.build(name, 128 if name == "llama" else 64, 96).eval()
    reference = copy.deepcopy(model)
    x = torch.randint(0, 96, (2, 7)) if name in models.IDS_IN else torch.randn(2, 5, 64)
    parallelize_sketch(model, x, {"min_shard_numel": 0})
    print(rank, "parameters", [(n, tuple(p.shape)) for n, p in model.named_parameters()][:4])
    print(rank, "state_dict", [(n, tuple(t.shape)) for n, t in model.state_dict().items()][:4])
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return dynashard_backend(gm, example_inputs, {"min_shard_numel": 0})

    with torch.no_grad():
        err = float((torch.compile(model, backend=counting)(x) - reference(x)).abs().max())
    print(rank, f"compiled: max err {err:.1e}, {len(compiles)} compile(s)")
    try:
        with torch.no_grad():
            model(x)
        print(rank, "eager call ran")
    except RuntimeError as e:
        print(rank, "eager call raised:", str(e)[:100])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
