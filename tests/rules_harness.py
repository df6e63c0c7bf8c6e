"""One propagation rule on one op, without a process group: DTensor's ``dimmap_test`` for dynashard.

Before (a rule tested end to end: a model compiled, a golden diffed several layers away)::

    rewritten(model, x)  ->  a golden of the whole rewritten graph
After (one rule, one op, its operands' layouts given)::

    rule_of(aten.sum.dim_IntList, t(4, 8, cut=-1), [-1])  ->  Got(partial=True, ...)

:func:`rule_of` traces ``op(*args)`` with ``make_fx`` on fake tensors (no data, no process group, no
spawn), seeds a :class:`~dynashard.layout.shard.LayoutMap` with the layout of each operand (:func:`t`:
replicated, cut on a dim, or partial sums), and asks the op's rule for its record, as
``propagate.propagate`` does for one node: partial operands first to ``rules.partial.keeps_partial``,
then the registered rule (declined: ``Got.declined``, the driver would gather). :func:`linear_of` does
the same for a matched linear (``rules.origins.linear``). :func:`check_numerics` runs what the record
says on real tensors for every rank and compares with the op on whole tensors (records without a
lowering: those are emitted by the rewrite, checked by the goldens and ``explain(verify=True)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from dynashard.capture.aliases import mutated_roots
from dynashard.capture.match import find_linears
from dynashard.capture.records import ParamInfo
from dynashard.layout.mesh import Mesh
from dynashard.layout.nodes import all_args, is_size
from dynashard.layout.shard import LayoutMap, Read, Record, Shard
from dynashard.layout.split import Split
from dynashard.options import Style
from dynashard.plan import rules
from dynashard.plan.rules.origins import linear
from dynashard.plan.rules.partial import keeps_partial, whole_linear_of_partial
from dynashard.rewrite.local_conversions import take, take_groups


@dataclasses.dataclass(frozen=True)
class T:
    """An operand: a tensor of ``shape``, replicated, cut on ``cut`` (a dim, either end) into ``parts``
    components of ``unit`` elements (one component of the whole dim by default), or partial sums."""

    shape: tuple[int, ...]
    cut: int | None = None
    parts: tuple[int, ...] | None = None
    unit: int = 1
    whole: frozenset[int] = frozenset()
    partial: bool = False
    dtype: torch.dtype = torch.float32
    uniform: bool = False  # the same on every rank (a parameter), for inputs="per_rank"

    def split(self) -> Split:
        parts = self.parts or (self.shape[self.cut] // self.unit,)
        return Split(tuple(parts), self.unit, frozenset(self.whole))

    def dim(self) -> int:  # from the end, as Shard.dim
        return self.cut - len(self.shape) if self.cut >= 0 else self.cut


def t(*shape: int, cut: int | None = None, parts: tuple[int, ...] | None = None, unit: int = 1,
      whole: tuple[int, ...] = (), partial: bool = False, dtype: torch.dtype = torch.float32,
      uniform: bool = False) -> T:
    return T(tuple(shape), cut, parts, unit, frozenset(whole), partial, dtype, uniform)


@dataclasses.dataclass(frozen=True)
class K:
    """An integer constant built in the graph (``torch.tensor(values)``: an index the rules can read)."""

    values: tuple


def k(*values: Any) -> K:
    return K(tuple(values))


@dataclasses.dataclass(frozen=True)
class Cut:
    """A layout as a test states it: the dim (from the end) and the split; origins, world and rank are
    the harness's business."""

    dim: int
    split: Split

    def __repr__(self) -> str:
        s = self.split
        extra = (f" unit={s.unit}" if s.unit != 1 else "") + (f" whole={sorted(s.whole)}" if s.whole else "")
        extra += f" deals={s.deals}" if s.deals is not None else ""
        return f"S({self.dim}, {s.parts}{extra})"


def S(dim: int, *parts: int, unit: int = 1, whole: tuple[int, ...] = (),
      deals: tuple[tuple[int, ...], ...] | None = None) -> Cut:
    """Expected: a Shard on ``dim`` (from the end) of ``parts`` components of ``unit`` elements."""
    return Cut(dim, Split(tuple(parts), unit, frozenset(whole), deals))


def _cut_of(shard: Shard | None) -> Cut | None:
    return None if shard is None else Cut(shard.dim, shard.split)


