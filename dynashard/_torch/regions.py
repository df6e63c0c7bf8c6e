"""Private torch APIs of regional compilation: ``torch.compiler.nested_compile_region``'s
``invoke_subgraph`` calls, and Dynamo's count of compiles of one frame (``dynashard/regions.py``).
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from dynashard._torch import fake_mode_of, placeholder_source_fqn, placeholder_source_name

# Each node an inlined call copies is tagged with (region identifier, call number) in meta "custom", and each
# retrace (the aten trace, the rewrite) tags what it traces for a tagged node alike (:func:`tagging`): the
# rewritten graph still says which call each of its nodes came from, and dynashard/rewrite/outline.py puts the
# regions back.
REGION = "dynashard_region"


@contextlib.contextmanager
def tagging(node: torch.fx.Node) -> Iterator[None]:
    """Inside a make_fx trace: every node traced within gets ``node``'s region tag (none: nothing done).

    NOTE: make_fx appends each traced node to its tracer's graph (``ProxyTorchDispatchMode.tracer.graph``), so
    the nodes after the graph's last one on entry are this node's. fx.traceback.preserve_node_meta would carry
    the tag too (``custom`` is among torch.fx.proxy._COPY_META_FIELDS), but it copies every field and a
    provenance record per traced node: measured 2 s more of tracing for 32 layers."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    tag = (node.meta.get("custom") or {}).get(REGION)
    mode = get_proxy_mode() if tag is not None else None
    if mode is None:
        yield
        return
    nodes = mode.tracer.graph.nodes
    last = next(iter(reversed(nodes)), None)
    yield
    for new in reversed(nodes):
        if new is last:
            break
        new.meta["custom"] = {**(new.meta.get("custom") or {}), REGION: tag}


class TaggingInterpreter(torch.fx.Interpreter):
    """A graph run node by node (under make_fx: the aten trace of an inlined graph), with :func:`tagging`."""

    def run_node(self, n: torch.fx.Node) -> Any:
        with tagging(n):
            return super().run_node(n)


def inline_regions(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """Inline every ``invoke_subgraph`` call of ``gm`` (and of its subgraphs) into its caller, each copied
    node of a call of ``gm``'s own graph tagged ``meta["custom"][REGION] = (identifier, call number)``;
    returns (calls inlined, distinct regions).

    NOTE: torch 2.13's Dynamo captures a ``torch.compiler.nested_compile_region`` function as one
    subgraph (traced once) and one ``torch.ops.higher_order.invoke_subgraph(subgraph, identifier,
    *operands)`` per call, each layer's parameters among the operands. make_fx keeps the op whole, so a
    plan of the aten graph saw no linear inside it, and AOTAutograd is needed for its backward (run
    eagerly: "fake_mode should be enabled for HOPs"). These are the steps of torch's own pass
    (``torch._higher_order_ops.passes.inline_invoke_subgraph``, torch 2.12+), with the tags."""
    invoke = torch.ops.higher_order.invoke_subgraph
    calls = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.find_nodes(op="call_function", target=invoke)]
    if calls:
        _warn_of_calls_on_the_same_parameters(list(gm.graph.find_nodes(op="call_function", target=invoke)))
        _inline_invoke_subgraph(gm, tag=True)
        gm.recompile()
    return len(calls), len({str(n.args[1]) for n in calls})


def _warn_of_calls_on_the_same_parameters(calls: list[torch.fx.Node]) -> None:
    """Two calls of one region on the same parameters, without gradients: what torch's Dynamo (2.13.0 to 2.15.0)
    makes of a region bound per instance (``layer.forward = region.__get__(layer)``, called under ``no_grad``):
    every call is given the first layer's parameters, and stock ``torch.compile`` computes the first layer in place
    of each of the others (benchmarks/results/compat.md). A block meant to run twice reads the same parameters too:
    a warning, not a refusal."""
    if torch.is_grad_enabled():
        return
    first: dict[tuple[str, tuple[torch.fx.Node, ...]], torch.fx.Node] = {}
    for node in calls:
        params = tuple(a for a in node.args[2:] if isinstance(a, torch.fx.Node) and a.op == "placeholder"
                       and _is_parameter(a))
        key = (str(node.args[1]), params)
        if params and key in first:
            names = ", ".join(".".join(where) if (where := placeholder_source_fqn(a)) else a.name for a in params[:2])
            warnings.warn(
                f"dynashard: two calls of the nested_compile_region {key[0]} read the same parameters ({names}, ...). "
                "If they are calls of different modules, torch gave every call the first module's parameters, and "
                "the model computes that module in place of the others (torch.compile alone too): torch 2.13-2.15's "
                "Dynamo does this to a region bound per instance (layer.forward = region.__get__(layer)) under "
                "no_grad. Expected the layer class's forward decorated: cls.forward = "
                "torch.compiler.nested_compile_region(cls.forward).", UserWarning, stacklevel=1)
            return
        first[key] = node


