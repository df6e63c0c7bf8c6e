"""The one typed options object, built from ``torch.compile(..., options={...})``.

Unknown keys and wrong types are rejected here, once, with the list of valid keys, so no
other module has to second-guess what it was given.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Mapping
from typing import Any

from dynashard import _torch as private
from dynashard.errors import OptionTypeError, UsageError


class Style(str, enum.Enum):
    """What a plan does with one linear: cut its output features (``colwise``), its input
    features (``rowwise``, partial sums all-reduced), or keep it whole on every rank."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    REPLICATE = "replicate"

    def __str__(self) -> str:  # (the value, in messages and tables, on every Python version)
        return self.value

    __format__ = str.__format__


class ParamDim(str, enum.Enum):
    """An HF plan entry for an expert parameter (a key under a ``moe_tp_experts`` container): HF
    names the weight dim it cuts (its ``ColwiseParallel`` shards dim -2 of any parameter,
    ``RowwiseParallel`` and ``packed_rowwise`` dim -1), not the layer's features. Which of
    colwise / rowwise that is depends on how the weight is stored: Mixtral's ``[E, out, in]``
    gate_up is ``packed_colwise``, Llama4's ``[E, in, out]`` is ``packed_rowwise`` ("row because
    not linear"); plan/user.py resolves it per layer."""

    SECOND_LAST = "dim -2"
    LAST = "dim -1"


STYLES = tuple(s.value for s in Style)
COMPILERS = ("inductor", "aot_eager", "eager")
WEIGHTS = ("replicated", "rank0", "per_rank")
INPUTS = ("replicated", "per_rank")
CHECKS = ("ids", "shapes", "values", "off")

