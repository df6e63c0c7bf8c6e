"""``explain(..., verify=True)``: run every rank's sharded program in one process and compare.

Each simulated rank is a thread that interprets its own rewritten graph (the same
:class:`~dynashard.rewrite.interpreter.Sharder` the backend traces, so the same conversions) on real tensors: this
rank's cut of the real weights, and collectives replaced by :class:`SimulatedCollectives`,
which meet at a barrier and combine every rank's tensor exactly as the real collective would.
No process group is used. The unsharded graph runs alongside; each linear's output (colwise
shards concatenated across ranks) and each graph output are compared.

Random ops (dropout, rand, multinomial, ...): real ranks are seeded alike (the user's
``torch.manual_seed``) and each draws from its own generator, so ranks drawing the same shapes
draw the same numbers. Here every rank and the reference draw from a stream of their own, each
starting from the state the generator had when ``verify`` began (:class:`_RandomStreams`), which
is restored afterwards: a rank drawing for its own part of a cut value draws that part's count,
as a real rank would, and verification shows what that gives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import torch
import torch.fx

from dynashard._torch import aten as private_aten
from dynashard.capture.aliases import alias_roots
from dynashard.errors import InternalError
from dynashard.layout.nodes import written_args
from dynashard.options import Style
from dynashard.rewrite.interpreter import Sharder
from dynashard.weights.store import cut

_TIMEOUT_S = 120


class _Exchange:
    """Every rank deposits a tensor and gets back all ranks' tensors, in rank order."""

    def __init__(self, world: int) -> None:
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=_TIMEOUT_S)

    def __call__(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.clone()  # a rank may later write into its own tensor in place
        self.barrier.wait()
        everyone = [t.clone() for t in self.slots]
        self.barrier.wait()
        return everyone


@dataclasses.dataclass
class SimulatedCollectives:
    """The functions of ``dynashard.comm.collectives`` the rewrite calls, for one simulated rank."""

    rank: int
    world: int
    exchange: _Exchange

    def _all(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.exchange(self.rank, x)

    def all_reduce_sum(self, x, group_name):
        return torch.stack(self._all(x)).sum(0)

    def all_gather_last_dim(self, x, lengths, rank, group_name, whole=frozenset()):
        return _join(self._all(x), lengths, whole)

    # With gradients (a training compile): the same forward; their backwards are not simulated.
    def copy_to_shards(self, x, group_name):
        return x

    def reduce_from_shards(self, x, group_name):
        return self.all_reduce_sum(x, group_name)

    def gather_from_shards(self, x, lengths, rank, group_name, whole=frozenset()):
        return self.all_gather_last_dim(x, lengths, rank, group_name, whole)

    def reduce_scatter_last_dim(self, x, lengths, rank, group_name, via_all_to_all):
        return torch.stack(self._all(x)).sum(0).narrow(-1, sum(lengths[:rank]), lengths[rank])

    def reduce_scatter_to_shards(self, x, lengths, rank, group_name, via_all_to_all):
        return self.reduce_scatter_last_dim(x, lengths, rank, group_name, via_all_to_all)

    def gather_to_shards(self, x, lengths, rank, group_name, via_all_to_all):
        return self.all_gather_last_dim(x, [lengths], rank, group_name)

    def all_gather_rows(self, x, group_name):
        return torch.cat(self._all(x), 0)

    def reduce_scatter_rows(self, x, world, group_name, via_all_to_all):
        total = torch.stack(self._all(x)).sum(0)
        return total.reshape(world, total.shape[0] // world, *total.shape[1:])[self.rank]

    def shard_to_own_rows(self, x, lengths, rank, group_name):
        world = len(lengths)
        return torch.cat([a.reshape(world, a.shape[0] // world, *a.shape[1:])[self.rank] for a in self._all(x)], -1)

    def own_rows_to_shard(self, x, lengths, rank, group_name):
        start = sum(lengths[:rank])
        return torch.cat([a.narrow(-1, start, lengths[rank]) for a in self._all(x)], 0)


class _RandomStreams:
    """One random stream per simulated rank (and one for the reference): the process's generators
    (the CPU one, and CUDA's once initialized) swapped to that stream's state around each random op,
    under a lock, since every simulated rank is a thread of this one process."""

    def __init__(self, count: int) -> None:
        self.start = _rng_state()
        self.states = [self.start] * count
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def drawing(self, index: int):
        def draw(op, args, kwargs):
            with self.lock:
                _set_rng_state(self.states[index])
                try:
                    return op(*args, **kwargs)
                finally:
                    self.states[index] = _rng_state()
                    _set_rng_state(self.start)

        with private_aten.random_ops_through(draw):
            yield


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class _LinearOutputs:
    """An observer of an interpreter's values: keeps each linear's output (the interpreter frees dead
    values), as a copy: a later in-place write (``logits[..., 0] = -inf``) lands in the output itself
    on one side and in a gather of it on the other."""

    def __init__(self, linears) -> None:
        self.linears, self.seen = set(linears), {}

    def __call__(self, node: torch.fx.Node, value: Any) -> None:
        if node in self.linears:
            self.seen[node] = value.clone() if torch.is_tensor(value) else value


class _Reference(torch.fx.Interpreter):
    """The unsharded graph, its linears' outputs kept in ``seen``."""

    def __init__(self, gm, linears) -> None:
        super().__init__(gm)
        self.observe = _LinearOutputs(linears)
        self.seen = self.observe.seen

    def run_node(self, node):
        value = super().run_node(node)
        self.observe(node, value)
        return value


def _cut(full: torch.Tensor, dim: int, split, world: int, rank: int, stacked: bool) -> torch.Tensor:
    # Contiguous, as the store holds a shard (weights/store.py) and the program passes one: some CPU kernels
    # read a strided view as if it were contiguous (_weight_norm_interface on v cut on dim 1, torch 2.13)
    block = cut(full.detach(), dim, split, world, rank).contiguous()
    return torch.stack([block] * world) if stacked else block  # replicated model: every rank's block alike


def verify(analyses: list[Any], inputs: list[Any], train: bool = False
           ) -> tuple[dict[str, float], float, dict[str | None, float]]:
    """Max abs error per sharded linear (by FQN) and over the graph outputs, all ranks simulated,
    and the magnitude (max abs) of each reference value they are errors of (None: the outputs).

    ``analyses[r]`` is rank r's analysis of the same graph; ``inputs`` the real example inputs;
    ``train``: the conversions of a training compile (forward only).
    """
    # Under dynamic=True Dynamo's example for a size input is the SymInt itself; the simulated ranks run
    # real tensors, on the example's value of it.
    inputs = [private_aten.size_hint(a) if isinstance(a, torch.SymInt) else a for a in inputs]
    world = len(analyses)
    first = analyses[0]
    linear_nodes = [m.node for m in first.plan.linears]
    reference = _Reference(first.aten, linear_nodes)
    written = _written_inputs(first.aten.graph)
    streams = _RandomStreams(world + 1)  # the reference's is the last
    with torch.no_grad(), streams.drawing(world):
        expected = reference.run(*_own_copies(inputs, written))
    exchange = _Exchange(world)
    results: list[Any] = [None] * world

    def run_rank(rank: int) -> None:
        a = analyses[rank]
        args = _own_copies(inputs, written)
        for i, (_, dim, split) in a.sharded_inputs().items():
            args[i] = _cut(inputs[i], dim, split, world, rank, a.stacked)
        comm = SimulatedCollectives(rank, world, exchange)
        outputs = _LinearOutputs([m.node for m in a.plan.linears])
        sharder = Sharder(a.aten, a.plan, "simulated", comm=comm, train=train, observe=outputs)
        try:
            with torch.no_grad(), streams.drawing(rank):
                results[rank] = (sharder.run(*args), outputs.seen)
        except BaseException as e:  # noqa: BLE001 - reported below; the others must not wait
            exchange.barrier.abort()
            results[rank] = e

    threads = [threading.Thread(target=run_rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_TIMEOUT_S)
    failed = [(rank, r) for rank, r in enumerate(results) if not isinstance(r, tuple)]
    if failed:  # the first real failure, not a rank whose barrier was aborted because of it
        rank, r = next(((k, e) for k, e in failed if not isinstance(e, threading.BrokenBarrierError)), failed[0])
        raise InternalError(f"dynashard.explain(verify=True): simulated rank {rank} failed: {r!r}") from (
            r if isinstance(r, BaseException) else None
        )
    per_layer, scales = _layer_errors(analyses, results, reference.seen)
    scales[None] = max([float(w.abs().max()) for w in expected if torch.is_tensor(w) and w.numel()
                        and (w.is_floating_point() or w.is_complex())], default=0.0)
    out_err = 0.0
    for rank, (outs, _) in enumerate(results):
        held = analyses[rank].held_outputs()  # a cache the graph allocated: returned as this rank's shard
        for i, (got, want) in enumerate(zip(outs, expected)):
            if torch.is_tensor(want):
                if i in held:
                    want = _cut(want, held[i][0], held[i][1], world, rank, False)
                out_err = max(out_err, _err(got, want))
    return per_layer, out_err, scales


def _written_inputs(graph: torch.fx.Graph) -> set[int]:
    """The inputs the graph writes into, in place or as an ``out=`` (spectral_norm's power steps write
    its buffers): each simulated run starts from the same values in a copy of its own."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    roots = alias_roots(graph)
    found = set()
    for node in graph.nodes:
        for target in written_args(node):
            while (written := written_args(target)) or target in roots:  # (an out= result is its out)
                target = written[0] if written else roots[target]
            if target in placeholders:
                found.add(placeholders.index(target))
    return found


def _own_copies(inputs: list[Any], written: set[int]) -> list[Any]:
    return [a.clone() if i in written else a for i, a in enumerate(inputs)]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float((got.float() - want.float()).abs().max()) if want.numel() else 0.0


def _assemble(values: list[torch.Tensor], split) -> torch.Tensor:
    """Every rank's colwise output back in feature order (component by component, rank by rank)."""
    return _join(values, split.lengths(len(values)), split.whole)


def _join(values: list[torch.Tensor], lengths: list[list[int]], whole) -> torch.Tensor:
    """Component by component, rank by rank; a whole component once (rank 0's)."""
    pieces = []
    for c, ls in enumerate(lengths):
        for r, v in enumerate(values[:1] if c in whole else values):
            pieces.append(v.narrow(-1, sum(other[r] for other in lengths[:c]), ls[r]))
    return torch.cat(pieces, -1)


def _rows_joined(values: list[torch.Tensor], seq, full: int) -> torch.Tensor:
    """Every rank's part of a sequence-cut value, in rank order (a batch merged in front of the cut
    dim taken apart, joined, merged back)."""
    outer = full // seq.size
    moved = [v.movedim(seq.dim, -1).unflatten(-1, (outer, v.shape[seq.dim] // outer)) for v in values]
    return torch.cat(moved, -1).flatten(-2).movedim(-1, seq.dim)


def _layer_errors(analyses, results, reference: dict) -> tuple[dict[str, float], dict[str | None, float]]:
    errors: dict[str, float] = {}
    scales: dict[str | None, float] = {}
    first = analyses[0]
    for i, m in enumerate(first.plan.linears):
        style = first.plan.layouts.styles[m.node]
        if style == Style.REPLICATE or first.plan.layouts.per_rank:
            continue  # replicated layers are the unsharded ones; per-rank rows are checked at the outputs
        values = [seen[analyses[r].plan.linears[i].node] for r, (_, seen) in enumerate(results)]
        if style == Style.COLWISE:  # features moved last, joined rank by rank, moved back
            d = m.output_dim
            got = _assemble([v.movedim(d, -1) for v in values], first.plan.layouts.weight_split(m.node)).movedim(-1, d)
        elif m.node in first.plan.layouts.partial:  # each rank's term of the output
            got, values = torch.stack(values).sum(0), []
        elif (seq := first.plan.layouts.layouts.get(m.node)) is not None:  # sequence_parallel: parts of it
            got, values = _rows_joined(values, seq, reference[m.node].shape[seq.dim]), []
        else:
            got = values[0]
        err = max([_err(got, reference[m.node])] + [_err(v, values[0]) for v in values[1:] if style == Style.ROWWISE])
        errors[m.fqn] = max(errors.get(m.fqn, 0.0), err)
        scales[m.fqn] = max(scales.get(m.fqn, 0.0), float(reference[m.node].float().abs().max()))
    return errors, scales
