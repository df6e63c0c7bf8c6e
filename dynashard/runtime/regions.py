"""Regional compilation: the blocks of a model compiled one at a time share one plan and one program.

The regional recipes (``for block in model.layers: block.compile(backend="dynashard")``, accelerate's
``compile_regions``, ``torch.compile(block)`` per block) give Dynamo one frame, the block's forward,
called with each block's parameters. Dynamo compiles it again for every block: its guards check each
parameter's type, and the compile of block 0 turned block 0's weights into facades (facades.py), so
block 1's plain ``nn.Parameter`` fails them. Planned afresh, each such compile would trace, plan,
rewrite and compile the same graph again (N blocks: N times the backend's work), and once the frame had
Dynamo's ``recompile_limit`` compiles (8) the later blocks would run uncompiled and unsharded, each rank
holding their full weights, with only torch's "hit config.recompile_limit" to say so.

So a compile whose graph is the same as an earlier one's (same Dynamo code and subgraphs, the same inputs' names,
shapes, strides, dtypes and devices, the same options, group, grad and autocast state, attention kernels allowed
and earlier cuts) reuses that program: the new block's weights are checked across ranks and the program (which
looks each shard up by the parameter passed, and adopts a parameter it has not seen: cut and freed at its first
call, program.py) runs them. That reuse does not cut at compile time, so the guards of this second compile see
plain parameters: every later block's first call matches them (and is adopted), every later call of a cut block
matches the first compile's. Two Dynamo compiles and one plan for any number of blocks. Every rank agrees on
reusing first (one small collective), so a rank whose program was collected compiles with the others. Symbolic
sizes are never reused: Inductor may add guards on them while it compiles, and those belong to the first compile's
entry only.

Invariants: a reused program is one an earlier compile of the same Dynamo frame returned since the last
``torch._dynamo.reset()`` (which starts the frame ids again: a program from before it, still alive in a cycle the
collector has not reached, is never reused), held by weak references; nothing is reused across process groups,
options or earlier cuts; the ranks reuse together or not at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from dynashard import _torch as private
from dynashard._torch import regions as private_regions
from dynashard.comm.collectives import group_name
from dynashard.comm.protocol import all_gather_objects
from dynashard.options import Options
from dynashard.report import progress
from dynashard.runtime.program import ShardedProgram
from dynashard.training import fsdp
from dynashard.weights.store import STORE

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Region:
    """A compiled program and what a later, identical graph needs to reuse it."""

    program: weakref.ref  # the ShardedProgram (Dynamo holds it; dead after torch._dynamo.reset())
    params: dict[int, str]  # input slot -> FQN of every parameter the graph reads (checked across ranks)
    whole: tuple[int, ...]  # parameter slots the plan reads whole
    fingerprint: str
    frame: int  # Dynamo's frame id of the first compile: reused only by later compiles of that frame
    generation: int  # Dynamo's (torch._dynamo.reset() starts another, and the frame ids again from 0)
    reuses: int = 0


_REGIONS: dict[str, Region] = {}  # graph_key -> the first program compiled for it


def graph_key(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options, group: dist.ProcessGroup,
              world: int, rank: int) -> str | None:
    """A digest of everything the backend's program for ``gm`` depends on, or None where a program must
    not be reused: symbolic sizes, tensor constants in the graph, per_rank weights, FSDP2 or DTensor inputs, a
    selective activation-checkpoint policy (a function whose choices the code does not show: a block given another
    policy reused the first block's program, recomputing what the first policy asked)."""
    if opts.weights == "per_rank" or fsdp.live_slots(example_inputs) or private_regions.checkpoint_policies(gm):
        return None
    slots = [n for n in gm.graph.nodes if n.op == "placeholder"]
    parts: list[Any] = [opts.__class__.__name__, repr(dataclasses.replace(opts, group=None)), group_name(group),
                        id(group), world, rank, torch.is_grad_enabled(), _autocast_state(),
                        private.attention_state(example_inputs)]
    for m in gm.modules():
        if not isinstance(m, torch.fx.GraphModule):
            continue
        for node in m.graph.find_nodes(op="get_attr"):
            if isinstance(getattr(m, str(node.target), None), torch.Tensor):
                return None  # (a constant of this block's own: its values are not in the key)
        parts.append(m.code)
    for node, value in zip(slots, example_inputs, strict=True):
        fake = private.example_value(node)
        if isinstance(fake, torch.SymInt) or isinstance(value, torch.SymInt) or private.from_fsdp_module(node):
            return None
        if isinstance(fake, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*fake.shape, *fake.stride())):
            return None
        if isinstance(value, torch.Tensor):
            parts.append((private.placeholder_source_name(node), type(value).__name__, tuple(value.shape),
                          value.stride(), str(value.dtype), str(value.device), value.requires_grad, value.is_meta))
        else:
            parts.append((private.placeholder_source_name(node), repr(value)))
    earlier = STORE.earlier_cuts(example_inputs)
    parts.append((sorted(earlier.split.items()), sorted(earlier.whole)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _autocast_state() -> tuple:
    return tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda"))


def find(key: str | None, group: dist.ProcessGroup, agree: bool) -> Region | None:
    """The region compiled earlier for ``key`` by an earlier compile of the frame Dynamo compiles now, since the
    last ``torch._dynamo.reset()``, if every rank has one (one collective when ``agree``). A
    program compiled for another group is not one, even under the same key: the key holds the group's ``id``, and
    a group made after another was destroyed and collected may have its address."""
    region = _REGIONS.get(key) if key is not None else None
    program = region.program() if region is not None else None
    now = private_regions.dynamo_compile_id()
    if program is not None and (not program.compiled_for(group) or now is None or now[0] != region.frame
                                or now[1] == 0 or region.generation != private_regions.dynamo_generation()):
        program = None
    if agree:  # (a key of None on every rank: no graph to reuse, nothing to agree)
        everyone = all_gather_objects(program is not None if key is not None else None, group)
        if any(e is None for e in everyone) and any(e is not None for e in everyone):
            return None  # (ranks disagree on whether this graph can be reused at all: compiled afresh on every rank)
        if not all(everyone):
            return None
    return region if program is not None else None


def remember(key: str | None, program: ShardedProgram, planned: Any) -> None:
    """Keep ``program`` for later compiles of this frame with ``key`` (the latest program compiled for it)."""
    now = private_regions.dynamo_compile_id()
    if key is None or now is None:
        return
    for stale in [k for k, r in _REGIONS.items() if r.program() is None]:
        del _REGIONS[stale]
    _REGIONS[key] = Region(weakref.ref(program), dict(planned.params),
                           tuple(i for i in planned.params if i not in planned.sharded), program.fingerprint, now[0],
                           private_regions.dynamo_generation())


def reuse(region: Region, example_inputs: list[Any], group: dist.ProcessGroup, opts: Options, agree: bool,
          started: float) -> ShardedProgram:
    """``region``'s program for this graph: this graph's weights checked across ranks, and cut at the
    program's first call with them (not here: Dynamo's guards of this compile then accept every later
    block's plain parameters)."""
    program = region.program()
    assert program is not None, "find() returned a collected region"  # (find holds it in this frame's caller)
    progress.stage("reusing the program of an identical graph (regional compilation)")
    if agree:
        named = [(fqn, example_inputs[i]) for i, fqn in region.params.items()]
        STORE.agree(named, f"region:{region.fingerprint}", group, opts.weights, check_values=True)
    STORE.note_read_whole([example_inputs[i] for i in region.whole])
    region.reuses += 1
    name, compile_id, _ = private.compile_info()
    log.log(progress.level(), "dynashard: graph %s of %s is the same graph as an earlier compile's (regional "
            "compilation, %d reuses): its plan and compiled program reused, this one's weights cut at its first "
            "call; %.2f s",
            compile_id or "?", name, region.reuses, time.perf_counter() - started)
    _warn_near_the_recompile_limit(name)
    return program


def _warn_near_the_recompile_limit(name: str) -> None:
    """The compile that takes a frame to Dynamo's recompile limit: later blocks would run whole, uncompiled."""
    now, limit = private_regions.dynamo_compile_id(), private_regions.recompile_limit()
    if now is None or now[1] + 1 != limit:
        return
    compiles = now[1] + 1
    warnings.warn(
        f"dynashard: {name} has now been compiled {compiles} times, torch._dynamo.config.recompile_limit: Dynamo "
        "compiles a regionally compiled block again for each block (their parameters' types differ once a "
        "block is cut), so every later block runs uncompiled and unsharded, its full weights held on every "
        "rank. Expected dynashard.parallelize(model, example_inputs) before compiling the blocks (every block "
        "then shares one compile), or torch._dynamo.config.recompile_limit set to at least the number of "
        "blocks plus one.",
        UserWarning,
        stacklevel=1,
    )
