"""gpu_check's float8 checks: torchao float8 linears cut by dynashard against the unsharded float8 model.

Three torchao configs on a bf16 MLP (256 -> 512 -> 256, sizes a multiple of 16 on every rank: ``_scaled_mm``'s
rule): ``Float8WeightOnlyConfig()`` (float8 rows, dequantized before a bf16 matmul), and
``Float8DynamicActivationFloat8WeightConfig`` per tensor and per row (the input quantized to float8 in the graph,
``torch._scaled_mm``; torchao allows it on CUDA SM 8.9+ only, so on CPU and older GPUs it is a skip, named).
``KernelPreference.TORCH`` is asked for: torchao's other kernel (mslk's ``f8f8bf16_rowwise``, where installed on
SM 9.0) is an op dynashard does not match, and would leave the layers whole.

- S0 (``explain_check``): ``dynashard.explain(world_size=2, verify=True)`` in one process: each simulated rank's
  program (the aten ops on this device's kernels) against the unsharded float8 model, and the plan asserted
  (up colwise, down rowwise).
- S2 (``rank_check``, in every rank of benchmarks/gpu_ranks.py): ``torch.compile(backend="dynashard")`` on real
  ranks sharing cuda:0 over gloo, compiler "eager" and then "inductor", each rank's output against the
  unsharded float8 model it computes alone.

Everything torchao is imported here, lazily: without torchao (or with one that has no float8 for this torch) every
check is a skip naming why.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

# Output errors relative to the output's magnitude. Eager: the same float8 values and scales, down's partial sums
# rounded to bf16 on each rank before they are added (bf16 ulp 2**-8): tests/test_cuda.BF16_RTOL's 2**-5. Inductor
# against the eager unsharded model: its fused dequantization or input quantization may round an element to the
# neighbouring float8 value (e4m3: 2**-3 apart) now and then; a few such terms in a sum of 512: 2**-4.
EAGER_RTOL = 2**-5
INDUCTOR_RTOL = 2**-4


class NoFloat8(Exception):
    """torchao's float8 is not available here; the message says why."""


def configs(device: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``({name: make config}, {name: why not run})`` for this device."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, PerRow
    except Exception as e:  # noqa: BLE001 - an absent or incompatible torchao is a skip, with its reason
        raise NoFloat8(f"torchao float8 not importable on torch {torch.__version__}: {type(e).__name__}: "
                       f"{str(e)[:200]}") from None
    try:
        from torchao.quantization.quantize_.common import KernelPreference

        prefer = {"kernel_preference": KernelPreference.TORCH}
    except Exception:  # noqa: BLE001 - an older torchao: its only kernel is torch's
        prefer = {}
    made = {"weight-only per row": lambda: Float8WeightOnlyConfig()}
    skipped = {}
    capable = device.startswith("cuda") and torch.cuda.get_device_capability(0) >= (8, 9)
    dynamic = {"dynamic per tensor": lambda: Float8DynamicActivationFloat8WeightConfig(**prefer),
               "dynamic per row": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), **prefer)}
    for name, make in dynamic.items():
        if capable:
            made[name] = make
        else:
            where = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
            skipped[name] = f"torchao allows float8 activations on CUDA SM 8.9+ only ({where}): not run"
    return made, skipped


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def quantized(make: Any, device: str) -> tuple[torch.nn.Module, torch.Tensor]:
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    model = MLP().to(device=device, dtype=torch.bfloat16).eval()
    quantize_(model, make())
    kind = type(model.up.weight).__name__
    assert "Float8" in kind, f"quantize_ left up's weight a {kind}, expected torchao's Float8Tensor"
    x = torch.randn(32, 256, device=device, dtype=torch.bfloat16)
    return model, x


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-6)


def explain_check(device: str) -> dict[str, Any]:
    """S0: every config at simulated world 2 (verify), the plan asserted. Raises NoFloat8 if none can run."""
    import dynashard

    made, skipped = configs(device)
    done = {}
    for name, make in made.items():
        model, x = quantized(make, device)
        with torch.no_grad():
            want = model(x)
        report = dynashard.explain(model, x, world_size=2, verify=True, options={"min_shard_numel": 0})
        assert report.layers == {"up": "colwise", "down": "rowwise"}, f"{name}: planned\n{report}"
        err = max(g.output_err for g in report.graphs) / max(float(want.float().abs().max()), 1e-6)
        assert err <= EAGER_RTOL, f"{name}: simulated ranks off by {err:.2e} of the output (bar {EAGER_RTOL:.1e})"
        done[name] = err
    summary = ", ".join(f"{n} {e:.1e}" for n, e in done.items())
    return {"summary": f"float8 MLP bf16 world 2 (simulated, {device}): rel err {summary}"
                       + (f"; not run: {', '.join(f'{n} ({w})' for n, w in skipped.items())}" if skipped else ""),
            "errors": done, "skipped": skipped}


def rank_check(device: str, compiler: str) -> dict[str, Any]:
    """S2, in each rank: every config compiled with dynashard (``eager``, and ``compiler`` if another) against the
    unsharded float8 model; {"skipped": why} where torchao has no float8 here."""
    import dynashard

    try:
        made, skipped = configs(device)
    except NoFloat8 as e:
        return {"skipped": str(e)}
    errors = {}
    for name, make in made.items():
        for comp, bar in {"eager": EAGER_RTOL, compiler: INDUCTOR_RTOL if compiler != "eager" else EAGER_RTOL}.items():
            model, x = quantized(make, device)
            twin = copy.deepcopy(model)
            torch.compiler.reset()
            fast = torch.compile(model, backend=dynashard.backend(compiler=comp, min_shard_numel=0))
            with torch.no_grad():
                err = _rel(fast(x), twin(x))
            assert err <= bar, f"{name} ({comp}): off by {err:.2e} of the output (bar {bar:.1e})"
            held, whole = dynashard.held_bytes(model), dynashard.held_bytes(twin)
            assert held < 0.75 * whole, f"{name} ({comp}): this rank holds {held} of {whole} bytes: not cut"
            errors[f"{name} {comp}"] = err
    return {"errors": errors, "skipped_configs": skipped}