# Hugging Face transformers 5.x plan styles (``base_model_tp_plan``; transformers/distributed/
# tensor_parallel.py), as dynashard reads them. Where HF gathers an output or splits an input
# explicitly, dynashard does so wherever the graph needs it, so those map to the plain style.
HF_STYLES = {
    "colwise_gather_output": Style.COLWISE, "colwise_rep": Style.COLWISE, "packed_colwise": Style.COLWISE,
    "embedding_colwise": Style.COLWISE,
    "rowwise_split_input": Style.ROWWISE, "rowwise_rep": Style.ROWWISE, "packed_rowwise": Style.ROWWISE,
    "embedding_rowwise": Style.ROWWISE,
}
# Styles that name no linear layer for dynashard to cut. None: the meaning is what dynashard does
# anyway (no warning); a string: why the entry has no effect (a warning names the key).
HF_NOT_LINEAR = {
    "replicated_with_grad_allreduce": None,  # a norm over sharded heads (Qwen3 q_norm): its parameter stays whole
    "all_reduce": None,  # a module's partial output summed: each rowwise linear's all_reduce already is
    "sequence_parallel": "dynashard cuts the activations between the TP regions along the sequence for every "
                         "module at once with options={'sequence_parallel': True}, not per plan entry",
    # experts cut inside every expert (gate_up colwise, down rowwise), one all_reduce per MoE block: what
    # dynashard does with the keys under such a container, and what an identity expert's sum needs
    "moe_tp_experts": None,
    "moe_identity_expert": None,
    "local_params": "dynashard does not shard bare parameters outside linear layers; it stays whole",
    "mla_kv_a_proj": "dynashard keeps DeepSeek MLA's kv_a_proj whole (its output is a latent and a rope part)",
    "grouped_gemm": "an expert-parallel style; dynashard shards experts tensor-parallel (inside every expert), "
                    "not expert-parallel: use the model's base_model_tp_plan or plan='auto'",
    "ep_dispatch_experts": "an expert-parallel style; dynashard shards experts tensor-parallel (inside every "
                           "expert), not expert-parallel: use the model's base_model_tp_plan or plan='auto'",
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated backend options; see the README's "Options" table for the meaning of each."""

    plan: str | tuple[tuple[str, str], ...] = "auto"
    group: Any = None  # ProcessGroup, 1-D DeviceMesh, or None for the world group
    compiler: str = "inductor"
    weights: str = "replicated"
    inputs: str = "replicated"
    # Megatron's sequence parallelism under replicated inputs: between the TP regions activations are
    # cut along the sequence dim (rowwise outputs reduce-scattered, colwise inputs all-gathered)
    sequence_parallel: bool = False
    # A weight with fewer elements than this stays replicated under plan="auto": below
    # 64K elements the collective it needs (tens of microseconds on gloo) costs about what
    # the halved matmul saves.
    min_shard_numel: int = 1 << 16
    # What every call compares across ranks before any collective (docs/errors.md): by
    # default shapes, and values where that is cheap (integer inputs every call, all inputs at compile).
    check_inputs: str = "ids"
    # torch.compile's mode, applied to Inductor as torch.compile applies it (compiler="inductor" only)
    mode: str = "default"
    # Set, not passed: the plan is a Hugging Face base_model_tp_plan (it has a style only HF names). Such
    # a plan names the layers of every configuration of its architecture (Llama4's dense MLP keys in an
    # all-MoE Scout): a key that matches nothing warns, where a user's own key raises (a typo).
    _hf_plan: bool = dataclasses.field(default=False, repr=False)

    @property
    def plan_dict(self) -> dict[str, str] | None:
        return None if self.plan == "auto" else dict(self.plan)


def _linear_entries(plan: Mapping[str, Any]) -> dict[str, Any]:
    """The plan without the HF entries that name no linear layer (norms, expert containers), and
    without the keys under an expert-parallel container (dynashard does not deal experts to ranks);
    a warning names each entry that has no effect, and why."""
    dropped = {k: HF_NOT_LINEAR[v] for k, v in plan.items() if isinstance(v, str) and v in HF_NOT_LINEAR}
    containers = [k for k, v in plan.items() if v == "ep_dispatch_experts"]
    for k in plan:
        parent = next((c for c in containers if k.startswith(c + ".")), None)
        if parent is not None and k not in dropped:
            dropped[k] = (f"part of the expert-parallel experts {parent!r}; dynashard shards experts tensor-parallel, "
                          "so they follow no plan key here and stay whole")
    for k, why in dropped.items():
        if why is not None:
            warnings.warn(f"dynashard: plan entry {k!r}: {plan[k]!r} has no effect: {why}.", UserWarning, stacklevel=4)
    return {k: v for k, v in plan.items() if k not in dropped}


def _placement(style: Style, key: str, plan: Mapping[str, Any]) -> Style | ParamDim:
    """``style`` as HF means it where ``key`` names a parameter under a ``moe_tp_experts`` container."""
    if style == Style.REPLICATE or not any(v == "moe_tp_experts" and key.startswith(k + ".") for k, v in plan.items()):
        return style
    return ParamDim.SECOND_LAST if style == Style.COLWISE else ParamDim.LAST


def _style_name(value: Any, key: str) -> str:
    """Map a plan value (string, HF style name, DTensor ParallelStyle object) to one of STYLES."""
    if isinstance(value, str):
        if value in STYLES:
            return Style(value)
        if value in HF_STYLES:
            return HF_STYLES[value]
        raise UsageError(
            f"dynashard: plan[{key!r}] is {value!r}; expected one of {list(STYLES)}, a Hugging Face plan style "
            f"({sorted(HF_STYLES) + sorted(HF_NOT_LINEAR)}) or a DTensor ColwiseParallel()/RowwiseParallel() object."
        )
    # NOTE: imported lazily; torch.distributed may be absent from a CPU-only build.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(value, ColwiseParallel):
        return Style.COLWISE
    if isinstance(value, RowwiseParallel):
        return Style.ROWWISE
    raise OptionTypeError(
        f"dynashard: plan[{key!r}] is a {type(value).__name__}; expected one of "
        f"{list(STYLES)} or a DTensor ColwiseParallel()/RowwiseParallel() object."
    )


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise UsageError(f"dynashard: option {key!r} is {value!r}; expected one of {list(choices)}.")
    return value


def parse_options(raw: Mapping[str, Any] | Options | None) -> Options:
    """Validate user options into an :class:`Options`; raise with the valid keys on a bad one."""
    if isinstance(raw, Options):
        return raw
    raw = dict(raw or {})
    valid = [f.name for f in dataclasses.fields(Options) if not f.name.startswith("_")]
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise UsageError(f"dynashard: unknown option(s) {unknown}; valid options are {valid}.")
    kwargs: dict[str, Any] = {}
    if "plan" in raw:
        plan = raw["plan"]
        if plan == "auto":
            kwargs["plan"] = "auto"
        elif isinstance(plan, Mapping):
            for k in plan:
                if not isinstance(k, str):
                    raise OptionTypeError(f"dynashard: plan keys must be module FQN strings, found {k!r}.")
            kwargs["plan"] = tuple((k, _placement(_style_name(v, k), k, plan))
                                   for k, v in _linear_entries(plan).items())
            kwargs["_hf_plan"] = any(isinstance(v, str) and v not in STYLES for v in plan.values())
        else:
            raise OptionTypeError(
                f"dynashard: option 'plan' is a {type(plan).__name__}; expected \"auto\" or a dict "
                'from module FQN glob to style, e.g. {"layers.*.mlp.up": "colwise"}.'
            )
    if "group" in raw:
        kwargs["group"] = _check_group(raw["group"])
    if "compiler" in raw:
        kwargs["compiler"] = _check_choice("compiler", raw["compiler"], COMPILERS)
    if "weights" in raw:
        kwargs["weights"] = _check_choice("weights", raw["weights"], WEIGHTS)
    if "inputs" in raw:
        kwargs["inputs"] = _check_choice("inputs", raw["inputs"], INPUTS)
    if kwargs.get("weights") == "per_rank" and kwargs.get("inputs") != "per_rank":
        raise UsageError(
            "dynashard: weights='per_rank' (every rank its own model) needs inputs='per_rank' (every "
            "rank its own batch); found inputs='replicated'. Pass options={'inputs': 'per_rank', ...}."
        )
    if "sequence_parallel" in raw:
        value = raw["sequence_parallel"]
        if not isinstance(value, bool):
            raise OptionTypeError(f"dynashard: option 'sequence_parallel' is {value!r}; expected True or False.")
        if value and kwargs.get("inputs") == "per_rank":
            raise UsageError(
                "dynashard: sequence_parallel=True cuts the one replicated batch along its sequence; found "
                "inputs='per_rank', which already holds each rank's own rows between the TP regions. Expected "
                "one of them: drop sequence_parallel, or pass inputs='replicated'.")
        kwargs["sequence_parallel"] = value
    if "min_shard_numel" in raw:
        value = raw["min_shard_numel"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OptionTypeError(f"dynashard: option 'min_shard_numel' is {value!r}; expected an int >= 0.")
        kwargs["min_shard_numel"] = value
    if "check_inputs" in raw:
        kwargs["check_inputs"] = _check_choice("check_inputs", raw["check_inputs"], CHECKS)
    if raw.get("mode") is not None:  # (None: torch.compile's own default)
        kwargs["mode"] = _check_mode(raw["mode"], kwargs.get("compiler", "inductor"))
    return Options(**kwargs)


def with_mode(options: Options, mode: str | None) -> Options:
    """``options`` with the ``mode`` torch.compile passed to the backend (``torch.compile(..., mode=...)``)."""
    if mode is None or mode == options.mode:
        return options
    if options.mode != "default":
        raise UsageError(
            f"dynashard: mode {mode!r} passed to torch.compile, and mode {options.mode!r} bound in "
            "dynashard.backend(...). Expected one mode: pass it in one place.")
    return dataclasses.replace(options, mode=_check_mode(mode, options.compiler))


def _check_mode(mode: Any, compiler: str) -> str:
    """One of the modes torch.compile accepts (Inductor's own list); a warning where it has no effect."""
    modes = private.inductor_modes()
    if not isinstance(mode, str):
        raise OptionTypeError(f"dynashard: option 'mode' is a {type(mode).__name__}; expected one of {modes}.")
    if mode not in modes:
        raise UsageError(f"dynashard: mode is {mode!r}; expected one of {modes} (torch.compile's modes, which "
                         "configure Inductor).")
    if compiler != "inductor" and mode != "default":
        warnings.warn(
            f"dynashard: mode={mode!r} has no effect with compiler={compiler!r}: a mode configures Inductor. "
            "Expected compiler='inductor' (the default) or no mode.", UserWarning, stacklevel=4)
    return mode


def _check_group(group: Any) -> Any:
    if group is None:
        return None
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup) or group is dist.GroupMember.NON_GROUP_MEMBER:
        return group  # NON_GROUP_MEMBER: what new_group() returns on ranks outside it
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise UsageError(
                f"dynashard: option 'group' is a {group.ndim}-D DeviceMesh; expected a 1-D mesh "
                "(slice it, e.g. mesh['tp'])."
            )
        return group.get_group()
    raise OptionTypeError(
        f"dynashard: option 'group' is a {type(group).__name__}; expected a ProcessGroup or a 1-D DeviceMesh."
    )
