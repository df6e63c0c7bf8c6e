"""Private torch APIs of regional compilation: ``torch.compiler.nested_compile_region``'s
``invoke_subgraph`` calls, and Dynamo's count of compiles of one frame (``dynashard/regions.py``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx


def inline_regions(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """Inline every ``invoke_subgraph`` call of ``gm`` (and of its subgraphs) into its caller; returns
    (calls inlined, distinct regions).

    NOTE: torch 2.13's Dynamo captures a ``torch.compiler.nested_compile_region`` function as one
    subgraph (traced once) and one ``torch.ops.higher_order.invoke_subgraph(subgraph, identifier,
    *operands)`` per call, each layer's parameters among the operands. make_fx keeps the op whole, so a
    plan of the aten graph saw no linear inside it, and AOTAutograd is needed for its backward (run
    eagerly: "fake_mode should be enabled for HOPs"). torch's own pass (``torch._dynamo.config.
    inline_invoke_subgraph``, written for compilers that do not take the op) flattens it: Dynamo's
    trace is still done once per region."""
    invoke = torch.ops.higher_order.invoke_subgraph
    calls = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.find_nodes(op="call_function", target=invoke)]
    if calls:
        try:  # (torch 2.12+)
            from torch._higher_order_ops.passes.inline_invoke_subgraph import inline_invoke_subgraph
        except ImportError:  # torch 2.11 has the op but not the pass: the same steps, below
            inline_invoke_subgraph = _inline_invoke_subgraph
        inline_invoke_subgraph(gm)
        gm.recompile()
    return len(calls), len({str(n.args[1]) for n in calls})


def _inline_invoke_subgraph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torch 2.12's ``inline_invoke_subgraph`` for torch 2.11: each ``invoke_subgraph(subgraph, identifier,
    *operands)`` call replaced by a copy of the subgraph's nodes on its operands, each ``getitem`` of its
    result by the copied output it names (nested calls inside a subgraph first)."""
    invoke = torch.ops.higher_order.invoke_subgraph
    nodes = list(gm.graph.find_nodes(op="call_function", target=invoke))
    if not nodes:
        return gm
    for name, module in gm.named_modules():
        if name and isinstance(module, torch.fx.GraphModule):
            _inline_invoke_subgraph(module)
    for node in nodes:
        get_attr, operands = node.args[0], node.args[2:]
        subgraph = getattr(gm, str(get_attr.target))
        env: dict[torch.fx.Node, Any] = dict(zip(subgraph.graph.find_nodes(op="placeholder"), operands))
        with gm.graph.inserting_before(node):
            for sub in subgraph.graph.nodes:
                if sub.op not in ("placeholder", "output"):
                    env[sub] = gm.graph.node_copy(sub, env.__getitem__)
        outputs = subgraph.graph.output_node().args[0]
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(env[outputs[user.args[1]]])
                gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not get_attr.users:
            gm.graph.erase_node(get_attr)
    return gm


def dynamo_compile_id() -> tuple[int, int] | None:
    """(frame id, compile number within that frame, from 0) of the compile Dynamo runs now; None outside one.

    NOTE: torch 2.13 names a compile ``[frame_id/frame_compile_id]`` (``CompileContext.current_compile_id``);
    the frame id is per code object, and ``torch._dynamo.reset()`` starts the ids again from 0."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_id is None or compile_id.frame_compile_id is None:
        return None
    return compile_id.frame_id, compile_id.frame_compile_id


def recompile_limit() -> int:
    """Dynamo's limit on a frame's compiles: once reached, its later calls run uncompiled, with one warning
    ("hit config.recompile_limit"). NOTE: ``config.recompile_limit`` (8 by default; ``cache_size_limit``
    before torch 2.6)."""
    from torch._dynamo import config

    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))