def _is_parameter(node: torch.fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.nn.Parameter) or "_parameters[" in placeholder_source_name(node)


def region_of(node: torch.fx.Node) -> tuple[str, int] | None:
    """(region identifier, call number) of a node an inlined call made, or a node traced for one; else None."""
    tag = (node.meta.get("custom") or {}).get(REGION)
    return None if tag is None else (str(tag[0]), int(tag[1]))


def region_tags(gm: torch.fx.GraphModule) -> tuple[tuple[int, str, int], ...]:
    """(node position, region identifier, call number) of each tagged node of ``gm``."""
    return tuple((i, *tag) for i, n in enumerate(gm.graph.nodes) if (tag := region_of(n)) is not None)


def retag(gm: torch.fx.GraphModule, tags: tuple[tuple[int, str, int], ...]) -> bool:
    """``region_tags`` put back on ``gm`` (a graph read back from a pickle, whose node meta is lost); False, and
    nothing tagged, where a position is not a computing node of ``gm``."""
    nodes = list(gm.graph.nodes)
    if any(i >= len(nodes) or nodes[i].op != "call_function" for i, _, _ in tags):
        return False
    for i, identifier, number in tags:
        nodes[i].meta["custom"] = {**(nodes[i].meta.get("custom") or {}), REGION: (identifier, number)}
    return True


def _inline_invoke_subgraph(gm: torch.fx.GraphModule, tag: bool = False) -> torch.fx.GraphModule:
    """Each ``invoke_subgraph(subgraph, identifier, *operands)`` call replaced by a copy of the subgraph's nodes
    on its operands, each ``getitem`` of its result by the copied output it names (nested calls inside a
    subgraph first, untagged: their nodes are their outer call's)."""
    invoke = torch.ops.higher_order.invoke_subgraph
    nodes = list(gm.graph.find_nodes(op="call_function", target=invoke))
    if not nodes:
        return gm
    for name, module in gm.named_modules():
        if name and isinstance(module, torch.fx.GraphModule):
            _inline_invoke_subgraph(module)
    numbers: dict[str, int] = {}
    for node in nodes:
        get_attr, identifier, operands = node.args[0], str(node.args[1]), node.args[2:]
        number = numbers[identifier] = numbers.get(identifier, -1) + 1
        subgraph = getattr(gm, str(get_attr.target))
        renamed = _hoist_submodules(gm, subgraph)
        env: dict[torch.fx.Node, Any] = dict(zip(subgraph.graph.find_nodes(op="placeholder"), operands))
        given = {p for p, operand in env.items() if _number_given(p, operand)}
        with gm.graph.inserting_before(node):
            for sub in subgraph.graph.nodes:
                if sub.op in ("placeholder", "output"):
                    continue
                if sub.op == "call_method" and sub.target == "item" and sub.args[0] in given:
                    env[sub] = env[sub.args[0]]  # (the number the call gave: the ``.item()`` Dynamo made outside)
                    continue
                copied = env[sub] = gm.graph.node_copy(sub, env.__getitem__)
                if sub.op == "get_attr" and sub.target in renamed:
                    copied.target = renamed[sub.target]
                if tag:  # (node_copy copies meta shallowly: a dict of its own per node)
                    copied.meta["custom"] = {**(sub.meta.get("custom") or {}), REGION: (identifier, number)}
        outputs = subgraph.graph.output_node().args[0]
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(env[outputs[user.args[1]]])
                gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not get_attr.users:
            gm.graph.erase_node(get_attr)
    return gm


