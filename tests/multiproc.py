"""Run a function on N real processes (gloo on CPU) and bring back each rank's result or error.

FileStore rendezvous (no ports), one thread per rank, and a deadline at every layer: the gloo
timeout, the join deadline here, and pytest-timeout above. A rank that raises is reported with
its rank and traceback; a rank that hangs past the deadline gets the whole group killed.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

_CTX = mp.get_context("spawn")


class RankError(Exception):
    """One rank raised; ``exc_type`` and ``message`` describe its exception."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str) -> None:
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n{tb}")
        self.rank, self.exc_type, self.message = rank, exc_type, message


def _worker(fn, rank, world, init_file, gloo_timeout, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if world > 0:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=gloo_timeout),
            )
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        if world > 0 and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240, gloo_timeout: float = 60) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process group member.

    Returns per-rank results; the lowest failing rank's :class:`RankError` is raised.
    """
    outcomes = run_ranks_outcomes(fn, world, *args, timeout=timeout, gloo_timeout=gloo_timeout)
    for o in outcomes:
        if isinstance(o, RankError):
            raise o
    return outcomes


def run_ranks_outcomes(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240, gloo_timeout: float = 60
) -> list[Any]:
    """Like :func:`run_ranks` but returns a :class:`RankError` in place of each failed rank's result."""
    fd, init_file = tempfile.mkstemp(prefix="dynashard-store-")
    os.close(fd)
    os.unlink(init_file)  # FileStore wants to create it
    queue = _CTX.Queue()
    procs = [
        _CTX.Process(target=_worker, args=(fn, r, world, init_file, gloo_timeout, args, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, payload = queue.get(timeout=1)
                results[rank] = payload if status == "ok" else RankError(rank, *payload)
                continue
            except queue_module.Empty:
                pass
            for r, p in enumerate(procs):  # a rank that exited without reporting died
                if r not in results and p.exitcode is not None and queue.empty():
                    results[r] = RankError(r, "Died", f"exit code {p.exitcode}", "")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout}s (results so far: {results})")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    return [results[r] for r in range(world)]
