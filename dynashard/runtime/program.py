"""The runtime program: what Dynamo calls on every call of a sharded graph.

Every call starts one small handshake with the other ranks (:class:`CallCheck`: its input shapes
agree), finished before the graph's first collective: inside the graph, by its gate (``gate.py``:
the computation before it overlaps the round trip), or else before the call. This rank's shards are
swapped in for the freed full weights (a parameter seen for the first time -- another instance of
the module class -- is adopted: agreed across ranks, cut and freed) and the compiled graph runs. A
failure names the ranks that did not fail with this one (dead or hung peers).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from dynashard import _torch as private
from dynashard.capture.aliases import mutated_roots
from dynashard.comm.protocol import CALL, COMPILE, Handshake, agreed, content_digest, peer_failure
from dynashard.errors import SetupError, UsageError
from dynashard.options import Options
from dynashard.report import progress
from dynashard.report.table import human_bytes
from dynashard.runtime.gate import Opened
from dynashard.training import fsdp, gradients
from dynashard.training.optimizers import FREED
from dynashard.weights.facades import is_facade
from dynashard.weights.freed import free, hold
from dynashard.weights.store import STORE, ShardSpec, Source

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CallCheck:
    """What a rank tells the others before every call and every compile of a graph: its input
    shapes (and a checksum of values, see ``check_inputs``), in one small all_reduce.

    Ranks that differ meet there and all raise, naming each rank's shapes, before any collective
    of the graph (gloo aborts the process on collectives of different sizes) and before a rank
    whose guards failed enters the compile agreement while the others run the graph.

    ``check_inputs="ids"`` (the default) also compares the values of integer inputs on every call
    (token ids and positions: a few KiB, one pass) and of every input when a graph is compiled: a
    per-rank DataLoader of token batches, or sampling with ranks seeded differently (HF
    ``do_sample=True``: the next step's ids differ), is an error at the first call it happens,
    instead of every rank computing on a mix of batches. Float inputs differing only later (a per-rank
    DataLoader of images) are caught by ``"values"``, which checksums every input every call.
    """

    module_state: frozenset[int]  # parameter and buffer slots: checked once, at compile time
    per_rank: bool
    mode: str  # options.check_inputs

    @classmethod
    def for_graph(cls, gm: torch.fx.GraphModule, options: Options) -> CallCheck | None:
        """None with ``check_inputs="off"``: no per-call collective (a mismatch then aborts or hangs)."""
        if options.check_inputs == "off":
            return None
        slots = [n for n in gm.graph.nodes if n.op == "placeholder"]
        state = frozenset(i for i, n in enumerate(slots) if private.placeholder_source_fqn(n) is not None)
        return cls(state, options.inputs == "per_rank", options.check_inputs)

    def _checked(self, phase: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The inputs whose values this call compares (none under inputs="per_rank": they differ by design)."""
        if self.per_rank or self.mode == "shapes":
            return []
        # (a meta tensor has no values; a facade, a cache this rank holds a shard of, none here: its shard
        # is the program's own, made alike on every rank)
        tensors = [t for t in tensors if not t.is_meta and not is_facade(t) and not STORE.is_sharded(t)]
        if self.mode == "values" or phase == COMPILE:
            return tensors
        return [t for t in tensors if not (t.is_floating_point() or t.is_complex())]

    def __call__(self, phase: int, args: Any, group: dist.ProcessGroup) -> None:
        self.start(phase, args, group).wait()

    def start(self, phase: int, args: Any, group: dist.ProcessGroup) -> Handshake:
        """The handshake on the wire; its ``wait()`` raises what a mismatch raises."""
        inputs = [a for i, a in enumerate(args) if i not in self.module_state]
        tensors = [a for a in inputs if torch.is_tensor(a)]  # (symbolic sizes arrive as ints: in these shapes)
        checked = self._checked(phase, tensors)
        values = content_digest(checked) if checked else 0
        described = [f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors]
        return Handshake(phase, described, group, self.per_rank, values)


class ShardedProgram:
    """What Dynamo calls: swaps this rank's shards in for the (freed) full weights.

    Looks the shard up by the parameter passed in each slot (the store is keyed weakly by
    parameter, so shards die with the model): Dynamo reuses one compiled program for every
    instance of a module class (two models, or each block of a model compiled on its own), and a
    parameter it has not seen yet is adopted -- agreed across ranks, cut and freed -- on first use.
    """

    def __init__(
        self,
        compiled: Callable[..., Any],
        specs: dict[int, tuple[str, ShardSpec]],
        graph: torch.fx.GraphModule,
        options: Options,
        group: dist.ProcessGroup,
        fingerprint: str,
        check: CallCheck | None,
        train: bool = False,
        held: dict[int, ShardSpec] | None = None,
        gate: int | None = None,
    ) -> None:
        self.compiled = compiled
        # the slot of the graph's gate (gate.insert), which finishes the call's handshake before its first
        # collective; None: the handshake is finished before the graph runs
        self.gate = gate
        # output slot -> how a cache the program allocates (or grows by cat) is cut: handed back as a facade
        # (freed.hold)
        self.held = held or {}
        if self.held:
            log.log(progress.level(), "dynashard: graph outputs %s are caches the graph allocates or grows, returned "
                    "as this rank's shards (storage-less full-shape tensors outside the compiled model)",
                    sorted(self.held))
        # compiled with gradients: shards are passed as the leaves the gradients land in (the
        # parameters parallelize registered), and the call runs with autograd on
        self.train = train
        self.specs = specs  # input slot -> (FQN, how that parameter is cut)
        slots = [n for n in graph.graph.nodes if n.op == "placeholder"]
        self.written = frozenset(slots.index(n) for n in mutated_roots(graph.graph) if n in slots)
        self.fqns = sorted({fqn for fqn, _ in specs.values()})
        self.graph = graph  # this rank's rewritten aten graph, before the compiler
        self._group = _WeakGroup(group)  # adoption, naming missing ranks after a failed call
        self.check = None if private.is_fake_group(group) else check  # a fake group moves no data
        self.options, self.fingerprint = dataclasses.replace(options, group=None), fingerprint
        self.replays = private.uses_cudagraphs(options.compiler, options.mode)  # (held outputs are copied)
        self.failures = 0
        self.live: frozenset[int] = frozenset()  # input slots of dtensor=True facades (fsdp.current)

    @property
    def group(self) -> dist.ProcessGroup:
        return self._group()

    def compiled_for(self, group: dist.ProcessGroup) -> bool:
        """Whether this program was compiled for ``group`` (False once the group it was compiled for is gone,
        where :attr:`group` raises)."""
        return self._group.get() is group

    def __call__(self, *args: Any) -> Any:
        group = self.group  # a clear error if it was destroyed, not a failed lookup inside the graph
        handshake = self.check.start(CALL, args, group) if self.check is not None else None
        if handshake is not None and self.gate is None:
            handshake.wait()
        args = list(args)
        # parallelize(dtensor=True): the module's current parameters (FSDP2 swaps them every forward)
        live = {i: fsdp.current(args[i]) for i in self.live if fsdp.is_live(args[i])}
        shards = {i: STORE.shard_for(args[i], spec, fqn) for i, (fqn, spec) in self.specs.items() if i not in live}
        fresh = [i for i, s in shards.items() if s is None]
        if fresh:
            if handshake is not None:  # (adoption's agreement comes after the inputs' on the host group)
                handshake.wait()
            self._adopt(args, fresh)
            shards.update({i: STORE.shard_of(args[i]) for i in fresh})
        for i, shard in shards.items():
            if not shard.is_contiguous():  # (a cache cropped or selected eagerly: a view of its part)
                shard = self._contiguous(i, shard)
            if self.train:  # the leaf the gradient lands in (the parameter parallelize registered)
                shard = STORE.as_parameter(args[i])
                if shard.requires_grad:  # (a frozen weight gets no gradient, and no hook)
                    gradients.mark(shard, group)
            args[i] = shard
        for i, local in live.items():
            args[i] = local
        grads = torch.no_grad() if torch.is_grad_enabled() and not self.train else contextlib.nullcontext()
        with grads, Opened(self.gate, handshake):
            try:
                out = self.compiled(*args)
            except Exception as e:
                if handshake is not None:  # ranks that differ: the cause, raised on every rank
                    handshake.wait()
                if isinstance(e, RuntimeError):
                    self._diagnose(e)
                raise
        if handshake is not None:  # (a graph whose gate did not run: no collective was reached)
            handshake.wait()
        return self._hand_back(out) if self.held else out

    def _contiguous(self, slot: int, shard: torch.Tensor) -> torch.Tensor:
        """A shard in another layout than the graph was compiled for (its fake is contiguous): a copy,
        unless the graph writes into it (the write would land in the copy)."""
        if slot in self.written:
            raise UsageError(
                f"dynashard: {self.specs[slot][0]!r} is a view of this rank's part (an index or slice of a cache "
                "taken eagerly), and the compiled graph writes into it in place. Expected the cache itself, or "
                "a copy: t.clone().")
        return shard.contiguous()

    def _hand_back(self, out: Any) -> Any:
        """Each cache the program allocated or grew, as this rank's shard, goes back to Dynamo (which stores it
        where the model keeps it) as a full-shape facade; the next graph reads the shard by it."""
        out = list(out)
        for i, spec in self.held.items():
            # contiguous, as the next graph's fake of it is (shard_fakes): Inductor may return a grown cache
            # in another layout (k's [B, T, H, D] order, transposed), or a view (a sliding window's slice)
            local = out[i].contiguous()
            if self.replays and local is out[i]:  # a CUDA graph's output memory is its next replay's: a copy
                local = local.clone()
            shape = list(local.shape)
            shape[spec.dim] = spec.split.size
            out[i] = hold(local, torch.Size(shape), spec, f"KV cache returned by the graph (output {i})")
        return out


    def _adopt(self, args: list[Any], fresh: list[int]) -> None:
        """Parameters of another instance of the compiled module class: check them across ranks
        like a compile does, then cut and free them. Every rank calls with its instance, so every
        rank adopts at the same call."""
        if not private.is_fake_group(self.group):
            named = [(self.specs[i][0], args[i]) for i in fresh]
            STORE.agree(named, f"adopt:{self.fingerprint}", self.group, self.options.weights, check_values=True)
        cut_and_free({i: self.specs[i] for i in fresh}, args, self.group)

    def _diagnose(self, error: RuntimeError) -> None:
        """After a failed call, name the ranks that did not fail with us (dead or hung ones)."""
        group = self._group.get()
        if group is None:
            return
        self.failures += 1
        named = peer_failure(group, f"the sharded program's call (failed call {self.failures})", error)
        if named is not None:
            raise named from error


class CompiledOnFirstCall:
    """A graph ``dynashard.parallelize``'s example run compiled, with a compiler other than eager: during that
    run it runs as it is (the run plans, cuts and checks); its first call after the run compiles it (``compile``)
    and every call runs the compiled graph. So ``parallelize`` costs no compiler, and the program it leaves in
    Dynamo's cache serves the user's own ``torch.compile(model, backend="dynashard", options=...)`` with the same
    options, and the parallelized model's plain calls, without a second trace or plan; a call that the entry's
    guards refuse (another grad mode, other arguments) compiles afresh, and this one is never compiled.

    The first call's compile is an agreement point on ``group`` (None: a world of one): a compile that fails on
    one rank raises on every rank instead of leaving the others in the graph's first collective.

    ``facts()``: what the ShapeEnv of the graph's fake inputs knows (``_torch.shape_env_facts``). Dynamo built the
    entry's guards when the run traced it, so a guard the compiler adds now (a size specialised) would never be
    checked: a compile that changes the facts is not used, and the graph runs as traced, with a warning."""

    def __init__(self, graph: Callable[..., Any], compile: Callable[[], Callable[..., Any]],
                 group: dist.ProcessGroup | None, compiler: str, active: Callable[[], bool],
                 facts: Callable[[], Any] | None = None) -> None:
        self.graph, self._compile, self.compiler, self._active = graph, compile, compiler, active
        self._facts = facts
        self._group = _WeakGroup(group) if group is not None else None
        self._grad = torch.is_grad_enabled()  # (the grad mode the graph was traced under: its compile's too)
        self.compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            if self._active():
                return self.graph(*args)
            self.compiled = self._compile_now()
        return self.compiled(*args)

    def _compile_now(self) -> Callable[..., Any]:
        started, cache_before = time.perf_counter(), private.inductor_cache_counts()
        within = agreed(self._group(), "compiling", doing="compiling") if self._group is not None \
            else contextlib.nullcontext()
        before = self._facts() if self._facts is not None else None
        with within, torch.set_grad_enabled(self._grad):
            compiled = self._compile()
        if self._facts is not None and self._facts() != before:
            warnings.warn(
                f"dynashard: compiling a graph parallelize planned ({progress.compiler_name(self.compiler)}), at its "
                "first call, added shape guards (a size specialised) that Dynamo's entry for it, built when "
                "parallelize traced it, does not check: the compiled graph is not used, and the graph runs as "
                "traced, uncompiled (right for every size Dynamo lets through, slower). Expected a compile that adds "
                "no guard: please report this model; example inputs of static sizes (no mark_dynamic) avoid it.",
                stacklevel=2)
            compiled = self.graph
        log.log(progress.level(), "dynashard: compiled a graph parallelize planned (%s), at its first call%s: %.2f s",
                progress.compiler_name(self.compiler), progress.cache_words(cache_before),
                time.perf_counter() - started)
        return compiled


class CheckFirst:
    """A graph left whole: no shards and no collectives, but every call still meets the other ranks
    in the :class:`CallCheck`, so a rank that recompiles on other shapes is an error, not a hang in
    the next graph's collectives."""

    def __init__(self, compiled: Callable[..., Any], group: dist.ProcessGroup, check: CallCheck) -> None:
        self.compiled, self._group, self.check = compiled, _WeakGroup(group), check

    def __call__(self, *args: Any) -> Any:
        self.check(CALL, args, self._group())
        return self.compiled(*args)


_GLOO_GROUPS: weakref.WeakSet = weakref.WeakSet()  # gloo groups compiled for (alive at exit?)
_GLOO_EXIT_GRACE_S = 0.2
_EXIT_HOOK: list[bool] = []  # registered once


def drain_gloo_at_exit(group: dist.ProcessGroup) -> None:
    """Give gloo's worker threads time to let go of finished collectives before the interpreter
    shuts down.

    NOTE: torch 2.13 keeps a process group alive past ``destroy_process_group()`` once Dynamo is
    imported after ``init_process_group()`` (it holds references to the group object), so its
    worker threads outlive the script. A worker that drops a finished collective's tensors takes
    the GIL; if the interpreter is already finalizing, the thread is ended inside a destructor
    and the process aborts ("terminate called without an active exception", SIGABRT), after a
    run that succeeded. Seen in CI; reproduced 3 times in 30 four-rank runs of a bare funcol loop
    (``tools/bench_exit_abort.py``). Sleeping here (GIL released, before finalization) lets them finish.

    Upstream: https://github.com/pytorch/pytorch/issues/190489 (open: torch's ``decref`` guard checks
    ``Py_IsInitialized()``, still true during finalization, then takes the GIL from a background
    thread); an atexit ``destroy_process_group`` was proposed and abandoned in
    https://github.com/pytorch/pytorch/pull/179291. Remove this hook once a torch release fixes it.
    See docs/design.md, "A gloo group alive at interpreter exit".
    """
    if private.is_fake_group(group):  # (an NCCL group's host-side protocol runs on gloo too: protocol.host_group)
        return
    if not _EXIT_HOOK:
        atexit.register(_let_gloo_workers_finish)
        _EXIT_HOOK.append(True)
    _GLOO_GROUPS.add(group)


def _let_gloo_workers_finish() -> None:
    if len(_GLOO_GROUPS):
        time.sleep(_GLOO_EXIT_GRACE_S)


class _WeakGroup:
    """A compiled program's process group, held weakly.

    Dynamo keeps compiled programs until the interpreter exits. A strong reference would keep the
    group alive past ``dist.destroy_process_group()``, and with it gloo's worker threads, which
    then free a collective's tensors during interpreter shutdown and abort the process
    ("terminate called without an active exception").
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._ref = weakref.ref(group)
        self._name = getattr(group, "group_name", "?")

    def get(self) -> dist.ProcessGroup | None:
        return self._ref()

    def __call__(self) -> dist.ProcessGroup:
        group = self._ref()
        if group is None:
            raise SetupError(
                f"dynashard: the process group {self._name!r} this model was compiled for has been destroyed "
                "(dist.destroy_process_group). Expected the group to outlive every call of the compiled "
                "model; after a new init_process_group, compile again (torch.compiler.reset() first)."
            )
        return group


def cut_and_free(specs: dict[int, tuple[str, ShardSpec]], inputs: list[Any], group,
                 source: Source | None = None) -> None:
    """Cut this rank's shards into the store and free the full weights, one at a time (peak:
    model + one shard).

    At compile time this runs only once the sharded program compiled on every rank: a failed
    compile leaves the model whole.
    """
    keep = [a for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and i not in specs]
    freed = 0
    order = sorted(specs.items())
    for n, (i, (fqn, spec)) in enumerate(order):
        STORE.shard(inputs[i], spec, fqn, group, source)
        later = [inputs[j] for j, _ in order[n + 1 :]]  # may share this one's storage: cut them first
        freed += free([inputs[i]], keep + later)
    freed += free([inputs[i] for i, _ in order], keep)
    FREED.add([inputs[i] for i, _ in order])  # (an optimizer over them is refused while they live)
    if freed:  # (rank 0 says it at INFO; the compile's summary line follows)
        log.log(progress.level(), "dynashard: cut %d weights, freed %s of full weights", len(order), human_bytes(freed))
    elif order:  # (a model built on meta, loaded a slice at a time, or shards already held)
        log.debug("dynashard: cut %d weights; no full copy was in memory, nothing to free", len(order))
