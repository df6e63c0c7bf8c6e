"""Rank-side bodies of the multi-process tests: compile with dynashard, compare with the unsharded model.

Every rank builds the same model (seed 0) and the same inputs, keeps the unsharded output as
the reference, then compiles with dynashard and runs every input shape through one compiled
model. Results go back to the parent as plain data; the tests assert on them.
"""

from __future__ import annotations

import torch

from tests import models

# (case name, model name, hidden, ffn, input shapes, extra options)
CASES = {
    "mlp_2d": ("mlp", 32, 96, [(3, 32), (5, 32), (8, 32)], {}),
    "mlp_3d": ("mlp", 32, 96, [(2, 3, 32), (4, 5, 32), (3, 7, 32)], {}),
    "mlp_nobias": ("mlp_nobias", 32, 96, [(2, 3, 32), (4, 5, 32)], {}),
    "mlp_stack": ("mlp_stack", 32, 96, [(2, 3, 32), (4, 5, 32)], {}),
    "residual": ("residual", 32, 80, [(2, 3, 32), (4, 5, 32), (3, 6, 32)], {}),
    "functional": ("functional", 32, 96, [(3, 32), (6, 32)], {}),
    "matmul": ("matmul", 32, 96, [(2, 3, 32), (4, 5, 32)], {}),
    "conv1d": ("conv1d", 32, 96, [(2, 3, 32), (4, 5, 32)], {}),
    "head_gather": ("head", 32, 90, [(3, 32), (2, 5, 32)], {"plan": {"proj": "colwise"}}),
    "uneven": ("mlp", 30, 50, [(2, 3, 30), (4, 5, 30)], {}),
    "uneven_empty_rank": ("mlp", 16, 6, [(2, 3, 16), (4, 5, 16)], {}),
    "user_plan_dtensor_styles": ("mlp", 32, 96, [(2, 3, 32), (4, 5, 32)], {"plan": "dtensor"}),
    "inverted_plan": ("mlp", 32, 96, [(2, 3, 32), (4, 5, 32)], {"plan": {"up": "rowwise", "down": "colwise"}}),
}

# Parameters each case must actually shard: a case that silently replicated would prove nothing.
SHARDED = {
    "mlp": {"up.weight", "down.weight"},
    "mlp_nobias": {"up.weight", "down.weight"},
    "mlp_stack": {f"layers.{i}.{n}.weight" for i in range(3) for n in ("up", "down")},
    "residual": {"gate.weight", "up.weight", "down.weight"},
    "functional": {"w1", "w2"},
    "matmul": {"w1", "w2"},
    "conv1d": {"c_fc.weight", "c_proj.weight"},
    "head": {"proj.weight"},
}


def _options(extra: dict, compiler: str) -> dict:
    opts = {"compiler": compiler, "min_shard_numel": 0, **extra}
    if opts.get("plan") == "dtensor":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        opts["plan"] = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return opts


def run_case(case: str, compiler: str, dtype: torch.dtype) -> dict:
    model_name, hidden, ffn, shapes, extra = CASES[case]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = models.build(model_name, hidden, ffn).to(dtype)
    inputs = [torch.randn(s, dtype=dtype) for s in shapes]
    compiles = []

    def counting_backend(gm, example_inputs):
        from dynashard.entry import dynashard_backend

        compiles.append(len(gm.graph.nodes))
        return dynashard_backend(gm, example_inputs, _options(extra, compiler))

    with torch.no_grad():
        refs = [model(x) for x in inputs]
        compiled = torch.compile(model, backend=counting_backend)
        outs = [compiled(x) for x in inputs]
    freed = {n for n, p in model.named_parameters() if p.untyped_storage().nbytes() == 0}
    return {
        "max_err": max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, refs)),
        "ref_scale": max(float(r.float().abs().max()) for r in refs),
        "freed": sorted(freed),
        "compiles": len(compiles),
        "shapes_ok": all(o.shape == r.shape and o.dtype == r.dtype for o, r in zip(outs, refs)),
    }


def battery(rank: int, world: int, cases: list[str], compiler: str, dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    return {case: run_case(case, compiler, dtype) for case in cases}
