"""The one typed options object, built from ``torch.compile(..., options={...})``.

Unknown keys and wrong types are rejected here, once, with the list of valid keys, so no
other module has to second-guess what it was given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

STYLES = ("colwise", "rowwise", "replicate")
COMPILERS = ("inductor", "aot_eager", "eager")
WEIGHTS = ("replicated", "rank0", "per_rank")
INPUTS = ("replicated", "per_rank")
CHECKS = ("shapes", "values", "off")


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated backend options; see the README's "Options" table for the meaning of each."""

    plan: str | tuple[tuple[str, str], ...] = "auto"
    group: Any = None  # ProcessGroup, 1-D DeviceMesh, or None for the world group
    compiler: str = "inductor"
    weights: str = "replicated"
    inputs: str = "replicated"
    # A weight with fewer elements than this stays replicated under plan="auto": below
    # 64K elements the collective it needs (tens of microseconds on gloo) costs about what
    # the halved matmul saves.
    min_shard_numel: int = 1 << 16
    # What every call compares across ranks before any collective (README, "Errors, agreement").
    check_inputs: str = "shapes"

    @property
    def plan_dict(self) -> dict[str, str] | None:
        return None if self.plan == "auto" else dict(self.plan)


def _style_name(value: Any, key: str) -> str:
    """Map a plan value (string, DTensor ParallelStyle object) to one of STYLES."""
    if isinstance(value, str):
        if value in STYLES:
            return value
        raise ValueError(
            f"dynashard: plan[{key!r}] is {value!r}; expected one of {list(STYLES)} "
            "(or a DTensor ColwiseParallel()/RowwiseParallel() object)."
        )
    # NOTE: imported lazily; torch.distributed may be absent from a CPU-only build.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(value, ColwiseParallel):
        return "colwise"
    if isinstance(value, RowwiseParallel):
        return "rowwise"
    raise TypeError(
        f"dynashard: plan[{key!r}] is a {type(value).__name__}; expected one of "
        f"{list(STYLES)} or a DTensor ColwiseParallel()/RowwiseParallel() object."
    )


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"dynashard: option {key!r} is {value!r}; expected one of {list(choices)}.")
    return value


def parse_options(raw: Mapping[str, Any] | Options | None) -> Options:
    """Validate user options into an :class:`Options`; raise with the valid keys on a bad one."""
    if isinstance(raw, Options):
        return raw
    raw = dict(raw or {})
    valid = [f.name for f in dataclasses.fields(Options)]
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ValueError(f"dynashard: unknown option(s) {unknown}; valid options are {valid}.")
    kwargs: dict[str, Any] = {}
    if "plan" in raw:
        plan = raw["plan"]
        if plan == "auto":
            kwargs["plan"] = "auto"
        elif isinstance(plan, Mapping):
            for k in plan:
                if not isinstance(k, str):
                    raise TypeError(f"dynashard: plan keys must be module FQN strings, found {k!r}.")
            kwargs["plan"] = tuple((k, _style_name(v, k)) for k, v in plan.items())
        else:
            raise TypeError(
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
        raise ValueError(
            "dynashard: weights='per_rank' (every rank its own model) needs inputs='per_rank' (every "
            "rank its own batch); found inputs='replicated'. Pass options={'inputs': 'per_rank', ...}."
        )
    if "min_shard_numel" in raw:
        value = raw["min_shard_numel"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"dynashard: option 'min_shard_numel' is {value!r}; expected an int >= 0.")
        kwargs["min_shard_numel"] = value
    if "check_inputs" in raw:
        kwargs["check_inputs"] = _check_choice("check_inputs", raw["check_inputs"], CHECKS)
    return Options(**kwargs)


def _check_group(group: Any) -> Any:
    if group is None:
        return None
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup) or group is dist.GroupMember.NON_GROUP_MEMBER:
        return group  # NON_GROUP_MEMBER: what new_group() returns on ranks outside it
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"dynashard: option 'group' is a {group.ndim}-D DeviceMesh; expected a 1-D mesh "
                "(slice it, e.g. mesh['tp'])."
            )
        return group.get_group()
    raise TypeError(
        f"dynashard: option 'group' is a {type(group).__name__}; expected a ProcessGroup or a 1-D DeviceMesh."
    )
