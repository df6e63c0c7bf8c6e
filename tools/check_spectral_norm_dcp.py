"""spectral_norm (torch.nn.utils.parametrizations) on a parallelized MLP: trained 2 SGD steps at world 2, saved
with ``dcp.save(model.state_dict())``, loaded by an unsharded model in one process (``dcp.load(no_dist=True)``):
its weights (``original``), its power-iteration buffers u and v, and its output equal the parallelized model's.
PYTHONPATH=. OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/check_spectral_norm_dcp.py
(2026-12-03: every state entry equal to the parallelized model's whole values (0.0), the output within 6e-8.
Its first run found dynashard.full_tensor returning a state_dict() value's piece as if whole: fixed.)"""
import copy
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dynashard

sys.path.insert(0, ".")
from tests.test_forms_linears import NormedMLP  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = NormedMLP("spectral_norm")
    fresh = copy.deepcopy(model)  # (other values after training: the load must replace them)
    options = {"min_shard_numel": 0, "compiler": "eager"}
    dynashard.parallelize(model, torch.randn(3, 5, 16), options=options)
    fast = torch.compile(model, backend="dynashard", options=options)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        fast(torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        sgd.step()
        sgd.zero_grad()
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    dcp.save(model.state_dict(), checkpoint_id=where[0])
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(9))
    fast.eval()
    with torch.no_grad():
        mine = fast(x)
    full = {n: dynashard.full_tensor(t) for n, t in model.state_dict().items()}  # (a collective: every rank)
    dist.barrier()
    if dist.get_rank() == 0:
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=where[0], no_dist=True)
        fresh.load_state_dict(state)
        fresh.eval()
        with torch.no_grad():
            theirs = fresh(x)
        state_err = max(float((fresh.state_dict()[n] - t).abs().max()) for n, t in full.items())
        print("keys", sorted(full), "\nstate err", state_err, "output err", float((mine - theirs).abs().max()),
              "output scale", float(theirs.abs().max()), flush=True)
    dist.barrier()
    dist.destroy_process_group()