@dataclasses.dataclass
class Got:
    """What the rule decided for the op's node, in the terms a test states."""

    declined: bool  # the rule returned None: the driver gathers every sharded operand
    layout: Cut | None
    outputs: tuple[Cut | None, ...] | None
    reads: tuple[str, ...]  # how it reads each T operand, in order ("-": not read, declined)
    partial: bool  # the output is partial sums
    reduced: bool  # a partial operand is read all-reduced
    lowering: str | None  # the Lowering's class name
    wishes: tuple[str, ...]  # WishKind values of the wishes left by this rule
    collectives: tuple[str, ...] = ()  # the record's own (a rowwise reduce, a loss's gather)
    record: Record | None = dataclasses.field(repr=False, default=None)
    node: torch.fx.Node | None = dataclasses.field(repr=False, default=None)
    lm: LayoutMap | None = dataclasses.field(repr=False, default=None)
    operands: list[torch.fx.Node] = dataclasses.field(repr=False, default_factory=list)
    specs: list[T] = dataclasses.field(repr=False, default_factory=list)
    gm: torch.fx.GraphModule | None = dataclasses.field(repr=False, default=None)


_LETTERS = {"local": "L", "narrow": "N", "gather": "G", "narrow_groups": "Q", "global": "A", "global_narrow": "B",
            "-": "-"}


@dataclasses.dataclass(frozen=True)
class Expect:
    """What a test states a rule decides. ``reads``: one letter per T operand, in order (L local,
    N narrowed, G gathered, Q narrowed to K/V groups, A global, B global narrowed, - not read);
    None: every operand used as it is (a kept record). ``collectives``: checked when given."""

    declined: bool = False
    layout: Cut | None = None
    outputs: tuple[Cut | None, ...] | None = None
    reads: str | None = None
    partial: bool = False
    reduced: bool = False
    lowering: str | None = None
    wishes: tuple[str, ...] = ()
    collectives: tuple[str, ...] | None = None

    def check(self, got: Got) -> None:
        reads = "".join(_LETTERS[r] for r in got.reads)
        want_reads = self.reads if self.reads is not None else ("-" if self.declined else "L") * len(got.reads)
        seen = dict(declined=got.declined, layout=got.layout, outputs=got.outputs, reads=reads, partial=got.partial,
                    reduced=got.reduced, lowering=got.lowering, wishes=got.wishes)
        want = dict(declined=self.declined, layout=self.layout, outputs=self.outputs, reads=want_reads,
                    partial=self.partial, reduced=self.reduced, lowering=self.lowering, wishes=self.wishes)
        if self.collectives is not None:
            seen["collectives"], want["collectives"] = got.collectives, self.collectives
        wrong = {k: f"{seen[k]!r} (expected {want[k]!r})" for k in want if seen[k] != want[k]}
        assert not wrong, f"the rule decided {wrong}"


def keep(layout: Cut, **fields: Any) -> Expect:
    """The output cut ``layout``."""
    return Expect(layout=layout, **fields)


def outs(*outputs: Cut | None, **fields: Any) -> Expect:
    """A tuple-valued op: each output's layout (None: replicated)."""
    return Expect(outputs=outputs, **fields)


def whole(**fields: Any) -> Expect:
    """Kept by the rule, the output replicated (every rank holds all of it)."""
    return Expect(**fields)


def summed(**fields: Any) -> Expect:
    """The output is partial sums: each rank holds a term of it."""
    return Expect(partial=True, **fields)


def gather(*wishes: str, reduced: bool = False) -> Expect:
    """The rule declines: the driver gathers every cut operand (and all-reduces partial ones)."""
    return Expect(declined=True, wishes=wishes, reduced=reduced)


def _specs(args: Any) -> list[T]:
    if isinstance(args, T):
        return [args]
    if isinstance(args, (list, tuple)):
        return [s for a in args for s in _specs(a)]
    if isinstance(args, dict):
        return [s for a in args.values() for s in _specs(a)]
    return []


def _substitute(args: Any, tensors: list[torch.Tensor]) -> Any:
    """``args`` with each T replaced by the next of ``tensors`` (in :func:`_specs` order), each K by
    its tensor."""
    if isinstance(args, T):
        return tensors.pop(0)
    if isinstance(args, K):
        return torch.tensor(list(args.values))
    if isinstance(args, (list, tuple)):
        return type(args)(_substitute(a, tensors) for a in args)
    if isinstance(args, dict):
        return {k: _substitute(a, tensors) for k, a in args.items()}
    return args


def _example(spec: T) -> torch.Tensor:
    return torch.zeros(spec.shape, dtype=spec.dtype)


