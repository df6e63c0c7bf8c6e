"""The host-side protocol: how the ranks agree, on CPU, before and around the sharded program.

Every call and every compile starts with :func:`handshake` (one fixed-size all_reduce); failures
are exchanged with :func:`exchange_status` (``with agreed(group, stage):`` around the work each
agreement point follows) / :func:`first_rank_status`, and a rank that does not
arrive is named by a :class:`RollCall` through the store. All of it runs on CPU tensors over
:func:`host_group`: the user's group where it has a CPU backend (gloo, ``"cpu:gloo,cuda:nccl"``),
else a gloo companion over the same ranks. So NCCL groups work (NCCL moves only CUDA tensors), and
no call waits for the device: a host tensor compared on the host never syncs it (vLLM keeps its
metadata on a gloo "cpu group" beside the NCCL one for the same reason). Data (weights, gathers)
moves in ``transport``, over the user's group, on the tensors' device.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import time
import weakref
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dynashard import _torch as private
from dynashard.errors import DynashardError, InternalError, PeerError, SetupError, UsageError

# ``DYNASHARD_HOST_GROUP=companion``: use a gloo companion even where the group has a CPU backend
# (how the CPU tests run the path an NCCL group takes).
HOST_GROUP_ENV = "DYNASHARD_HOST_GROUP"
# user's group -> its host group, or _ITSELF (a value holding the key would keep the group, and its gloo
# threads, alive past destroy_process_group(): see program.drain_gloo_at_exit)
_HOSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ITSELF = object()


def wrap(error: BaseException, stage: str) -> BaseException:
    """Our own errors as they are; anything else wrapped in an :class:`InternalError` naming the stage.

    NOTE: Dynamo turns some backend exceptions (e.g. fake-tensor ``DataDependentOutputException``)
    into a graph break and runs the frame eagerly -- unsharded, with only a warning. Wrapped, it
    is an error like any other. Dynamo's own request to re-trace (``RestartAnalysis``) is not an
    error: it goes back to Dynamo as it is (see ``_torch.is_dynamo_restart``).
    """
    if isinstance(error, DynashardError) or private.is_dynamo_restart(error):
        return error
    wrapped = InternalError(f"dynashard: internal error while {stage}: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped



def host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group over ``group``'s ranks that moves CPU tensors: ``group`` itself when it has a
    CPU backend, else a gloo companion made on first use (once per group).

    The companion is made with ``use_local_synchronization=True``, so only ``group``'s ranks take
    part: a subgroup of a mesh (its tp group) gets one without the other ranks. Its timeout is the
    group's, so a dead peer is reported as late as the user's own collectives would report it.
    torch names it by its ranks and how many groups the process belongs to: ranks whose counts differ
    raise a SetupError (``_companion``) rather than wait for each other under different names.
    """
    if private.is_fake_group(group):
        return group
    host = _HOSTS.get(group)
    if host is None:
        if os.environ.get(HOST_GROUP_ENV) != "companion" and private.moves_cpu_tensors(group):
            host = _ITSELF
        else:
            host = _companion(group)
        _HOSTS[group] = host
    return group if host is _ITSELF else host


