"""What a person sees of a compile: a progress line while a long one runs, one summary line when it
ends, and each distinct plan table once.

Only global rank 0 speaks at INFO (one terminal's worth: every rank compiles the same graph alike);
the other ranks log their summary and table at DEBUG (``TORCH_LOGS=+dynashard``). A plan table is
logged at INFO the first time its plan appears in this process; a later compile with the same plan
(HF ``generate``'s prefill and decode graphs, a recompile for a new batch size) logs it at DEBUG.

Progress: a compile that has run ``DYNASHARD_PROGRESS_S`` seconds (default 5, counted from Dynamo's
start, its trace included; ``off``: never) says on rank 0 what it is doing, at each new stage and every
``DYNASHARD_PROGRESS_EVERY_S`` seconds (default 10) from a daemon thread. With ``TORCH_LOGS=dynashard``
these are INFO lines; without it they go to stderr all the same (a person waiting must see them):
one line rewritten in place on a terminal, plain lines otherwise. A compile under the threshold
prints nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from dynashard import _torch as private
from dynashard.errors import UsageError
from dynashard.report.table import GraphReport, format_table

log = logging.getLogger(__name__)

AFTER_ENV, EVERY_ENV = "DYNASHARD_PROGRESS_S", "DYNASHARD_PROGRESS_EVERY_S"
_SEEN_PLANS: set[str] = set()  # digests of the plans whose table this process logged at INFO
_LOCAL = threading.local()  # .progress: the compile in progress on this thread (stage() reaches it)


def speaks() -> bool:
    """Whether this process is the one that logs at INFO: global rank 0 (or no process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def level() -> int:
    """The level of a line every rank would log alike: INFO on rank 0, DEBUG on the others."""
    return logging.INFO if speaks() else logging.DEBUG


def plan_table(report: GraphReport, rank: int, world: int) -> tuple[str, str]:
    """(the plan's digest, its table): a plan is its rows less the bytes per call, which follow the batch (a
    decode step's graph, same plan)."""
    rows = [dataclasses.replace(r, comm_bytes=0) for r in report.rows + report.caches]
    return hashlib.sha256(repr((rank, world, rows)).encode()).hexdigest(), format_table([report])


def log_plan_table(digest: str, table: str, rank: int, world: int) -> None:
    """The plan table: INFO on rank 0 the first time this plan appears in the process, else DEBUG."""
    first = speaks() and digest not in _SEEN_PLANS
    if first:
        _SEEN_PLANS.add(digest)
    at = logging.INFO if first else logging.DEBUG
    if log.isEnabledFor(at):
        log.log(at, "dynashard plan (rank %d of %d):\n%s", rank, world, table)


def _seconds(name: str, default: float) -> float | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if text.lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise UsageError(f"dynashard: {name}={text!r}. Expected a number of seconds >= 0, or 'off'.")
    return value


class Progress:
    """One compile's progress line: ``stage()`` names what it does now; a daemon thread, started with the
    first stage, repeats it while the compile lasts. Nothing is written before ``after_s`` seconds."""

    def __init__(self, what: str, after_s: float, every_s: float, started: float | None = None) -> None:
        self.what, self.after_s, self.every_s = what, after_s, max(every_s, 0.05)
        self.started = time.time() if started is None else started
        self.current = ""
        self.shown = False  # anything written yet
        self._last: float | None = None  # when the line was last shown
        self._width = 0  # the terminal line's length (padded over when rewritten)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._repeat, name="dynashard-progress", daemon=True)

    def stage(self, name: str) -> None:
        with self._lock:
            first, self.current = not self.current, name
        if time.time() - self.started >= self.after_s:
            self._show()
        if first:  # (started here, after the line above, so its first line names a stage and is no repeat)
            self._thread.start()

    def _due(self) -> float:
        """When the line is shown next: ``after_s`` in, then ``every_s`` after it was last shown."""
        first = self.started + self.after_s
        return first if self._last is None else max(first, self._last + self.every_s)

    def _repeat(self) -> None:
        while not self._done.wait(max(self._due() - time.time(), 0.0)):
            if time.time() >= self._due():  # (else a new stage was shown meanwhile)
                self._show()

    def _show(self) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._last = time.time()
            elapsed = self._last - self.started
            self._write(f"dynashard: compiling graph {self.what}: {self.current} ({elapsed:.0f} s so far)")

    def _write(self, text: str, end: bool = False) -> None:
        self.shown = True
        if log.isEnabledFor(logging.INFO):
            log.info("%s", text)
            return
        stream = sys.stderr
        if stream.isatty():  # one line, rewritten in place; a newline once the compile ends
            width = shutil.get_terminal_size().columns - 1  # (a wrapped line is not rewritten by \r)
            text = text if len(text) <= width else "..." + text[len(text) - width + 3:]  # (the stage and time)
            stream.write("\r" + text.ljust(self._width) + ("\n" if end else ""))
            self._width = len(text)
        else:
            stream.write(text + "\n")
        stream.flush()

    def close(self, failed: bool) -> None:
        with self._lock:
            self._done.set()
            if self.shown and not log.isEnabledFor(logging.INFO):  # (the summary line says it, when logged)
                elapsed = time.time() - self.started
                word = "stopped after" if failed else "in"  # (an error, or Dynamo restarting the trace)
                self._write(f"dynashard: compiled graph {self.what} {word} {elapsed:.0f} s", end=True)
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """The progress of the backend's compile on this thread (rank 0 only; nothing elsewhere)."""
    after_s, every_s = _seconds(AFTER_ENV, 5.0), _seconds(EVERY_ENV, 10.0)
    if after_s is None or every_s is None or not speaks():
        yield
        return
    name, compile_id, _ = private.compile_info()
    progress = Progress(f"{compile_id or '?'} of {name}", after_s, every_s, private.compile_started())
    outer, _LOCAL.progress = getattr(_LOCAL, "progress", None), progress
    failed = True
    try:
        yield
        failed = False
    finally:
        _LOCAL.progress = outer
        progress.close(failed)


def stage(name: str) -> None:
    """The compile on this thread now does ``name`` (a no-op outside ``compiling()``)."""
    progress = getattr(_LOCAL, "progress", None)
    if progress is not None:
        progress.stage(name)


def compiler_name(compiler: str) -> str:
    return {"inductor": "Inductor", "eager": "eager, no compiler"}.get(compiler, compiler)


def log_compile(gm: torch.fx.GraphModule, fake_args: list[Any], plan: str | None, started: float, planned: float,
                cache_before: tuple[int, int, int], dynashard_cache: str) -> None:
    """One line per compile Dynamo asks for (INFO on rank 0, DEBUG elsewhere): which graph, its inputs, why
    it was compiled (a frame's first compile, or the guard of an earlier compile that failed), the plan
    (``plan_summary``), whether dynashard's compile cache and Inductor's FX graph cache served it, the time."""
    if not log.isEnabledFor(level()):
        return
    name, compile_id, reason = private.compile_info()
    slots = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [a for n, a in zip(slots, fake_args)
              if isinstance(a, torch.Tensor) and private.placeholder_source_fqn(n) is None]
    shapes = ", ".join(f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}" for a in inputs) or "none"
    dynamic = any(isinstance(d, torch.SymInt) for a in inputs for d in a.shape)
    why = "first compile of this frame"
    if reason is not None:  # (Dynamo's text: "<earlier compile's id>: <guard>  # <user code>", a line per guard)
        first, *more = reason.splitlines()
        failed, found, guard = first.partition(": ")
        why = f"recompiled: a guard of {failed} failed: {guard.split('  # ')[0]}" if found else f"recompiled: {first}"
        why += f" (and {len(more)} more lines)" if more else ""
    log.log(level(), "dynashard: compiled graph %s of %s for inputs %s (%s shapes); %s; plan: %s; dynashard "
            "cache: %s%s; %.2f s (planning %.2f s)", compile_id or "?", name, shapes, "dynamic" if dynamic else
            "static", why, plan or "no plan", dynashard_cache, cache_words(cache_before),
            time.perf_counter() - started, planned - started)


def cache_words(before: tuple[int, int, int]) -> str:
    """What Inductor's FX graph cache did since ``before`` (``private.inductor_cache_counts()`` then), as the
    end of a compile's summary line ("" when it was not asked: another compiler)."""
    hits, misses, bypasses = (now - then for now, then in zip(private.inductor_cache_counts(), before, strict=True))
    if not hits + misses + bypasses:
        return ""
    done = [f"{n} {word}" for n, word in ((hits, "hit"), (misses, "miss"), (bypasses, "bypass")) if n]
    return f"; Inductor cache: {', '.join(done)}"