def trace(op: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[torch.fx.GraphModule, list[T]]:
    """``op(*args, **kwargs)`` as an aten graph on fake tensors, one placeholder per T."""
    specs = _specs((args, kwargs))

    def fn(*tensors: torch.Tensor) -> Any:
        a, k = _substitute((args, kwargs), list(tensors))
        return op(*a, **k)

    return make_fx(fn, tracing_mode="fake")(*[_example(s) for s in specs]), specs


def seeded(gm: torch.fx.GraphModule, specs: list[T], world: int, rank: int, **modes: bool) -> LayoutMap:
    """A layout map with every placeholder's layout as its spec says (origins: the placeholder)."""
    lm = LayoutMap(Mesh(world, rank, **modes), styles={}, written=frozenset(mutated_roots(gm.graph)))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, specs, strict=True):
        if spec.cut is not None:
            lm.commit(node, Record(lm.shard(spec.split(), frozenset([node]), spec.dim())))
        elif spec.partial:
            lm.commit(node, Record(partial=frozenset([node])))
        else:
            lm.commit(node, Record())
        if spec.uniform:
            lm.uniform.add(node)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            lm.commit(node, Record())
            lm.uniform.add(node)
    return lm


def _decide(lm: LayoutMap, node: torch.fx.Node) -> tuple[Record | None, frozenset]:
    """``node``'s record as the driver (``propagate``) would take it: None where the rule declines."""
    partial = frozenset(a for a in all_args(node) if a in lm.partial)
    if partial and (kept := keeps_partial(lm, node)) is not None:
        return kept, frozenset()
    found = rules.lookup(node, lm.per_rank)
    return (found(lm, node) if found is not None else None), partial


def rule_of(op: Any, *args: Any, world: int = 2, rank: int = 0, target: Any = None, per_rank: bool = False,
            sequence: bool = False, stacked: bool = False, traced_as: Any = None, **kwargs: Any) -> Got:
    """The record the rule of ``target`` (default ``op``) gives its first node in ``op(*args)``;
    nodes before it (constants, a block mask) get their own rules' records, or a gather.
    ``traced_as``: the op that tracing turns ``op`` into (``aten.reshape`` becomes ``aten.view``), its
    node given back ``op`` as target (graphs traced before dispatch keep it)."""
    target = op if target is None else target
    gm, specs = trace(op, args, kwargs)
    for node in gm.graph.nodes:
        if traced_as is not None and node.target is traced_as:
            node.target = op
    lm = seeded(gm, specs, world, rank, per_rank=per_rank, sequence=sequence, stacked=stacked)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in lm.records:
            continue
        wished = len(lm.wishes)
        record, reduced = _decide(lm, node)
        if node.target is target:
            return _got(gm, specs, lm, node, record, reduced, lm.wishes[wished:])
        record = record if record is not None else lm.gathered(node)
        record.reduced = reduced
        lm.commit(node, record)
    raise AssertionError(f"expected a {target} node in the trace of {op}; found {gm.graph}")


def _got(gm: torch.fx.GraphModule, specs: list[T], lm: LayoutMap, node: torch.fx.Node, record: Record | None,
         reduced: frozenset, wishes: list) -> Got:
    operands = [n for n in gm.graph.nodes if n.op == "placeholder"]
    wished = tuple(str(w.kind.value) for w in wishes)
    if record is None:
        return Got(True, None, None, ("-",) * len(operands), False, bool(reduced), None, wished, (), None, node,
                   lm, operands, specs, gm)
    reads = tuple(record.reads[o].value if o in record.reads else "-" for o in operands)
    outputs = None if record.outputs is None else tuple(_cut_of(s) for s in record.outputs)
    lowering = None if record.lowering is None else type(record.lowering).__name__
    collectives = tuple(c.kind.value for c in record.collectives)
    return Got(False, _cut_of(record.layout), outputs, reads, record.partial is not None, bool(reduced), lowering,
               wished, collectives, record, node, lm, operands, specs, gm)


