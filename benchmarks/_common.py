"""Helpers shared by the benchmark scripts: process group, RSS, per-call timing, JSON records
and where they go, the MLP block, and a progress bar.

Every function here is plain and stateless; the scripts own all configuration.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``x + down(gelu(up(x)))``: the residual MLP block every MLP benchmark measures."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def init(threads: int = 1) -> tuple[int, int]:
    """Join the gloo group torchrun describes (or the one a test harness made); return (rank, world size)."""
    torch.set_num_threads(threads)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size()


def gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order (on every rank)."""
    from dynashard.comm.protocol import all_gather_objects  # needs no NumPy, unlike dist.all_gather_object

    return all_gather_objects(obj, dist.group.WORLD)


def rss() -> dict[str, int]:
    """This process's current (VmRSS) and peak (VmHWM) resident set size in bytes, from /proc."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024  # reported in kB
    return out


def time_call(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes on this rank; a barrier first so all ranks start together."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_interleaved(
    calls: dict[str, Callable[[], Any]], warmup: int, iters: int, on_round: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Seconds per call of each system, one call of every system per round, after ``warmup`` rounds.

    Interleaving makes load drift on a shared machine hit every system alike. ``on_round`` is
    called after every round (a progress bar).
    """
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(warmup + iters):
        for name, fn in calls.items():
            t = time_call(fn)
            if i >= warmup:
                times[name].append(t)
        if on_round is not None:
            on_round()
    return times


def summarize(rank: int, per_system: dict[str, dict[str, Any]], times: dict[str, list[float]]) -> list[dict[str, Any]]:
    """One result per system across ranks (a collective): the slowest rank's median and min."""
    results = []
    for name, mine in per_system.items():
        mine = {"rank": rank, **mine, "median_s": statistics.median(times[name]), "min_s": min(times[name]),
                "times_s": times[name]}
        per_rank = gather(mine)
        results.append({
            "system": name,
            "median_ms": 1e3 * max(r["median_s"] for r in per_rank),
            "min_ms": 1e3 * max(r["min_s"] for r in per_rank),
            "first_call_s": max(r["first_s"] for r in per_rank),
            "max_abs_diff": _max_or_none(r["max_abs_diff"] for r in per_rank),
            "per_rank": per_rank,
        })
    return results


def _max_or_none(values: Any) -> float | None:
    """The largest value, ignoring None (a system with no output to check has None everywhere)."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


class Progress:
    """A one-line progress bar on stderr, rank 0 only: ``[#####.....] 12/40  block t=256: timing``.

    Redrawn in place on a terminal; under a pipe (CI, torchrun --tee) one line per 5% instead.
    """

    def __init__(self, total: int, enabled: bool, width: int = 30) -> None:
        self.total, self.enabled, self.width = max(1, total), enabled, width
        self.done, self.label, self.t0, self._printed = 0, "", time.perf_counter(), -1
        self.tty = sys.stderr.isatty()

    def step(self, n: int = 1, label: str | None = None) -> None:
        self.done = min(self.total, self.done + n)
        self.show(label)

    def show(self, label: str | None = None) -> None:
        changed = label is not None and label != self.label
        if label is not None:
            self.label = label
        if not self.enabled:
            return
        pct = self.done / self.total
        if not self.tty and not changed and int(pct * 20) == self._printed:
            return
        self._printed = int(pct * 20)
        fill = int(pct * self.width)
        line = (f"[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.t0:5.0f}s  {self.label}")
        sys.stderr.write(("\r\033[K" + line) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def hardware() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "processor": platform.processor(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def record(config: dict[str, Any], results: Any, world: int, threads: int) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "hardware": hardware(),
        "world_size": world,
        "threads_per_rank": threads,
        "config": config,
        "results": results,
    }


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
OUT_HELP = "the JSON record (default: benchmarks/results/<script>.json; --smoke: a temporary directory)"


def out_path(out: str | None, name: str, smoke: bool) -> str:
    """Where a record goes: ``out`` if given; a real run's record to ``benchmarks/results/<name>.json``
    (committed); a smoke run's to a temporary directory, so that it never lands among the records."""
    if out:
        return out
    if smoke:
        return os.path.join(tempfile.gettempdir(), "dynashard-bench", f"{name}_smoke.json")
    return os.path.join(RESULTS, f"{name}.json")


def write_json(path: str, rec: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rec, f, indent=2)
        f.write("\n")


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"
