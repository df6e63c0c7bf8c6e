"""A user plan (``plan={fqn_glob: style}``): each linear's style from the key that names it.

Before: the matched linears of one graph and the plan dict. After: a
:class:`~dynashard.plan.decision.Decision` per linear::

    {"layers.*.mlp.up": "colwise", "mlp.down": "rowwise"}
    layers.0.mlp.up   -> colwise, "plan key 'layers.*.mlp.up'"
    layers.0.mlp.down -> rowwise, "plan key 'mlp.down'"   (a key also matches a dotted suffix)
    lm_head           -> replicate, "not named by the plan"

A PEFT-wrapped layer (``q_proj`` holding ``q_proj.base_layer`` and its adapters ``q_proj.lora_A.*``,
``q_proj.lora_B.*``) is named by the layer's own FQN, as before wrapping, so a plan written for the base
model (an HF ``base_model_tp_plan``) cuts the base layer; an adapter no key names follows its base's style
(auto.adapter_decision: no collective of its own), one a key names takes that key's style.

A Hugging Face plan's styles for expert parameters (keys under a ``moe_tp_experts`` container) name
the weight dim HF cuts; each becomes colwise or rowwise by how the weight is stored (options.ParamDim).

Invariants: every key matches a linear, else an error naming the closest FQNs (a warning for a
Hugging Face plan, which names the layers of every configuration of its architecture); a linear the plan
names that cannot be sharded (its weight read by other ops, experts or embeddings in a per-rank
mode, a shared weight split two ways) is an error, never skipped; the last matching key wins.
"""

from __future__ import annotations

import difflib
import fnmatch
import warnings

import torch.fx

from dynashard.errors import UsageError
from dynashard.options import ParamDim, Style
from dynashard.plan.auto import adapter_decision
from dynashard.plan.context import PlanContext
from dynashard.plan.decision import Decision, shared_conflicts, split_dim

# PEFT's tuner layers (``lora.Linear`` and the others) hold the layer they adapt under this name
_PEFT_BASE = ".base_layer"


def key_matches(key: str, fqn: str) -> bool:
    """A plan key matches a module FQN in full, or a dotted suffix of it (HF base-model plans); a PEFT
    base layer's FQN also as the FQN of the layer it was before PEFT wrapped it."""
    names = (fqn, fqn.removesuffix(_PEFT_BASE)) if fqn.endswith(_PEFT_BASE) else (fqn,)
    return any(fnmatch.fnmatchcase(n, key) or fnmatch.fnmatchcase(n, "*." + key) for n in names)


def _layer_style(style: Style | ParamDim, m) -> Style:
    """A plan's style for linear ``m``; an HF expert parameter's cut dim (ParamDim) is colwise where
    that dim holds the output features, rowwise where it holds the input features."""
    if not isinstance(style, ParamDim):
        return style
    cut = m.kind.weight_dims + (0 if style == ParamDim.SECOND_LAST else 1)
    return Style.COLWISE if cut == m.out_dim else Style.ROWWISE


def user_decisions(ctx: PlanContext) -> dict[torch.fx.Node, Decision]:
    """The styles of ``ctx.options.plan_dict``, checked against what each linear allows."""
    linears, blocked, plan, mesh = ctx.linears, ctx.blocked, ctx.options.plan_dict, ctx.mesh
    names = sorted({m.fqn for m in linears})
    for key in plan:
        if not any(key_matches(key, n) for n in names):
            close = difflib.get_close_matches(key, names, n=5, cutoff=0.3) or names[:5]
            if ctx.options._hf_plan:  # (names the layers of every configuration of its architecture: options.py)
                warnings.warn(f"dynashard: plan key {key!r} of a Hugging Face plan matches no linear layer in the "
                              f"compiled graph, so it has no effect (closest linear FQNs: {close}).", UserWarning,
                              stacklevel=2)
                continue
            raise UsageError(
                f"dynashard: plan key {key!r} matches no linear layer in the compiled graph; "
                f"closest linear FQNs: {close}. Fix the key (globs like 'layers.*.mlp.up' are "
                "matched against module FQNs as in model.named_modules())."
            )
    decisions: dict[torch.fx.Node, Decision] = {}
    followers = []  # LoRA A and B no key names: they follow their base's style, decided below
    for m in linears:
        keys = [k for k in plan if key_matches(k, m.fqn)]
        update = ctx.updates.get(m.node)
        if not keys and update is not None and m in (update.a, update.b):
            followers.append(m)
            continue
        if not keys:
            decisions[m.node] = Decision(Style.REPLICATE, "not named by the plan")
            continue
        style = _layer_style(plan[keys[-1]], m)
        if style != Style.REPLICATE and (refused := m.kind.refused(False, False)) is not None:
            raise UsageError(f"dynashard: plan asks for {style} on {m.kind} {m.fqn!r}, but {refused}; expected "
                             "'replicate' for it.")
        if style != Style.REPLICATE and blocked[m.node]:
            raise UsageError(
                f"dynashard: plan asks for {style} on {m.fqn!r}, but its {blocked[m.node]}, so it "
                "cannot be sharded. Expected a weight used only by linear layers; set its style to "
                "'replicate' or remove it from the plan."
            )
        if style != Style.REPLICATE and (refused := m.kind.refused(mesh.stacked, mesh.per_rank)) is not None:
            raise UsageError(
                f"dynashard: plan asks for {style} on {m.kind} {m.fqn!r}, but {refused}; expected 'replicate' "
                "for it, or the default inputs='replicated', weights='replicated'."
            )
        if style != Style.REPLICATE and (refused := m.kind.refused_dim(split_dim(m, style), mesh.per_rank)) is not None:
            raise UsageError(
                f"dynashard: plan asks for {style} on {m.kind} {m.fqn!r}, but {refused}; expected "
                "'replicate' for it, or the style that cuts the exact dim."
            )
        if style != Style.REPLICATE and (refused := m.kind.refused_world(split_dim(m, style), mesh.world)) is not None:
            raise UsageError(f"dynashard: plan asks for {style} on {m.kind} {m.fqn!r} at world size {mesh.world}, but "
                             f"{refused}; expected 'replicate' for it, or 'colwise'.")
        decisions[m.node] = Decision(style, f"plan key {keys[-1]!r}")
    for m in followers:
        follows = None if blocked[m.node] else adapter_decision(m, ctx.updates, decisions)
        decisions[m.node] = follows or Decision(Style.REPLICATE, "not named by the plan")
    for ms in shared_conflicts(linears, decisions).values():
        uses = ", ".join(sorted({f"{m.fqn} as {decisions[m.node].style}" for m in ms}))
        raise UsageError(
            f"dynashard: one weight is used by several layers that the plan splits differently ({uses}); "
            "expected every use of a shared weight to have styles that split the same dim (e.g. a tied "
            "embedding 'rowwise' with its LM head 'colwise'), or all 'replicate'."
        )
    return decisions