def linear_of(x: T, out_features: int, style: Style, bias: bool = False, embedding: bool = False,
              world: int = 2, rank: int = 0, per_rank: bool = False, sequence: bool = False, group: int = 0) -> Got:
    """The record of ``F.linear(x, W[, b])`` (or ``F.embedding(x, W)``: ``x`` ids) cut ``style``, as the
    driver takes it for a matched linear (a whole one may keep a partial input partial). ``group``: W is
    torchao's group-wise int8 ``qdata [out, in]`` dequantized by groups of ``group`` input columns with a
    scale and a zero point ``[out, in / group]`` (operands x, qdata, scale, zero point), as flattened."""
    in_features = x.shape[-1]
    w = t(out_features, in_features, dtype=torch.int8 if group else torch.float32) if not embedding \
        else t(in_features, out_features)
    b = t(out_features) if bias else None
    scales = [t(out_features, in_features // group), t(out_features, in_features // group, dtype=torch.int8)] \
        if group else []

    def dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        shape = (out_features, in_features // group)
        q3, z3 = q.view(*shape, group).to(torch.float32), zero.view(*shape, 1).to(torch.float32)
        return ((q3 - z3) * scale.view(*shape, 1)).view(out_features, in_features)

    def fn(x: torch.Tensor, w: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if group:
            return torch.nn.functional.linear(x, dequantized(w, *rest))
        return torch.nn.functional.embedding(x, w) if embedding else torch.nn.functional.linear(x, w, *rest)

    specs = [x, w] + ([b] if bias else []) + scales
    gm = make_fx(fn, tracing_mode="fake")(*[_example(s) for s in specs])
    lm = seeded(gm, specs, world, rank, per_rank=per_rank, sequence=sequence)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {placeholders[1]: ParamInfo("lin.weight.qdata", "lin", True, "qdata") if group
              else ParamInfo("lin.weight", "lin", True)}
    if bias:
        params[placeholders[2]] = ParamInfo("lin.bias", "lin", True)
    for node, inner in zip(placeholders[2:], ("scale", "zero_point") if group else (), strict=False):
        params[node] = ParamInfo(f"lin.weight.{inner}", "lin", True, inner)
    (match,), _ = find_linears(gm.graph, params)
    for node in gm.graph.nodes:  # the weight's transpose, an input view: their own rules' records
        if node.op == "call_function" and node is not match.node and node not in lm.records:
            record, reduced = _decide(lm, node)
            record = record if record is not None else lm.gathered(node)
            record.reduced = reduced
            lm.commit(node, record)
        if node is match.node:
            break
    lm.styles[match.node] = style
    wished = len(lm.wishes)
    partial = frozenset(a for a in all_args(match.node) if a in lm.partial)
    record = whole_linear_of_partial(lm, match) if style == Style.REPLICATE else None
    if record is None:
        record = linear(lm, match, style)
        record.reduced = partial
    return _got(gm, specs, lm, match.node, record, frozenset(record.reduced), lm.wishes[wished:])


# Numerics: what the record says, run on real tensors for every rank.

_CUDA_ONLY = (torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default,
              torch.ops.aten._scaled_dot_product_cudnn_attention.default)
_CONVERSIONS = ("local", "narrow", "gather", "narrow_groups", "-")


def supports_numerics(got: Got) -> str | None:
    """Why :func:`check_numerics` cannot run this record (None: it can)."""
    if got.declined:
        return "declined: the driver gathers (nothing of the rule's to run)"
    if got.lowering is not None:
        return f"emitted by its lowering {got.lowering} (the rewrite's, checked by goldens and verify)"
    if got.node.target in _CUDA_ONLY:
        return "a CUDA kernel (no CPU one to run here)"
    if got.lm.per_rank or got.lm.sequence or got.lm.stacked:
        return "a mode whose values mean other rows or blocks (checked by verify)"
    if any(r not in _CONVERSIONS for r in got.reads):
        return f"reads {got.reads}: conversions the rewrite owns"
    if any(a.op == "call_function" and _held_cut(got.lm, a) for a in all_args(got.node)):
        return "an operand computed in the graph is cut"
    return None


def _held_cut(lm: LayoutMap, node: torch.fx.Node) -> bool:
    record = lm.records[node]
    return record.layout is not None or record.partial is not None or any(record.outputs or ())


def _full_values(gm: torch.fx.GraphModule, node: torch.fx.Node, fulls: list[torch.Tensor]) -> dict:
    """Every node before ``node`` on whole tensors (constants, a mask built in the graph)."""
    env: dict[torch.fx.Node, Any] = {}
    inputs = iter(fulls)
    for n in gm.graph.nodes:
        if n is node:
            return env
        if n.op == "placeholder":
            env[n] = next(inputs)
        elif n.op == "get_attr":
            env[n] = getattr(gm, n.target)
        else:
            a, kw = torch.fx.node.map_arg((n.args, n.kwargs), lambda m: env[m])
            env[n] = n.target(*a, **kw)
    raise AssertionError(f"{node} not in the graph")


def _local(got: Got, node: torch.fx.Node, full: torch.Tensor, term: list | None, rank: int) -> torch.Tensor:
    """``node``'s value as this rank reads it for the op (a copy: in-place ops write into it)."""
    how = got.record.reads.get(node, Read.LOCAL)
    out = got.record.layout or next((s for s in got.record.outputs or () if s is not None), None)
    held = got.lm.layouts.get(node)
    if term is not None:
        value = full if got.reduced else term[rank]
    elif held is not None:
        value = full if how == Read.GATHER else take(full, held)
    elif how == Read.NARROW:
        value = take(full, out)
    elif how == Read.NARROW_GROUPS:
        value = take_groups(full, out)
    else:
        value = full
    return value.clone()


def check_numerics(op: Any, *args: Any, world: int = 2, target: Any = None, tol: float = 1e-5,
                   traced_as: Any = None, **kwargs: Any) -> None:
    """For every rank: the op on its operands as the rule reads them (a shard as held, a replicated
    value narrowed or whole, a gathered shard whole, partial sums as this rank's term or all-reduced)
    equals this rank's part of the op on whole tensors (for partial sums: every rank's terms add up
    to it). ``tol``: float32 sums of at most a few dozen O(1) products, in another order."""
    torch.manual_seed(0)
    specs = _specs((args, kwargs))
    terms = [[torch.randn(s.shape, dtype=s.dtype) for _ in range(world)] if s.partial else None for s in specs]
    fulls = [sum(tm) if tm is not None else _random(s) for s, tm in zip(specs, terms)]
    outs, gots = [], []
    for rank in range(world):
        got = rule_of(op, *args, world=world, rank=rank, target=target, traced_as=traced_as, **kwargs)
        why = supports_numerics(got)
        assert why is None, why
        env = _full_values(got.gm, got.node, fulls)
        local = {**env, **{n: _local(got, n, f, tm, rank) for n, f, tm in zip(got.operands, fulls, terms)}}
        outs.append(_run(got, local, resize=True))
        gots.append(got)
    want = _run(got, {**env, **{n: f.clone() for n, f in zip(got.operands, fulls)}}, resize=False)
    if got.partial:
        _close(sum(outs), want, tol, "every rank's terms added up")
        return
    for rank, (got, out) in enumerate(zip(gots, outs)):
        many = got.record.outputs is not None
        for lay, o, w in zip(got.record.outputs if many else (got.record.layout,), out if many else (out,),
                             want if many else (want,)):
            if isinstance(w, torch.Tensor):
                _close(o, w if lay is None else take(w, lay), tol, f"rank {rank}")


def _run(got: Got, env: dict, resize: bool) -> Any:
    """The op of ``got.node`` on ``env``'s values (a view as a reshape, as the rewrite emits it)."""
    args, kwargs = torch.fx.node.map_arg((got.node.args, got.node.kwargs), lambda n: env[n])
    fn = torch.ops.aten.reshape if got.node.target in _VIEWS else got.node.target
    return fn(*(_resized(got, args) if resize else args), **kwargs)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if want.dtype.is_floating_point or want.dtype.is_complex:
        assert torch.allclose(got, want, atol=tol, rtol=tol), f"{what}: {got}\nexpected {want}"
    else:
        assert torch.equal(got, want), f"{what}: {got}\nexpected {want}"


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _random(spec: T) -> torch.Tensor:
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        return torch.randn(spec.shape, dtype=spec.dtype)
    return torch.randint(0, 2, spec.shape).to(spec.dtype)  # (a mask, or an index into any dim)


def _resized(got: Got, args: tuple) -> tuple:
    """A size argument at this rank's size (as ``rewrite.interpreter.Sharder.args``)."""
    resize = got.record.resize
    if resize is None:
        return args
    shape = list(args[1])
    if not is_size(shape[resize.dim], -1):
        shape[resize.dim] = (resize.local if is_size(shape[resize.dim], resize.full)
                             else shape[resize.dim] // resize.full * resize.local)
    return (args[0], shape, *args[2:])


def registered_ops() -> dict[object, str]:
    """Every op with a rule of its own, and the rule's name (module.function)."""
    from dynashard.plan.rules.registry import RULES

    return {op: f"{reg.fn.__module__.rsplit('.', 1)[-1]}.{reg.fn.__name__}" for op, reg in RULES.items()}
