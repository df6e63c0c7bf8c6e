"""The one module that talks to torch.distributed: graph collectives (funcol) and compile-time ones.

Graph collectives are plain functions over ``torch.distributed._functional_collectives``; the
rewrite calls them while tracing, so the graph holds ``_c10d_functional.*`` + ``wait_tensor``
with symbolic batch sizes. Compile-time collectives (checksums, rank-0 weights) use c10d
directly: they run once, outside any trace.
"""

from __future__ import annotations

import contextlib
import pickle
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from dynashard.errors import PeerError, SetupError, UsageError


def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return funcol.all_reduce(x, "sum", group_name)


def all_gather_last_dim(
    x: torch.Tensor, lengths: list[list[int]], rank: int, group_name: str, whole: frozenset[int] = frozenset()
) -> torch.Tensor:
    """Every rank's pieces of the last dim, back in order: ``lengths[c][r]`` is how many elements
    of component ``c`` rank ``r`` holds, and ``x`` holds this rank's pieces side by side.
    Components in ``whole`` are held whole by every rank and are not sent.

    Each piece is padded to the longest rank's (one all_gather of equal blocks), then the padding
    is cut away again: one narrow per run of ranks with equal lengths (two at most when balanced).
    """
    world = len(lengths[0])
    own, offset = [], 0
    for ls in lengths:
        own.append(x.narrow(-1, offset, ls[rank]) if len(lengths) > 1 else x)
        offset += ls[rank]
    cut = [c for c in range(len(lengths)) if c not in whole]
    chunks = {c: max(lengths[c]) for c in cut}
    pieces = [_pad_last(own[c], chunks[c]) for c in cut]
    x = pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)
    gathered = funcol.all_gather_single(x.contiguous(), 0, group_name)  # [world * d0, ...]
    blocks = gathered.view(world, *x.shape).movedim(0, -2)  # [..., world, sum(chunks)]
    out, offset = [], 0
    for c, ls in enumerate(lengths):
        if c in whole:
            out.append(own[c])
            continue
        chunk = chunks[c]
        block = blocks.narrow(-1, offset, chunk) if len(cut) > 1 else blocks
        offset += chunk
        r = 0
        while r < world:  # runs of ranks holding equally many
            end = next((e for e in range(r, world) if ls[e] != ls[r]), world)
            run = block if (r, end) == (0, world) else block.narrow(-2, r, end - r)
            run = run if ls[r] == chunk else run.narrow(-1, 0, ls[r])
            out.append(run.reshape(*run.shape[:-2], (end - r) * ls[r]))
            r = end
    return out[0] if len(out) == 1 else torch.cat(out, -1)


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _blocks(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``x``'s last dim cut into one block per rank (``lengths``), each padded to the longest:
    ``[world, ..., max(lengths)]``."""
    chunk, starts = max(lengths), [sum(lengths[:r]) for r in range(len(lengths))]
    if all(ln == chunk for ln in lengths):
        return x.reshape(*x.shape[:-1], len(lengths), chunk).movedim(-2, 0)
    return torch.stack([_pad_last(x.narrow(-1, s, ln), chunk) for s, ln in zip(starts, lengths)])


def all_gather_rows(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's rows, rank-major (inputs="per_rank": a colwise input)."""
    return funcol.all_gather_single(x.contiguous(), 0, group_name)


def reduce_scatter_rows(x: torch.Tensor, world: int, group_name: str, via_all_to_all: bool) -> torch.Tensor:
    """Sum every rank's partial ``[world * rows, ...]`` and keep this rank's rows.

    gloo's reduce_scatter costs more than an all_reduce of the whole tensor, while an all-to-all of
    the row blocks followed by a local sum moves the same bytes once. benchmarks/bench_collectives.py,
    4 MiB on 4 ranks, medians: reduce_scatter 13.8 ms, all_reduce 9.3 ms, all_to_all + sum 7.5 ms.
    NCCL's reduce_scatter is the real one and is kept there.
    """
    if not via_all_to_all:
        return funcol.reduce_scatter_single(x.contiguous(), "sum", 0, group_name)
    y = funcol.all_to_all_single(x.contiguous(), None, None, group_name)  # block j: rank j's partial
    return y.view(world, x.shape[0] // world, *x.shape[1:]).sum(0)


def shard_to_own_rows(x: torch.Tensor, lengths: list[int], rank: int, group_name: str) -> torch.Tensor:
    """``[world * rows, ..., my cols]`` -> ``[rows, ..., all cols]``: one all-to-all over rows.

    ``lengths[r]``: the columns rank r holds."""
    world = len(lengths)
    chunk = max(lengths)
    x = _pad_last(x, chunk)
    y = funcol.all_to_all_single(x.contiguous(), None, None, group_name)  # block j: my rows, rank j's cols
    rows = x.shape[0] // world
    y = y.view(world, rows, *x.shape[1:]).movedim(0, -2)  # [rows, ..., world, chunk]
    if all(ln == chunk for ln in lengths):
        return y.reshape(rows, *x.shape[1:-1], world * chunk)
    return torch.cat([y.select(-2, r).narrow(-1, 0, ln) for r, ln in enumerate(lengths)], -1)


def own_rows_to_shard(x: torch.Tensor, lengths: list[int], rank: int, group_name: str) -> torch.Tensor:
    """``[rows, ..., all cols]`` -> ``[world * rows, ..., my cols]``: one all-to-all of feature blocks."""
    blocks = _blocks(x, lengths)  # [world, rows, ..., chunk]
    y = funcol.all_to_all_single(blocks.contiguous().flatten(0, 1), None, None, group_name)
    return y.narrow(-1, 0, lengths[rank]) if lengths[rank] != max(lengths) else y


# ---------------------------------------------------------------- training: Megatron's conversions
#
# With gradients, each conversion the rewrite emits needs the backward Megatron gives it
# (research/training.md 1), not funcol's own autograd, whose all_reduce and all_gather backwards
# have "sum of per-rank losses" semantics (world-size times the gradient here, measured):
#
# - copy_to_shards (f): identity forward; all_reduce backward. A replicated value read by an op
#   whose output is sharded: each rank's gradient for it is only its own part's contribution.
# - reduce_from_shards (g): all_reduce forward; identity backward (every rank's gradient of the sum
#   is the same replicated gradient).
# - gather_from_shards: all_gather forward; backward keeps this rank's pieces of the (replicated)
#   gradient, no communication.
#
# They are autograd.Functions, and make_fx (the rewrite's trace) would inline a Function and drop its
# backward. So the rewrite traces an opaque marker op, ``dynashard::tp_conversion(x, key)``, and
# then points each marker node at its Function (``bind_conversions``): AOTAutograd, tracing the
# rewritten graph for the compiler, runs the Function and keeps its backward (measured:
# tools/proto_train_fg.py, gradients equal the unsharded model's under eager, aot_eager and Inductor).

_CONVERSIONS: dict[str, Any] = {}  # marker key -> the conversion (x -> y, with its backward)


@torch.library.custom_op("dynashard::tp_conversion", mutates_args=())
def tp_conversion(x: torch.Tensor, key: str) -> torch.Tensor:
    with torch.no_grad():
        return _CONVERSIONS[key](x).clone()


@tp_conversion.register_fake
def _tp_conversion_fake(x: torch.Tensor, key: str) -> torch.Tensor:
    out = _CONVERSIONS[key](x.detach())
    return out.new_empty(out.shape)


def conversion(x: torch.Tensor, fn: Any) -> torch.Tensor:
    """``fn(x)`` in a traced graph as a marker that :func:`bind_conversions` turns back into ``fn``."""
    key = f"c{len(_CONVERSIONS)}"
    _CONVERSIONS[key] = fn
    return torch.ops.dynashard.tp_conversion(x, key)


def bind_conversions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Each marker node calls its conversion (an autograd.Function) instead."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.dynashard.tp_conversion.default:
            node.target = _CONVERSIONS[node.args[1]]
            node.args = (node.args[0],)
    gm.recompile()
    return gm


class _CopyToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # (waited: run eagerly, funcol returns an AsyncCollectiveTensor, which would land in a .grad)
        with peer_guard(_group_named(ctx.group_name), BACKWARD):
            return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group_name)), None


