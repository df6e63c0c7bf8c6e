"""Prototype (not the product): FSDP2 x dynashard, with each tp shard handed to fully_shard as a DTensor.

Launch: torchrun --standalone --nproc-per-node 4 tools/proto_fsdp2_dtensor.py

What it patches around dynashard, by hand, to test the design in docs/design.md ("FSDP2 x dynashard"):
after ``parallelize`` over mesh["tp"], each registered shard becomes ``nn.Parameter(DTensor.from_local(
shard, mesh["tp"], [Shard(dim)], shape=global))``; the facade property answers Dynamo with the facade
and eager code (FSDP) with the parameter; the compiled program reads the module's current parameter
(FSDP's gathered copy) through ``to_local()`` instead of the shard it stored; then
``fully_shard(model, mesh=mesh["dp"])``. FSDP2 makes the cut weights 2-D DTensors (dp x tp), 1/4 of
each on every rank.

Measured (2026-12-02, 2x2 gloo mesh, the MLP 32 -> 96 -> 32 of tests/models.py, 4 SGD steps, each
replica its own batch, against the unsharded twin on both batches):
    step 0 grad rel err 1.9e-07 norms 0.1006363183 0.1006363109 param err 1.5e-08
    step 3 grad rel err 2.1e-07 norms 0.1175581738 0.1175581738 param err 1.5e-08
(the norm over the tp-cut parameters' DTensor gradients is the unsharded one: DTensor sums over both
mesh dims). Not solved here: a parameter dynashard leaves whole is FSDP's 1-D DTensor over dp, and
clip_grad_norm_ refuses a mix of 1-D and 2-D meshes (pytorch #180346): those need a Replicate()
DTensor on mesh["tp"] and a facade too. DCP of the 2-D parameters, and layouts DTensor cannot
describe (dealt heads, fused parts), are untested.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import dynashard
import dynashard.dynamo_backend as B
from dynashard import gradients
from dynashard.parameters import FACADES
from dynashard.weights import STORE
from tests import models


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    opts = {"min_shard_numel": 0, "compiler": "eager", "group": mesh["tp"]}
    torch.manual_seed(0)
    model = models.build("mlp", 32, 96)
    twin = copy.deepcopy(model)
    def batch(step, d):
        return torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(100 + 10 * step + d))
    dynashard.parallelize(model, batch(0, dp), options=opts)
    owners = {}
    for name, module in model.named_modules():
        for attr, facade in module.__dict__.get(FACADES, {}).items():
            shard = module._parameters[attr]
            spec = STORE.spec_of(facade)
            dt = DTensor.from_local(shard.detach(), mesh["tp"], [Shard(spec.dim)], run_check=False,
                                    shape=facade.shape, stride=facade.stride())
            module._parameters[attr] = nn.Parameter(dt, requires_grad=shard.requires_grad)
            owners[id(facade)] = (module, attr, f"{name}.{attr}", spec)
            def get(self, attr=attr):
                f = self.__dict__.get(FACADES, {}).get(attr)
                if f is None:
                    return nn.Module.__getattr__(self, attr)
                return f if torch.compiler.is_compiling() else self._parameters[attr]
            setattr(type(module), attr, property(get))
            type(module).register_parameter = nn.Module.register_parameter
    # the program reads the module's current parameter
    orig_as_parameter = STORE.as_parameter
    def as_parameter(facade):
        o = owners.get(id(facade))
        if o is None:
            return orig_as_parameter(facade)
        cur = o[0]._parameters[o[1]]
        assert isinstance(cur, DTensor) and cur.placements == (Shard(o[3].dim),), type(cur)
        return cur.to_local()
    STORE.as_parameter = as_parameter
    gradients.mark = lambda *a, **k: None
    B._refuse_fsdp_managed = lambda *a, **k: None
    fully_shard(model, mesh=mesh["dp"])
    if dist.get_rank() == 0:
        for n, p in model.named_parameters():
            print(n, type(p).__name__, tuple(p.shape), p.placements, tuple(p.to_local().shape))
    fast = torch.compile(model, backend="dynashard", options=opts)
    opt, opt_twin = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    for step in range(4):
        fast(batch(step, dp)).pow(2).mean().backward()
        twin(torch.cat([batch(step, d) for d in range(2)])).pow(2).mean().backward()
        errs = {}
        for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
            full = p.grad.full_tensor()
            errs[n] = float((full - q.grad).abs().max() / q.grad.abs().max())
        tp_params = [p for p in model.parameters() if p.grad.device_mesh.ndim == 2]
        n1 = torch.nn.utils.get_total_norm([p.grad for p in tp_params])
        n1 = float(n1.full_tensor()) if isinstance(n1, DTensor) else float(n1)
        n2 = torch.nn.utils.get_total_norm([q.grad for (n, q) in twin.named_parameters() if n != "down.bias"])
        for o in (opt, opt_twin):
            o.step()
            o.zero_grad()
        perr = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(model.parameters(), twin.parameters()))
        if dist.get_rank() == 0:
            print("step", step, "grad rel err", max(errs.values()), "norms", n1, float(n2), "param err", perr)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
