"""What bench_train.py measures besides time, and its tables: the collectives of a step (profiler),
the bytes of parameters, gradients and optimizer state per rank, and the gradient check.

Every function takes plain models, optimizers and callables; bench_train.py owns the systems.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from benchmarks._common import mib

PHASES = ("forward", "backward", "optimizer")
Phase = Callable[[str, Callable[[], Any]], Any]  # runs one part of a step: phase(name, fn) -> fn()


def count_collectives(step: Callable[[Phase], None]) -> dict[str, dict[str, Any]]:
    """The c10d ops of one ``step(phase)``, per phase, each phase in a profiler session of its own.

    Every path to the process group goes through a ``c10d::`` op: funcol in eager code and in
    Inductor's generated code, DTensor's redistributions, ``dist.*`` calls. Per phase: a text
    ("3 allreduce (1 via dist)": how many were not issued by a ``_c10d_functional`` op, such as
    dynashard's per-call input check) and the input shapes of the funcol ones."""
    from torch.profiler import ProfilerActivity, profile

    counts: dict[str, dict[str, Any]] = {}

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = fn()
        found = tally_collectives(prof)
        counts[name] = {"text": found["text"], "funcol_shapes": found["funcol_shapes"]}
        return out

    step(phase)
    return counts


def tally_collectives(prof: Any) -> dict[str, Any]:
    """The ``c10d::`` ops of a finished profiler session: a text ("3 allreduce (1 via dist)": how many
    were not issued by a ``_c10d_functional`` op), the counts, and the funcol ops' input shapes."""
    ops: collections.Counter[str] = collections.Counter()
    direct: collections.Counter[str] = collections.Counter()
    shapes = []
    for e in prof.events():
        if e.name.startswith("_c10d_functional::") and "wait_tensor" not in e.name:
            shapes.append(e.input_shapes[0] if e.input_shapes else [])
        if e.name.startswith("c10d::"):
            kind = e.name.removeprefix("c10d::").strip("_")
            ops[kind] += 1
            parent = e.cpu_parent
            direct[kind] += parent is None or not parent.name.startswith("_c10d_functional::")
    text = ", ".join(f"{v} {k}" + (f" ({direct[k]} via dist)" if direct[k] else "") for k, v in sorted(ops.items()))
    return {"text": text or "none", "counts": dict(ops), "via_dist": dict(direct), "funcol_shapes": shapes}


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """fd 2 to /dev/null: kineto prints two lines on every profiler start and stop, with no switch
    to turn them off (the profiled step's own warnings go with them)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (a DTensor's local tensor)."""
    params = list({id(p): p for p in model.parameters()}.values())
    return {
        "params": sum(_bytes(p) for p in params),
        "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    }


def saved_bytes(forward: Callable[[], torch.Tensor], model: nn.Module) -> int:
    """Bytes of the activations ``forward()`` saves for its backward: each storage counted once,
    ``model``'s parameters not counted (the graph is dropped unused)."""
    storages: dict[int, int] = {}
    weights = {_storage(p) for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device.type != "meta" and local.untyped_storage().nbytes() and _storage(local) not in weights:
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    del loss
    return sum(storages.values())


def _storage(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else -1


def target_bytes(model: nn.Module, opt: torch.optim.Optimizer, sharded: set[str], world: int) -> float:
    """``model``'s (unsharded) parameter, gradient and optimizer state bytes, every tensor of a
    parameter in ``sharded`` counted 1/world (a 0-d tensor, AdamW's step, whole)."""
    total = 0.0
    for name, p in model.named_parameters():
        for t in [p, p.grad, *opt.state[p].values()]:
            if torch.is_tensor(t):
                total += _bytes(t) / (world if name in sharded and t.dim() else 1)
    return total


def _slice_like(whole: torch.Tensor, local: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's even slice of ``whole`` with ``local``'s shape (whole when the shapes agree)."""
    dims = [d for d in range(whole.dim()) if whole.shape[d] != local.shape[d]]
    if not dims:
        return whole
    (d,) = dims
    if whole.shape[d] != world * local.shape[d]:
        raise ValueError(f"a shard of shape {tuple(local.shape)} is not an even cut of {tuple(whole.shape)}")
    return whole.narrow(d, rank * local.shape[d], local.shape[d])


def grad_error(model: nn.Module, whole: dict[str, torch.Tensor], rank: int, world: int) -> float:
    """The largest gradient error of ``model``'s parameters against the unsharded gradients
    ``whole`` (by name; a shard against the same slice, a DTensor gathered), relative to the
    largest element of each unsharded gradient. A parameter without a gradient raises."""
    worst = 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            raise RuntimeError(f"{name}: no gradient after backward")
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = _slice_like(whole[name], got, rank, world)
        worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    return worst


def _ratio(r: dict[str, Any], by_name: dict[str, float], base: str) -> str:
    return f"{r['median_ms'] / by_name[base]:.2f}" if base in by_name and "median_ms" in r else "n/a"


def table(group: list[dict[str, Any]], world: int) -> str:
    """One workload at one token count: every system, ratios, phases, collectives, memory."""
    by_name = {r["system"]: r["median_ms"] for r in group if "median_ms" in r}
    head = group[0]
    lines = [
        f"### {head['workload']}, {head['tokens']} tokens, world {world} (one training step, slowest rank)",
        "",
        "| system | median ms | vs bound | vs DTensor compiled | fwd / bwd / opt ms | collectives fwd; bwd; opt "
        "| params+grads+AdamW MiB/rank | vs target | saved for backward MiB/rank | grad err | setup + first step s |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in group:
        if "error" in r:
            lines.append(f"| {r['system']} | FAILED: {r['error'][:300]} |")
            continue
        ph, c = r["phase_median_ms"], r["collectives"]
        lines.append(
            f"| {r['system']} | {r['median_ms']:.2f} | {_ratio(r, by_name, 'bound')} "
            f"| {_ratio(r, by_name, 'dtensor inductor')} | {' / '.join(f'{ph[p]:.1f}' for p in PHASES)} "
            f"| {'; '.join(c[p]['text'] for p in PHASES)} | {mib(r['state_total_bytes'])} "
            f"| {r['state_total_bytes'] / r['state_target_bytes']:.3f} | {mib(r['saved_bytes'])} "
            f"| {r['grad_rel_err']:.1e}{'' if r['ok'] else ' (FAIL)'} | {r['first_call_s']:.1f} |"
        )
    target = next((r["state_target_bytes"] for r in group if "state_target_bytes" in r), None)
    if target is not None:
        lines.append(f"\nTarget (1/{world} of the planned tensors + the replicated ones): {mib(target)} MiB per rank.")
    return "\n".join(lines)


def verdict(results: list[dict[str, Any]]) -> str:
    """The issue's targets for dynashard inductor, one line per workload and token count."""
    lines = ["dynashard inductor against the targets (<= 1.05x bound, <= 1.0x DTensor compiled, state within 10%):"]
    keys = list(dict.fromkeys((r["workload"], r["tokens"]) for r in results))
    for w, t in keys:
        group = {r["system"]: r for r in results if (r["workload"], r["tokens"]) == (w, t)}
        d = group.get("dynashard inductor")
        if d is None or "median_ms" not in d:
            lines.append(f"  {w} t={t}: " + (d["error"][:200] if d else "not run"))
            continue
        parts = []
        for base, limit in (("bound", 1.05), ("dtensor inductor", 1.0)):
            if base in group and "median_ms" in group[base]:
                x = d["median_ms"] / group[base]["median_ms"]
                parts.append(f"{x:.2f}x {base} ({'met' if x <= limit else 'missed'})")
        m = d["state_total_bytes"] / d["state_target_bytes"]
        parts.append(f"state {m:.3f}x target ({'met' if abs(m - 1) <= 0.10 else 'missed'})")
        lines.append(f"  {w} t={t}: " + ", ".join(parts))
    return "\n".join(lines)