class _ReduceFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, lengths: list[list[int]], rank: int, group_name: str) -> torch.Tensor:
        ctx.lengths, ctx.rank = lengths, rank
        with torch.no_grad():
            return all_gather_last_dim(x, lengths, rank, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pieces, offset = [], 0
        for ls in ctx.lengths:  # component by component: this rank's pieces of each
            pieces.append(grad.narrow(-1, offset + sum(ls[: ctx.rank]), ls[ctx.rank]))
            offset += sum(ls)
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)), None, None, None


BACKWARD = "the backward of the sharded program"


def _group_named(name: str) -> dist.ProcessGroup:
    from dynashard import _torch_private as private

    return private.group_by_name(name)


def copy_to_shards(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return conversion(x, lambda v: _CopyToShards.apply(v, group_name))


def reduce_from_shards(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return conversion(x, lambda v: _ReduceFromShards.apply(v, group_name))


def gather_from_shards(x: torch.Tensor, lengths: list[list[int]], rank: int, group_name: str) -> torch.Tensor:
    return conversion(x, lambda v: _GatherFromShards.apply(v, lengths, rank, group_name))


def exchange_blocks(t: torch.Tensor, dim: int, lengths: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """weights="per_rank": ``[world, *block]`` holding this rank's block of every rank's ``t``."""
    moved = t.detach().movedim(dim, -1)
    send = _blocks(moved, lengths).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.narrow(-1, 0, lengths[rank]).movedim(-1, dim + 1).contiguous()


CALL, COMPILE = 1, 2  # what a rank is doing when it meets the others in handshake()
_PHASE = {CALL: "calls the compiled graph", COMPILE: "compiles a new graph (its inputs failed Dynamo's guards)"}
_STAGE = {CALL: "call of the compiled graph", COMPILE: "planning step"}
_HANDSHAKE_FAILURES = [0]


def content_digest(tensors: list[torch.Tensor]) -> int:
    """A checksum of the tensors' bytes (order-independent integer arithmetic: the same on every
    rank for the same values, whatever the threads). Costs one pass over the inputs."""
    total = 0
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1)
        raw = flat.view(torch.int32) if (flat.numel() * flat.element_size()) % 4 == 0 else flat.view(torch.uint8)
        raw = raw.to(torch.int64)
        weights = torch.arange(raw.numel(), dtype=torch.int64, device=raw.device) % 65521 + 1
        total = (total * 1000003 + int((raw * weights).sum())) % (1 << 61)
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
    digest = zlib.crc32(repr(shapes).encode())
    local = torch.tensor([phase, digest, values, -phase, -digest, -values], dtype=torch.int64)
    agreed = local.clone()
    try:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    except Exception as e:  # noqa: BLE001 - gloo/NCCL report a dead or missing peer this way
        _HANDSHAKE_FAILURES[0] += 1  # the same count on every surviving rank: they fail here together
        missing = RollCall(group, f"handshake-failed-{_HANDSHAKE_FAILURES[0]}").missing(wait_s=5.0)
        raise PeerError(
            f"dynashard: not every rank reached the {_STAGE[phase]} (the process group's timeout bounds the "
            f"wait): {describe_missing(missing)}. The process group said: {type(e).__name__}: {e}"
        ) from e
    if torch.equal(agreed, local):
        return
    # Every rank sees the same reduced tensor, so every rank takes this branch: safe to gather.
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


def group_name(group: dist.ProcessGroup) -> str:
    return group.group_name


def reduce_scatter_is_slow(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == "gloo"


def all_gather_objects(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's picklable ``obj``.

    NOTE: ``dist.all_gather_object`` needs NumPy in torch 2.13 ("Numpy is not available" without
    it); pickled bytes in a uint8 tensor, padded to the longest, need nothing but torch.
    """
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    world = dist.get_world_size(group)
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
        from dynashard import _torch_private as private

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
    from dynashard import _torch_private as private

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


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` in place with the group's first rank's values."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)


def deal_from_first(make: Any, shape: list[int], dtype: torch.dtype, group: dist.ProcessGroup, what: str,
                    whole: bool = False) -> torch.Tensor:
    """Group rank 0 makes each rank's tensor, ``make(r)``, and sends it to rank ``r``; every rank
    returns its own (``shape``: this rank's; ``make`` is called on rank 0 only). With ``whole``,
    one tensor, ``make(None)``, is the same for every rank (a broadcast). Rank 0 holds one rank's
    tensor at a time.

    Before each send every rank joins a one-element broadcast of rank 0's status, so a failure of
    ``make`` (a bad checkpoint) is raised on every rank at the same point, with rank 0's message,
    and no rank waits for a tensor that never comes.
    """
    with peer_guard(group, f"rank 0's deal ({what})"):
        return _deal(make, shape, dtype, group, what, whole)


def _deal(make: Any, shape: list[int], dtype: torch.dtype, group: dist.ProcessGroup, what: str, whole: bool
          ) -> torch.Tensor:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first = dist.get_global_rank(group, 0)
    whole = whole or world == 1
    mine: torch.Tensor | None = None
    for r in [0] if whole else range(world):
        value, error = None, None
        if rank == 0:
            try:
                value = make(None if whole else r).contiguous()
                if value.dtype != dtype or (whole or r == 0) and list(value.shape) != list(shape):
                    raise UsageError(f"dynashard: {what} gave {value.dtype}{list(value.shape)}; expected "
                                     f"{dtype}{list(shape)}")
            except Exception as e:  # noqa: BLE001 - every rank raises it below
                error = e
        first_rank_status(error, group, what)
        if whole:
            mine = value if rank == 0 else torch.empty(shape, dtype=dtype)
            dist.broadcast(mine, src=first, group=group)
        elif r == 0:
            mine = value if rank == 0 else mine
        elif rank == 0:
            dist.send(value, group=group, group_dst=r)
        elif rank == r:
            mine = torch.empty(shape, dtype=dtype)
            dist.recv(mine, group=group, group_src=0)
    assert mine is not None
    return mine


def gather_to_first(local: torch.Tensor, full_shape: list[int], dim: int, pieces: Any, group: dist.ProcessGroup
                    ) -> torch.Tensor | None:
    """The whole tensor on group rank 0 (None elsewhere), from every rank's ``local``: rank ``r``
    holds ``pieces(r)`` (``(start, length)`` along ``dim``) side by side. Rank 0 receives one rank's
    tensor at a time; pieces several ranks hold (whole K/V heads) are simply written again."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank != 0:
        dist.send(local.detach().contiguous(), group=group, group_dst=0)
        return None
    full = torch.empty(full_shape, dtype=local.dtype, device=local.device)
    for r in range(world):
        lengths = [length for _, length in pieces(r)]
        if r == 0:
            held = local.detach()
        else:
            shape = list(full_shape)
            shape[dim] = sum(lengths)
            held = torch.empty(shape, dtype=local.dtype, device=local.device)
            dist.recv(held, group=group, group_src=r)
        at = 0
        for start, length in pieces(r):
            full.narrow(dim, start, length).copy_(held.narrow(dim, at, length))
            at += length
    return full


def gather_pieces(local: torch.Tensor, full_shape: list[int], spec: Any, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor on every rank from every rank's ``local`` (its pieces under ``spec``, side by
    side along ``spec.dim``): one all_gather of the blocks, each padded to the longest rank's."""
    world, dim = spec.world, spec.dim % len(full_shape)
    lengths = [spec.split.local(world, r) for r in range(world)]
    longest = max(lengths)
    moved = local.movedim(dim, 0).contiguous()
    block = torch.zeros((longest, *moved.shape[1:]), dtype=local.dtype, device=local.device)
    block[: moved.shape[0]] = moved
    blocks = [torch.empty_like(block) for _ in range(world)]
    dist.all_gather(blocks, block, group=group)
    full = torch.empty([full_shape[dim], *moved.shape[1:]], dtype=local.dtype, device=local.device)
    for r in range(world):
        at = 0
        for start, length in spec.split.pieces(world, r):
            full[start:start + length] = blocks[r][at:at + length]
            at += length
    return full.movedim(0, dim)


def first_rank_status(error: BaseException | None, group: dist.ProcessGroup, what: str) -> None:
    """Group rank 0's ``error`` (None: it went well) raised on every rank, at the same point."""
    status = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    dist.broadcast(status, src=dist.get_global_rank(group, 0), group=group)
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