def _number_given(placeholder: torch.fx.Node, operand: Any) -> bool:
    """Whether a call gives a number (a float, a SymFloat: a value Dynamo took ``.item()`` of outside the call)
    where the subgraph takes the one-element tensor it takes ``.item()`` of, and of which it reads nothing else.

    NOTE: torch 2.13's Dynamo, under ``dynamic=True`` (``torch._dynamo.config.specialize_float`` False by
    default), passes a module's float attribute (an RMSNorm's ``eps``) to the graph as a 0-d float64 tensor
    and takes its ``.item()``, a SymFloat. A nested region traced with such a tensor operand takes ``.item()``
    inside its subgraph on the first call, but Dynamo's later calls of the same subgraph pass the SymFloat it
    made outside (``invoke_subgraph(subgraph_0, 'subgraph_0', s0, s1, x_1, item_1, ...)``): copied as it is,
    the subgraph's ``.item()`` of a SymFloat failed ("'SymFloat' object has no attribute 'item'")."""
    if not isinstance(operand, torch.fx.Node):
        return isinstance(operand, float)
    value = operand.meta.get("example_value", operand.meta.get("val"))
    taken = placeholder.meta.get("example_value", placeholder.meta.get("val"))
    if not isinstance(value, (float, torch.SymFloat)) or not isinstance(taken, torch.Tensor):
        return False
    if not all(u.op == "call_method" and u.target == "item" for u in placeholder.users):
        raise NotImplementedError(f"dynashard: a nested_compile_region call gives the number {operand.name} "
                                  f"where its subgraph reads the tensor {placeholder.name} otherwise than by .item()")
    return True


def _hoist_submodules(gm: torch.fx.GraphModule, subgraph: torch.fx.GraphModule) -> dict[str, str]:
    """The subgraph's own submodules (a nested region's body, a checkpoint's) registered on ``gm``: old name ->
    name on ``gm``, for the ``get_attr`` nodes copied from it."""
    renamed: dict[str, str] = {}
    for name, child in list(subgraph.named_children()):
        new, n = name, 0
        while hasattr(gm, new):
            new, n = f"{name}_{n}", n + 1
        gm.add_module(new, child)
        renamed[name] = new
    return renamed


def add_subgraph(gm: torch.fx.GraphModule, name: str, graph: torch.fx.Graph) -> str:
    """``graph`` registered on ``gm`` as a submodule for ``invoke_subgraph`` (a free name from ``name``)."""
    new, n = name, 0
    while hasattr(gm, new):
        new, n = f"{name}_{n}", n + 1
    gm.add_submodule(new, torch.fx.GraphModule(torch.nn.Module(), graph))
    return new


