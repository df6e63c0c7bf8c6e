"""Run a function on N real processes (gloo on CPU) and bring back each rank's result or error.

FileStore rendezvous (no ports), one thread per rank, and a deadline at every layer: the gloo
timeout, the join deadline here, and pytest-timeout above. A rank that raises is reported with
its rank and traceback; a rank that hangs past the deadline gets the whole group killed.
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

# Ranks fork from a server that has already imported torch, Dynamo, dynashard and the test models
# (a fresh interpreter per rank, as "spawn" gives, but without paying the imports each time): a
# 2-rank spawn that compiles an MLP took 2.9 s with "spawn" and 0.95 s this way on the project's
# 2-core machine (tools/bench_spawn.py). The server runs no torch op, so no thread pool exists to be forked.
_CTX = mp.get_context("forkserver")
# HF's Llama modules (0.8 s of imports: most HF tests' models share them) and Inductor's compile_fx (0.7 s) are
# imported by most ranks on their first HF model or Inductor compile; importing them creates no thread or process.
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "dynashard.dynamo_backend",
                             "dynashard.load.parallelize", "tests.battery", "tests.scenarios", "transformers",
                             "transformers.models.llama.modeling_llama", "torch._inductor.compile_fx",
                             "tests.forkserver_ready"])  # (last: the collector's settings, tests/gc_policy.py)

# A torchrun or python subprocess of a test (a tiny model on 2-4 ranks) takes 3-16 s on the project's
# quiet 2-core machine; CI has run that kind of machine 3x slower, and a second 2-process job on the
# same cores doubles it again: 240 s keeps a 2x margin, under pytest-timeout's 300 s (setup.cfg), so
# the subprocess's own timeout, which says what it was running, fires first.
SUBPROCESS_DEADLINE_S = 240


class RankError(Exception):
    """One rank raised; ``exc_type`` and ``message`` describe its exception."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str) -> None:
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n{tb}")
        self.rank, self.exc_type, self.message = rank, exc_type, message


class SharedRunFailed(Exception):
    """A shared run failed (or ran out of time) earlier; this test reads its remembered failure."""


def shared_run(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn(*key)`` once per key for every test that reads it, and remember its outcome:
    the result, or the failure.

    A spawn that many tests share (a battery of cases) must not start again for each of them
    when it fails or times out, as ``functools.lru_cache`` would (it caches only returns): on a
    busy machine that turns one slow battery into one timeout per test. A failure is kept,
    whether ``fn`` raised, hit its own deadline, or was stopped by pytest-timeout (whose
    ``Failed`` is a ``BaseException``), and every later test fails at once with it.
    """
    outcomes: dict[tuple, tuple[bool, Any]] = {}

    @functools.wraps(fn)
    def run(*key: Any) -> Any:
        if key not in outcomes:
            try:
                outcomes[key] = (True, fn(*key))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - kept for every test that reads this run
                outcomes[key] = (False, e)
                raise
        ok, value = outcomes[key]
        if ok:
            return value
        raise SharedRunFailed(
            f"{fn.__name__}{key} failed when an earlier test ran it (its traceback is there): "
            f"{type(value).__name__}: {str(value)[:2000]}"
        )

    return run


def _worker(fn, rank, world, init_file, gloo_timeout, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # The ranks compile as users do, with dynashard's compile cache on (tests/conftest.py turns it off for the
    # test process): each compile stores its graph and compiles the graph read back from the entry, a directory
    # per spawn (its ranks' entries are their own: the key holds the rank). A scenario may point it elsewhere.
    os.environ["DYNASHARD_CACHE"] = "1"
    os.environ["DYNASHARD_CACHE_DIR"] = f"{init_file}-compile-cache"
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


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240, gloo_timeout: float = 60
) -> list[Any]:
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
        shutil.rmtree(f"{init_file}-compile-cache", ignore_errors=True)
    return [results[r] for r in range(world)]
