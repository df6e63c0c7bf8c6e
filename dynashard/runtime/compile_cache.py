"""The compile cache: a later process compiling the same graph reads this rank's plan and rewritten graph
from disk instead of tracing and planning again.

What the backend makes of a captured graph before the compiler sees it -- the aten trace, the plan, the rewrite
(two ``make_fx`` traces, most of the backend's time) -- is a function of the Dynamo graph, its inputs, the
options, the group, the grad and autocast state, the attention kernels allowed (SDPA's kernel is picked by the
aten trace), the earlier cuts, dynashard's code and torch's release. An entry is stored under a digest of all of
them and holds, beside the rewritten graph, the whole text the digest was made from: a lookup compares that text,
so an entry from another graph, option, rank, world, dynashard or torch is never used, even on a digest collision.
Inductor's FX graph cache then serves the compile of the rewritten graph (its own key, its own guards).

Every rank looks up its own entry (a rank's rewrite is its own: uneven cuts differ); the plan fingerprint
each entry carries goes through the same agreement as a traced plan's (``WeightStore.agree``), so ranks
never run different plans, whether each hit, missed or traced.

Training graphs are cached too: their conversions are bound to ``collectives.apply_conversion`` (an
importable function over plain values), and the regather tags pickling drops are made again on a load
(``collectives.tag_regathers``). Not cached (a miss, with the reason at DEBUG): ``per_rank`` inputs or
weights, FSDP2 or DTensor inputs, tensor constants, a rewrite that added shape guards (they would be lost on
a hit), a graph carrying the model's own activation-checkpoint tags (node meta: lost on a hit), a graph
whose computations with no traced input draw random numbers, are written or are not aten ops (a pickle read
back makes each one constant: :func:`_frozen_by_pickle`; one the graph returns is copied at each call), and a
graph that does not pickle. The nested compile
region tags (node meta too) are kept beside the graph and put back on a load, so a hit outlines the regions as
a miss does (``rewrite/outline.py``): carried to the graph read back node by node, past the input-free
computations the pickle folds into constants (:func:`_twins`).

Where: ``$DYNASHARD_CACHE_DIR``, else ``dynashard/`` in Inductor's cache directory
(``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``). ``DYNASHARD_CACHE=0`` turns it
off, as does ``torch._inductor.config.force_disable_caches``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

import dynashard
from dynashard import _torch as private
from dynashard._torch import aten as private_aten
from dynashard._torch import regions as private_regions
from dynashard.capture.subclass_inputs import INNER
from dynashard.comm.collectives import group_name, tag_regathers
from dynashard.layout.split import Split
from dynashard.options import Options
from dynashard.training import fsdp
from dynashard.weights.store import EarlierCuts

log = logging.getLogger(__name__)

FORMAT = 4  # bumped when an entry's layout changes


@dataclasses.dataclass(frozen=True)
class Trainability:
    """What ``dynamo_backend.check_trainable`` reads of the analysis, kept so that a hit checks a training
    graph as a traced one is checked (the rest it reads: the inputs and the compiler, in the key)."""

    sparse: tuple[str, ...]  # sharded embeddings with sparse=True
    per_rank: bool  # inputs="per_rank" over unstacked weights: every trained parameter must be averaged
    why: str | None  # the plan's layouts whose backward is not built, or None
    random: str | None  # a random op on a sharded value ("<op> (<node>)"), or None


@dataclasses.dataclass
class Planned:
    """What the backend decided for one graph on this rank, traced or read from the cache: all the
    compile needs after the plan (the rewritten graph aside)."""

    params: dict[int, str]  # input slot -> parameter FQN, every parameter the graph reads
    sharded: dict[int, tuple[str, int, Split]]  # input slot -> (name, dim, how), every input the plan cuts
    held: dict[int, tuple[int, Split]]  # output -> (dim, how), caches the graph returns as this rank's shard
    fingerprint: str  # the plan's, agreed across ranks
    stacked: bool  # weights="per_rank"
    summary: str  # the plan in a line, for the compile's log line
    trainable: Trainability | None = None  # a training graph's (None without gradients)
    table: tuple[str, str] | None = None  # (digest, text) of the plan table, logged on a hit as on a miss


@dataclasses.dataclass
class Entry:
    material: str  # what the key was made from, compared on every lookup
    planned: Planned
    graph: bytes  # the rewritten graph, pickled (GraphModule's own reduction: its code and attributes)
    regions: tuple[tuple[int, str, int], ...] = ()  # its nested compile region tags (node meta: lost in a pickle)


def enabled() -> bool:
    return os.environ.get("DYNASHARD_CACHE", "1").strip().lower() not in ("0", "off", "false", "no") and \
        not private.caches_disabled()


def directory() -> Path:
    explicit = os.environ.get("DYNASHARD_CACHE_DIR", "").strip()
    return Path(explicit) if explicit else Path(private.inductor_cache_dir()) / "dynashard"


def key_material(gm: torch.fx.GraphModule, example_inputs: list[Any], fake_args: list[Any], opts: Options,
                 group: dist.ProcessGroup, world: int, rank: int, earlier: EarlierCuts, train: bool,
                 ) -> tuple[str | None, str]:
    """(The text the entry's key is made from, or None; why not, when None). Not cached: per_rank inputs or
    weights, FSDP2 or DTensor inputs, tensor constants (their values are not in the key). ``train`` is in the
    key through the grad state and the inputs' ``requires_grad``; the attention kernels allowed and the GPUs, through
    ``_torch.attention_state`` (the aten trace picks SDPA's kernel from them)."""
    if opts.weights == "per_rank" or opts.inputs == "per_rank":
        return None, "per_rank inputs or weights"
    if fsdp.live_slots(example_inputs):
        return None, "FSDP2 or DTensor inputs"
    parts: list[Any] = [FORMAT, code_digest(), torch.__version__, torch.version.git_version, sys.version_info[:2],
                        repr(dataclasses.replace(opts, group=None)), group_name(group), dist.get_backend(group),
                        world, rank, torch.is_grad_enabled(), _autocast_state(),
                        private.attention_state(example_inputs), (sorted(earlier.split.items()), sorted(earlier.whole))]
    for m in gm.modules():
        if not isinstance(m, torch.fx.GraphModule):
            continue
        for node in m.graph.find_nodes(op="get_attr"):
            if isinstance(getattr(m, str(node.target), None), torch.Tensor):
                return None, "tensor constants in the graph"
        parts.append(m.code)
    slots = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value, fake in zip(slots, example_inputs, fake_args, strict=True):
        if private.from_fsdp_module(node):
            return None, "FSDP2 inputs"
        parts.append((private.placeholder_source_name(node), node.meta.get(INNER, ""), _describe(fake),
                      _describe(value)))
    return repr(parts), ""


def _describe(v: Any) -> Any:
    """A value's shape, strides, dtype, device and kind; symbolic sizes as their expression and example."""
    def size(d: Any) -> Any:
        return (str(d), private_aten.size_hint(d)) if isinstance(d, torch.SymInt) else d

    if isinstance(v, torch.Tensor):
        return (type(v).__name__, [size(d) for d in v.shape], [size(d) for d in v.stride()], str(v.dtype),
                str(v.device), v.requires_grad, v.is_meta, isinstance(v, torch.nn.Parameter))
    if isinstance(v, torch.SymInt):
        return ("SymInt", size(v))
    return (type(v).__name__, repr(v))


def _autocast_state() -> tuple:
    return tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda"))


def code_digest() -> str:
    """A digest of dynashard's own source: an entry written by other code is never read (this cache's, and
    AOTAutograd's for a graph that calls dynashard's conversions: ``dynamo_backend._compile``)."""
    if not _DIGEST:
        root = Path(dynashard.__file__).parent
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _DIGEST.append(h.hexdigest())
    return _DIGEST[0]


_DIGEST: list[str] = []


def _path(material: str) -> Path:
    digest = hashlib.sha256(material.encode()).hexdigest()
    return directory() / digest[:2] / f"{digest}.pkl"


def load(material: str) -> tuple[Planned, torch.fx.GraphModule] | None:
    """The entry for ``material``, or None: absent, unreadable, or made from other text."""
    path = _path(material)
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
        if not isinstance(entry, Entry) or entry.material != material:
            log.debug("dynashard: compile cache entry %s was made for another graph: not used", path)
            return None
        graph = pickle.loads(entry.graph)
        if graph is not None:
            tag_regathers(graph)
            private_regions.retag(graph, entry.regions)
            _fresh_outputs(graph)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a damaged or foreign entry is a miss, never an error
        log.debug("dynashard: compile cache entry %s could not be read (%s: %s): not used", path, type(e).__name__, e)
        return None
    return entry.planned, graph


def store(material: str, planned: Planned, graph: torch.fx.GraphModule | None,
          ) -> tuple[torch.fx.GraphModule | None, str | None]:
    """Write the entry (atomically): (the graph as a hit will read it back, None) or (None, why not).

    The caller compiles the graph read back, not ``graph``: the compiler's own cache (Inductor's FX graph
    cache keys the graph's code, stack-trace comments included) then sees the same graph on a miss as on
    every later hit."""
    try:
        copy = torch.fx.GraphModule(graph, graph.graph) if graph is not None else None  # (code and attributes)
        if graph is not None:  # (the copy took the shared Graph's ownership: the caller may still use ``graph``)
            graph.graph.owning_module = graph
        pickled = pickle.dumps(copy)
        back = pickle.loads(pickled)  # (a graph that pickles but does not load back: not stored)
    except Exception as e:  # noqa: BLE001
        return None, f"the rewritten graph does not pickle ({type(e).__name__}: {e})"
    if back is not None and _tags(tag_regathers(back)) != _tags(graph):
        return None, "the model's activation-checkpoint tags (node meta, which a pickled graph loses)"
    if graph is not None and (frozen := _frozen_by_pickle(graph)) is not None:
        return None, frozen
    regions: tuple[tuple[int, str, int], ...] = ()
    if back is not None and private_regions.region_tags(graph):  # (each node's tag put on its twin, by position)
        twins = _twins(graph, back)
        position = {n: i for i, n in enumerate(back.graph.nodes)}
        regions = tuple((position[new], *tag) for old, new in twins or ()
                        if (tag := private_regions.region_of(old)) is not None)
        if twins is None or not private_regions.retag(back, regions):
            return None, "its nested compile region tags (node meta: the graph read back has other nodes)"
        _carry_vals(twins)
    try:
        data = pickle.dumps(Entry(material, planned, pickled, regions))
    except Exception as e:  # noqa: BLE001
        return None, f"the entry does not pickle ({type(e).__name__}: {e})"
    path = _path(material)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(data)
        os.replace(f.name, path)
    except OSError as e:
        return None, f"the cache directory is not writable ({e})"
    if back is not None:
        _fresh_outputs(back)
    return back, None


def _twins(graph: torch.fx.GraphModule, back: torch.fx.GraphModule,
           ) -> list[tuple[torch.fx.Node, torch.fx.Node]] | None:
    """(node of ``graph``, its twin in ``back``, ``graph`` read back from its pickle) for every node of ``back``
    but its constants, in order; None where ``back`` is not ``graph`` less what the pickle folds.

    NOTE: unpickling a GraphModule traces its code again (``fx.graph_module._deserialize_graph_module``), and a
    call none of whose arguments is a traced value runs there and then: an input-free computation (an aten
    ``zeros``, ``arange``, a ``scalar_tensor`` and the ``where`` of two) reads back as one tensor constant, a
    ``get_attr`` at each of its uses, and a tensor attribute of the graph the same. HF Llama's causal mask is
    such a computation, and a layer's ``where(scalar_tensor, scalar_tensor)`` inside each nested region: paired
    by position, every node after the first fold had another's tags, and the graph was never stored."""
    folded = _folded(graph.graph)
    olds = [n for n in graph.graph.nodes if n not in folded]
    news = [n for n in back.graph.nodes if n.op != "get_attr"]
    if len(olds) != len(news) or any(a.op != b.op or a.target != b.target for a, b in zip(olds, news)):
        return None
    return list(zip(olds, news))


def _folded(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes a pickle round trip turns into constants: ``get_attr`` and every call none of whose arguments
    is anything but such a node (:func:`_twins`' NOTE)."""
    folded: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr" or (node.op == "call_function" and all(a in folded for a in node.all_input_nodes)):
            folded.add(node)
    return folded


def _frozen_by_pickle(graph: torch.fx.GraphModule) -> str | None:
    """Why ``graph`` read back from its pickle would compute something else than ``graph``, or None.

    A call with no traced input runs once when the pickle is read and becomes one constant (:func:`_twins`'
    NOTE), which is the same value only for a pure computation whose result nothing writes: a random op
    (``torch.rand(4, 8)``, stochastic depth's ``empty(...).bernoulli_(p)`` under static shapes) would draw once
    and give every later call that draw; a buffer made by ``empty`` or ``zeros`` and written by the graph (an
    ``out=`` call, a ``copy_``, a lazily allocated KV cache's ``index_copy_``) would be one tensor shared by
    every call, each call's writes landing in the last call's. Such a graph is not stored, and the graph compiled
    is the rewritten one, not the one read back. (A constant the graph returns is copied at each call:
    :func:`_fresh_outputs`.)"""
    for gm in graph.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        folded = {n for n in _folded(gm.graph) if n.op == "call_function"}
        if not folded:
            continue
        for node in gm.graph.nodes:
            if node in folded and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
                return (f"a random op with no traced input ({node.format_node()}): read back from the cache it "
                        "would be one constant draw, the same at every call")
            if node in folded and not _pure_call(node.target):
                return (f"a call with no traced input that is not an aten op ({node.format_node()}): reading the "
                        "entry would run it (a collective, a higher-order op) there and then")
            schema = private_aten.schema_of(node.target)
            if node.op != "call_function" or schema is None:
                continue
            for arg, value in zip(schema.arguments, _schema_values(node, schema)):
                written = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if v in folded]
                if arg.alias_info is not None and arg.alias_info.is_write and written:
                    return (f"{node.name} writes {written[0].name}, computed from no input: read back from the cache "
                            "it would be one tensor every call writes")
    return None


def _fresh_outputs(back: torch.fx.GraphModule) -> None:
    """Each tensor constant the graph read back returns, returned as a copy made at each call.

    NOTE: a graph that returns a tensor computed from no input (HF's sliding-window DynamicCache hands out a
    ``torch.tensor`` made in the forward: ``lift_fresh_copy``) gives a new tensor at each call; read back from
    its pickle, that computation is a constant (:func:`_twins`' NOTE), and returned as it is every call would
    hand out the same tensor, which a caller owning it may write. Clones go just before the output, so the
    positions the region tags name are unchanged."""
    output = next(iter(reversed(back.graph.nodes)))
    copies: dict[torch.fx.Node, torch.fx.Node] = {}

    def fresh(arg: torch.fx.Node) -> torch.fx.Node:
        if arg.op != "get_attr" or not isinstance(getattr(back, str(arg.target), None), torch.Tensor):
            return arg
        if arg not in copies:
            with back.graph.inserting_before(output):
                copies[arg] = back.graph.call_function(torch.ops.aten.clone.default, (arg,))
            if "val" in arg.meta:
                copies[arg].meta["val"] = arg.meta["val"]
        return copies[arg]

    output.args = torch.fx.node.map_arg(output.args, fresh)
    if copies:
        back.recompile()


def _pure_call(target: Any) -> bool:
    """An aten or prims op (random ones are told apart by their tag), or a Python ``operator`` function."""
    return getattr(target, "namespace", None) in ("aten", "prims") or getattr(target, "__module__", None) == "_operator"


def _schema_values(node: torch.fx.Node, schema: Any) -> list[Any]:
    """The value given for each argument of ``schema`` at ``node`` (positional, then by name; None if absent)."""
    return [node.args[i] if i < len(node.args) else node.kwargs.get(a.name) for i, a in enumerate(schema.arguments)]


def _carry_vals(twins: list[tuple[torch.fx.Node, torch.fx.Node]]) -> None:
    """Each node of the graph read back given its twin's ``meta["val"]``, and each constant it reads the ``val`` of
    what its twin read there: the outline reads them (``rewrite/outline.py``), and would else trace the graph on
    fakes again to make them."""
    for old, new in twins:
        if "val" in old.meta:
            new.meta["val"] = old.meta["val"]
        for a, b in zip(_flat_args(old), _flat_args(new)):
            if isinstance(b, torch.fx.Node) and b.op == "get_attr" and isinstance(a, torch.fx.Node) \
                    and "val" in a.meta and "val" not in b.meta:
                b.meta["val"] = a.meta["val"]


def _flat_args(node: torch.fx.Node) -> list[Any]:
    out: list[Any] = []
    torch.fx.node.map_aggregate((node.args, node.kwargs), out.append)
    return out


def _tags(gm: torch.fx.GraphModule) -> list[tuple[int, Any, Any]]:
    """Each checkpoint-tagged node's (position, policy, region)."""
    return [(i, n.meta["recompute"], n.meta.get("ac_graph_id")) for i, n in enumerate(gm.graph.nodes)
            if "recompute" in n.meta]


def shape_facts(fake_args: list[Any]) -> Any:
    """What the fakes' ShapeEnv knows: a rewrite that changed it is not cached, since a hit would not make
    the same change (``_torch.shape_env_facts``)."""
    return private.shape_env_facts(private.fake_mode_of(fake_args))
