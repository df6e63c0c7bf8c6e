"""A model compiled with ``torch.compile(model, backend="dynashard")``, then run around the compiled call.

``torch.compile(model)`` returns an ``OptimizedModule`` that compiles its own ``__call__`` only. Code
reaching the wrapped module another way (nanoGPT's ``model.generate(...)``: the wrapper forwards the
attribute to the module, whose ``self(idx)`` then runs eagerly) runs unsharded, every rank computing
the whole model, and nothing fails. This notices it: when an ``OptimizedModule`` compiling with dynashard
wraps a module (a module registration hook sees it registered as ``_orig_mod``), a forward pre-hook on
that module looks at each call; the first one outside the wrapper's call warns once, naming the fixes.
Modules compiled with another backend get no hook.

Invariants: never an error (the eager run is correct, only not sharded); one warning per wrapper.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from dynashard import _torch as private

_HOOK: Any = None


def watch(is_dynashard: Callable[[Any], bool]) -> None:
    """Install the registration hook once per process (the backend's import does); ``is_dynashard(backend)``
    tells a torch.compile backend of dynashard's from any other."""
    global _HOOK
    if _HOOK is None:
        _HOOK = torch.nn.modules.module.register_module_module_registration_hook(
            functools.partial(_on_register, is_dynashard))
        private.never_a_frame_of_its_own(_FirstEagerCall.__call__)


def _on_register(is_dynashard: Callable[[Any], bool], parent: torch.nn.Module, name: str, child: Any) -> None:
    if isinstance(child, torch.nn.Module) and is_dynashard(private.backend_wrapping(parent, name)):
        hook = _FirstEagerCall(weakref.ref(parent))
        child.register_forward_pre_hook(hook)


class _FirstEagerCall:
    """The forward pre-hook: the first call outside the wrapper's call warns. A
    copy or a pickle of the module (``copy.deepcopy``, ``torch.save(model)``) gets an inert hook:
    the copy is wrapped by no compiled module."""

    def __init__(self, compiled: weakref.ref) -> None:
        self.compiled, self.warned = compiled, False

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if private.compiling():  # (first: Dynamo, tracing the wrapper's call, folds it and stops here,
            return                         # so the hook adds no graph break, fullgraph=True included)
        if self.warned or private.in_compiled_module_call():
            return
        if hasattr(module.__dict__.get("forward"), "_dynashard_parallelized"):
            return  # (dynashard.parallelize's model: its plain calls run sharded)
        self.warned = True  # (a flag, not the handle's removal: Dynamo guards on the module's hooks)
        if self.compiled() is None:
            return
        warnings.warn(
            f"dynashard: {type(module).__name__}.forward ran eagerly, around the module torch.compile(..., "
            "backend='dynashard') returned (an attribute such as model.generate reaches the wrapped model, whose "
            "own calls are not compiled): this run is not sharded, every rank computes the whole model. Expected "
            "the forward itself compiled: model.forward = torch.compile(model.forward, backend='dynashard') "
            "before calling model.generate, or dynashard.parallelize(model, example_inputs) first.",
            UserWarning, stacklevel=1)

    def __reduce__(self) -> tuple:
        return _inert, ()


def _inert() -> Any:
    return _no_check


def _no_check(module: torch.nn.Module, args: Any) -> None:
    return None

