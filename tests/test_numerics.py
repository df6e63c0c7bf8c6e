"""Sharded results against the unsharded model on real gloo process groups (CPU).

One spawn per (world size, compiler, dtype) runs many cases, so the suite pays the process and
compile start-up once per configuration; each case is still its own test.
"""

from __future__ import annotations

import functools

import pytest

from tests.battery import CASES, SHARDED, SHARDED_BY_CASE, battery
from tests.multiproc import run_ranks

# float32: a sharded matmul sums the same products in another order (per-rank partial sums,
# then an all-reduce); with reductions over <= 96 terms of O(1) values the difference stays
# a few ulps (~1e-6). bfloat16 rounds each rank's partial sum to an 8-bit mantissa
# (eps = 2**-8 ~ 3.9e-3) before adding them, so allow a few eps of the output's scale.
TOLERANCE = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)}  # (atol, rtol x output scale)

CONFIGS = {
    # (world, compiler, dtype): cases
    (2, "eager", "float32"): [c for c in CASES if c != "llama_few_kv"],
    (4, "eager", "float32"): list(CASES),
    (2, "inductor", "float32"): ["mlp_3d", "residual", "conv1d", "head_gather", "uneven", "pr_mlp_own_weights", "tiny_lm",
                                 "attention", "nanogpt", "llama"],
    (4, "inductor", "float32"): ["residual", "nanogpt", "llama_6_heads", "llama_few_kv", "llama_sdpa_gqa", "llama_mqa",
                                 "fused_gqa_probe"],
    (1, "eager", "float32"): ["mlp_3d", "residual"],
    (2, "aot_eager", "float32"): ["matmul", "conv1d"],
    (2, "inductor", "bfloat16"): ["residual", "mlp_2d"],
    (2, "eager", "bfloat16"): ["mlp_3d", "conv1d"],
}


@functools.lru_cache(maxsize=None)
def _results(world: int, compiler: str, dtype: str) -> list[dict]:
    cases = CONFIGS[(world, compiler, dtype)]
    return run_ranks(battery, world, cases, compiler, dtype, timeout=600)


PARAMS = [
    pytest.param(world, compiler, dtype, case, id=f"w{world}-{compiler}-{dtype}-{case}")
    for (world, compiler, dtype), cases in CONFIGS.items()
    for case in cases
]


@pytest.mark.parametrize("world,compiler,dtype,case", PARAMS)
def test_matches_unsharded(world, compiler, dtype, case):
    atol, rtol = TOLERANCE[dtype]
    model_name = CASES[case][0]
    for rank, per_rank in enumerate(_results(world, compiler, dtype)):
        r = per_rank[case]
        assert r["shapes_ok"], f"rank {rank}: output shape/dtype differs from the unsharded model"
        assert r["max_err"] <= atol + rtol * r["ref_scale"], f"rank {rank}: {r}"
        expected = set() if world == 1 else SHARDED_BY_CASE.get(case, SHARDED[model_name])
        assert set(r["freed"]) == expected, f"rank {rank}: sharded (freed) params {r['freed']}, expected {expected}"
        # One compile for the first shape, one dynamic recompile for every later shape.
        assert r["compiles"] <= 2, f"rank {rank}: {r['compiles']} compiles for {len(CASES[case][3])} shapes"