def call_subgraph(graph: torch.fx.Graph, subgraph: str, identifier: str, operands: list[torch.fx.Node],
                  outputs: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """At the graph's insert point: ``invoke_subgraph(subgraph, identifier, *operands)`` and a ``getitem`` of each
    of its results (``outputs``: the values they stand for, whose meta they take).

    NOTE: torch 2.13's AOTAutograd and Inductor trace a subgraph once per identifier (``InvokeSubgraphCache``)
    and reuse it for every call naming it: a call with the same identifier must be the same subgraph."""
    invoke = graph.call_function(torch.ops.higher_order.invoke_subgraph,
                                 (graph.get_attr(subgraph), identifier, *operands))
    invoke.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    results = []
    for i, output in enumerate(outputs):
        result = graph.call_function(operator.getitem, (invoke, i))
        result.meta = {k: v for k, v in output.meta.items() if k != "custom"}
        results.append(result)
    return results


def subgraph_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule | None:
    """The subgraph an ``invoke_subgraph`` node of ``gm`` calls; None for any other node."""
    if node.op != "call_function" or node.target is not torch.ops.higher_order.invoke_subgraph:
        return None
    return getattr(gm, str(node.args[0].target))


def propagate_vals(gm: torch.fx.GraphModule, fake_args: list[Any]) -> None:
    """Each node's ``meta["val"]`` made again by running ``gm`` on ``fake_args`` (a graph read back from a pickle
    has none; its tensor constants are real tensors, which the fake mode then takes as they are)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = fake_mode_of(fake_args)
    allowed, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True  # (the graph's real constants)
    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_args)
    finally:
        mode.allow_non_fake_inputs = allowed


def forget_grad_state(output: torch.fx.Node) -> None:
    """A subgraph's output made to say nothing of whether it requires grad: the autograd of ``invoke_subgraph``
    then runs the subgraph on fakes to see.

    NOTE: torch 2.13's ``invoke_subgraph`` autograd reads each output's ``meta["val"].requires_grad`` (made for
    Dynamo's graphs), and a make_fx graph's values (traced below autograd) never require grad: every output
    was taken for one without a gradient, and AOTAutograd's joint trace failed ("outs_to_grad length (1) !=
    tangents length (0)"). Without ``val`` it falls back to running the subgraph (``_get_output_metadata_by_
    execution``, on fake tensors here)."""
    output.meta.pop("val", None)


def dynamo_compile_id() -> tuple[int, int] | None:
    """(frame id, compile number within that frame, from 0) of the compile Dynamo runs now; None outside one.

    NOTE: torch 2.13 names a compile ``[frame_id/frame_compile_id]`` (``CompileContext.current_compile_id``);
    the frame id is per code object, and ``torch._dynamo.reset()`` starts the ids again from 0."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_id is None or compile_id.frame_compile_id is None:
        return None
    return compile_id.frame_id, compile_id.frame_compile_id


def checkpoint_policies(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` checkpoints a region with a selective policy (``checkpoint(..., context_fn=...)``): a
    function deciding per op what the backward recomputes, which the graph's code does not show.

    NOTE: torch 2.13's Dynamo keeps it on the checkpointed body's GraphModule, ``meta["_checkpoint_context_fn"]``
    (the ``tag_activation_checkpoint`` node itself carries ``use_reentrant`` only)."""
    return any(m.meta.get("_checkpoint_context_fn") is not None
               for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


_GENERATION = [0]  # (dynamo_generation's count)


def dynamo_generation() -> int:
    """A number that changes with every ``torch._dynamo.reset()`` (the same between two resets).

    NOTE: torch 2.11-2.15's ``reset()`` clears ``torch._dynamo.utils.warn_once_cache`` (the set of messages
    ``warn_once`` has shown): a message of ours kept there is gone after a reset, and its absence is one. A torch
    without that set gives 0 always (tests/test_torch_private.py fails there): regions are then told apart by
    their programs' weak references alone."""
    import torch._dynamo.utils

    shown = getattr(torch._dynamo.utils, "warn_once_cache", None)
    if not isinstance(shown, set):
        return 0
    if f"dynashard: dynamo generation {_GENERATION[0]}" not in shown:
        _GENERATION[0] += 1
        shown.add(f"dynashard: dynamo generation {_GENERATION[0]}")
    return _GENERATION[0]


def frame_compiles(code: Any) -> int:
    """How many compiled entries Dynamo holds for the code object ``code`` (a frame past ``recompile_limit`` of
    them runs uncompiled). NOTE: torch 2.13's ``torch._dynamo.eval_frame._debug_get_cache_entry_list``."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def forget_frame(code: Any) -> None:
    """Dynamo forgets the code object ``code``: its compiled entries, and its mark to run the frame uncompiled
    from then on (the mark a frame gets when Dynamo meets an error in it while tracing: "Skipping the function
    and falling back to eager"). Its next call compiles again. NOTE: ``torch._dynamo.eval_frame.remove_from_cache``
    (its C ``reset_code``: the code's extra state, entries and frame strategy)."""
    from torch._dynamo import eval_frame

    forget = getattr(eval_frame, "remove_from_cache", None)  # (torch 2.0 on; without it the frame stays skipped)
    if forget is not None:
        forget(code)


def recompile_limit() -> int:
    """Dynamo's limit on a frame's compiles: once reached, its later calls run uncompiled, with one warning
    ("hit config.recompile_limit"). NOTE: ``config.recompile_limit`` (8 by default; ``cache_size_limit``
    before torch 2.6)."""
    from torch._dynamo import config

    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))