def _companion(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks, in its order (results gathered on it are indexed by group rank).

    torch names a group made with ``use_local_synchronization`` by its ranks and the number of groups
    the process belongs to, and its ranks meet under that name: ranks that belong to different numbers
    of groups would wait for each other under different names until the timeout. They compare the count
    first, through the store, and all raise when it differs."""
    ranks, timeout = dist.get_process_group_ranks(group), private.group_timeout(group)
    store, mine = private.default_store(), private.group_count()
    if store is not None and mine is not None:
        count = _SEQUENCE[(group.group_name, "host")] = _SEQUENCE.get((group.group_name, "host"), 0) + 1
        key = f"dynashard/host_group/{group.group_name}/{count}"
        store.set(f"{key}/{dist.get_rank(group)}", str(mine))
        store.wait([f"{key}/{r}" for r in range(len(ranks))], timeout or datetime.timedelta(minutes=30))
        counts = [int(store.get(f"{key}/{r}")) for r in range(len(ranks))]
        if len(set(counts)) > 1:
            raise SetupError(
                f"dynashard: the host-side checks of the group {group.group_name!r} (ranks {ranks}) need a gloo "
                f"companion group, and its ranks belong to different numbers of process groups ({counts}, by "
                "group rank), so torch would give the companion a different name on each. Expected every rank of "
                "the group to create the same process groups; or init_process_group(backend=\"cpu:gloo,cuda:nccl\") "
                "(or new_group(..., backend=\"cpu:gloo,cuda:nccl\")) so the group runs them on its own gloo backend.")
    try:
        return dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True,
                              group_desc=f"dynashard_host_{group.group_name}", sort_ranks=False)
    except (NotImplementedError, ValueError, TypeError) as e:  # (a timeout is a peer's: the caller names it)
        raise SetupError(f"dynashard: could not create the gloo group the host-side checks of {group.group_name!r} "
                         f"run on (its backend moves no CPU tensors): {type(e).__name__}: {e}. Expected "
                         "init_process_group(backend=\"cpu:gloo,cuda:nccl\") to avoid it.") from e


CALL, COMPILE = 1, 2  # what a rank is doing when it meets the others in handshake()
_PHASE = {CALL: "calls the compiled graph", COMPILE: "compiles a new graph (its inputs failed Dynamo's guards)"}
_STAGE = {CALL: "call of the compiled graph", COMPILE: "planning step"}
_HANDSHAKE_FAILURES = [0]


def content_digest(tensors: list[torch.Tensor]) -> int:
    """A checksum of the tensors' bytes (order-independent integer arithmetic: the same on every
    rank for the same values, whatever the threads). Costs one pass over the inputs, on their
    device, and one copy of the per-tensor sums to the host (a device sync for inputs on a GPU)."""
    sums = []
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1)
        raw = flat.view(torch.int32) if (flat.numel() * flat.element_size()) % 4 == 0 else flat.view(torch.uint8)
        raw = raw.to(torch.int64)
        weights = torch.arange(raw.numel(), dtype=torch.int64, device=raw.device) % 65521 + 1
        sums.append((raw * weights).sum())
    total = 0
    for s in torch.stack([s.to(sums[0].device) for s in sums]).tolist() if sums else []:  # one copy to the host
        total = (total * 1000003 + s) % (1 << 61)
    return total


def handshake(phase: int, shapes: list[str], group: dist.ProcessGroup, per_rank: bool = False,
              values: int = 0) -> None:
    """One fixed-size all_reduce that every rank makes before each call *and* before each
    compile of a graph, so ranks whose inputs differ meet on the same collective and all raise.

    Without it, ranks calling with different shapes send collectives of different sizes (gloo
    aborts the process), and a rank whose guards fail (other shapes) recompiles and enters the
    compile agreement while the others run the program's collectives. ``shapes``: this rank's
    input dtypes and shapes (``float32[4, 32]``); with ``per_rank`` inputs only they must agree,
    else ``values`` too (a :func:`content_digest`, 0 when not checked).
    """
    Handshake(phase, shapes, group, per_rank, values).wait()


class Handshake:
    """The :func:`handshake`, started: its all_reduce is on the wire while this rank computes, and
    :meth:`wait` (before the graph's first collective: ``gate``) finishes it, raising what
    :func:`handshake` raises. Every rank's all_reduce pairs with every other's whether it waits at
    once (a compile) or later (a call), since the host group runs them in the order issued."""

    def __init__(self, phase: int, shapes: list[str], group: dist.ProcessGroup, per_rank: bool = False,
                 values: int = 0) -> None:
        self.phase, self.shapes, self.group, self.per_rank = phase, shapes, group, per_rank
        digest = zlib.crc32(repr(shapes).encode())
        self.local = torch.tensor([phase, digest, values, -phase, -digest, -values], dtype=torch.int64)
        self.agreed = self.local.clone()
        self.error: BaseException | None = None
        self.done = False
        try:
            self.work = dist.all_reduce(self.agreed, op=dist.ReduceOp.MAX, group=host_group(group), async_op=True)
        except SetupError:  # (raised on every rank: host_group's own refusal)
            raise
        except Exception as e:  # noqa: BLE001 - gloo/NCCL report a dead or missing peer this way
            raise self._peer_error(e) from e

    def wait(self) -> None:
        """Idempotent: the first call waits and compares; later ones raise the same error, if any."""
        if not self.done:
            self.done = True
            try:
                self._finish()
            except BaseException as e:
                self.error = e
                raise
        if self.error is not None:
            raise self.error

    def _finish(self) -> None:
        try:
            self.work.wait()
        except Exception as e:  # noqa: BLE001 - gloo/NCCL report a dead or missing peer this way
            raise self._peer_error(e) from e
        if not torch.equal(self.agreed, self.local):
            _refuse(self.phase, self.shapes, self.group, self.per_rank, self.agreed)

    def _peer_error(self, e: BaseException) -> PeerError:
        _HANDSHAKE_FAILURES[0] += 1  # the same count on every surviving rank: they fail here together
        missing = RollCall(self.group, f"handshake-failed-{_HANDSHAKE_FAILURES[0]}").missing(wait_s=5.0)
        return PeerError(
            f"dynashard: not every rank reached the {_STAGE[self.phase]} (the process group's timeout bounds the "
            f"wait): {describe_missing(missing)}. The process group said: {type(e).__name__}: {e}"
        )


def _refuse(phase: int, shapes: list[str], group: dist.ProcessGroup, per_rank: bool, agreed: torch.Tensor) -> None:
    """The handshake's values differ: every rank sees the same reduced tensor, so every rank is here
    (safe to gather) and raises, naming each rank's inputs."""
    everyone = all_gather_objects((phase, shapes), group)
    per_rank_shapes = "; ".join(f"rank {r}: {', '.join(s) or 'no tensors'}" for r, (_, s) in enumerate(everyone))
    if int(agreed[0]) != -int(agreed[3]):  # some ranks compile while others call
        doing = "; ".join(f"rank {r} {_PHASE[p]}" for r, (p, _) in enumerate(everyone))
        raise UsageError(
            f"dynashard: the ranks are not running the same compiled graph: {doing}. Expected every rank to "
            f"call the model with inputs of the same shapes (and whatever else Dynamo guards on); input "
            f"shapes per rank: {per_rank_shapes}."
        )
    if per_rank:
        raise UsageError(
            "dynashard: inputs='per_rank' needs every rank to pass inputs of the same shape in a call "
            f"(the batch size may change between calls); input sizes per rank: {per_rank_shapes}."
        )
    if int(agreed[1]) != -int(agreed[4]):
        raise UsageError(
            "dynashard: inputs='replicated' needs every rank to call with the same inputs; found different "
            f"shapes or dtypes: {per_rank_shapes}. Pass the same batch on every rank, or "
            "options={'inputs': 'per_rank'} if each rank has its own batch."
        )
    raise UsageError(
        "dynashard: inputs='replicated' needs every rank to call with the same inputs; their shapes agree "
        f"({per_rank_shapes}) but their values differ (check_inputs compared checksums: of integer inputs such "
        "as token ids on every call, by default). Pass the same batch on every rank (a DataLoader with the same "
        "seed, or broadcast it from rank 0; when sampling, seed every rank alike, e.g. torch.manual_seed(0) "
        "before generate), or options={'inputs': 'per_rank'} if each rank has its own batch."
    )


def all_gather_objects(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's picklable ``obj``.

    NOTE: ``dist.all_gather_object`` needs NumPy in torch 2.13 ("Numpy is not available" without
    it); pickled bytes in a uint8 tensor, padded to the longest, need nothing but torch.
    """
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    world, group = dist.get_world_size(group), host_group(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [pickle.loads(bytes(g[: int(n.item())].tolist())) for g, n in zip(gathered, sizes)]  # small payloads


# Per (group, point): how many times this process has reached it. Counted per point, not per group:
# a failed call's diagnosis runs only on the ranks that failed, and must not shift the keys every
# rank computes for the next agreement.
_SEQUENCE: dict[tuple[str, str], int] = {}


class RollCall:
    """Names the ranks that did not reach a point, through the group's key-value store.

    Each rank marks itself present under a key that is the same on every rank (group, the point's
    name, how many times it was reached); after a failure, the ranks without a mark are the missing
    ones.
    """

    def __init__(self, group: dist.ProcessGroup, point: str) -> None:
        name = group.group_name
        count = _SEQUENCE[(name, point)] = _SEQUENCE.get((name, point), 0) + 1
        self.key = f"dynashard/{name}/{point}/{count}"
        self.store, self.world = private.default_store(), dist.get_world_size(group)
        self.mark(dist.get_rank(group))

    def mark(self, rank: int) -> None:
        if self.store is not None:
            self.store.set(f"{self.key}/{rank}", "1")

    def missing(self, wait_s: float = 0.0) -> list[int] | None:
        """Ranks that have not marked themselves (after waiting up to ``wait_s``); None if unknown."""
        if self.store is None:
            return None
        deadline = time.monotonic() + wait_s
        try:
            while True:
                gone = [r for r in range(self.world) if not self.store.check([f"{self.key}/{r}"])]
                if not gone or time.monotonic() >= deadline:
                    return gone
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store may have died with its host rank
            return None


def describe_missing(missing: list[int] | None) -> str:
    if missing is None:
        return "which rank is missing is unknown (no store)"
    if not missing:
        return "every rank got there"
    return f"ranks {missing} did not get there (died, hang, or run different code)"


def peer_failure(group: dist.ProcessGroup, stage: str, error: BaseException, wait_s: float = 5.0) -> PeerError | None:
    """After ``error`` at ``stage`` on this rank: a :class:`PeerError` naming the ranks that did not fail
    there too (died, hang or run other code: a roll call through the store), or None when every rank
    failed at ``stage`` alike (an error of its own: the model's, raised as it is)."""
    if isinstance(error, PeerError) or private.is_fake_group(group):
        return None
    missing = RollCall(group, f"failed: {stage}").missing(wait_s=wait_s)
    if missing == []:
        return None
    return PeerError(f"dynashard: {stage} failed on rank {dist.get_rank(group)}: {describe_missing(missing)}. The "
                     f"process group said: {type(error).__name__}: {error}")


@contextlib.contextmanager
def peer_guard(group: dist.ProcessGroup, stage: str):
    """``with peer_guard(group, "stage"):`` around collectives every rank makes: a dead or hung peer is a
    :class:`PeerError` naming it and the stage, not the process group's own error."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised, named, below
        named = peer_failure(group, stage, e)
        if named is None:
            raise
        raise named from e


def exchange_status(payload: Any, error: BaseException | None, group: dist.ProcessGroup, stage: str) -> list[Any]:
    """Every rank's ``payload``, or the same error on every rank if any rank failed at ``stage``.

    A rank that failed still joins this collective, so the others learn which rank failed and
    why instead of waiting for it in a later collective. A rank that died or hangs surfaces as
    the process group's timeout, reported here with the ranks that never arrived.
    """
    status = None if error is None else f"{type(error).__name__}: {error}"
    roll = RollCall(group, stage)
    try:
        everyone = all_gather_objects((payload, status), group)
    except SetupError:  # (raised on every rank: host_group's own refusal)
        raise
    except Exception as e:  # noqa: BLE001 - gloo/NCCL report a dead or missing peer this way
        missing = roll.missing()
        what = "not every rank reached" if missing != [] else "every rank reached, but the collective failed at"
        raise PeerError(
            f"dynashard: {what} the {stage} step (the process group's timeout bounds the wait): "
            f"{describe_missing(missing)}. The process group said: {type(e).__name__}: {e}"
        ) from (error or e)
    failed = [(r, msg) for r, (_, msg) in enumerate(everyone) if msg is not None]
    if failed:
        if error is not None:
            raise error
        rank, msg = failed[0]
        raise PeerError(
            f"dynashard: rank {rank} failed during {stage}: {msg}\nThis rank stops too rather than "
            "wait for it in a collective."
        )
    return [p for p, _ in everyone]


class Agreement:
    """What ``with agreed(...) as point:`` hands its body: the body may set ``point.payload`` (this
    rank's, picklable); after the block ``point.everyone`` holds every rank's, by group rank."""

    def __init__(self) -> None:
        self.payload: Any = None
        self.everyone: list[Any] = []


@contextlib.contextmanager
def agreed(group: dist.ProcessGroup, stage: str, doing: str | None = None) -> Iterator[Agreement]:
    """``with agreed(group, stage) as point:`` around work every rank does before they go on together.

    An exception in the body becomes ``wrap(e, doing or stage)`` (our own errors as they are);
    then every rank meets in one :func:`exchange_status` at ``stage``, failed or not, and if any rank
    failed every rank raises: its own error, or a PeerError naming the rank that failed. A fake group
    moves no data: its error is raised here, and ``everyone`` is this rank's payload once per rank.
    """
    point, error = Agreement(), None
    try:
        yield point
    except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange below
        error = wrap(e, doing or stage)
    if private.is_fake_group(group):
        if error is not None:
            raise error
        point.everyone = [point.payload] * dist.get_world_size(group)
        return
    point.everyone = exchange_status(point.payload, error, group, stage)  # (raises whenever error is set)


def first_rank_status(error: BaseException | None, group: dist.ProcessGroup, what: str) -> None:
    """Group rank 0's ``error`` (None: it went well) raised on every rank, at the same point."""
    status = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    dist.broadcast(status, src=dist.get_global_rank(group, 0), group=host_group(group))
    if not int(status.item()):
        return
    message = all_gather_objects(None if error is None else f"{type(error).__name__}: {error}", group)[0]
    if error is not None:
        raise error
    raise PeerError(f"dynashard: rank 0 failed while {what}: {message}\nThis rank stops too.")


def resolve_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """``group``, or the default group; a clear error when torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise SetupError(
            "dynashard: no process group is initialized. Expected torch.distributed to be set up "
            "before the first call of the compiled model: call dist.init_process_group() (launched "
            "with torchrun, e.g. `torchrun --nproc-per-node 2 app.py`), or use dynashard.explain() "
            "to inspect a plan in a single process."
        )
    return group if group is not None else dist.group.WORLD
