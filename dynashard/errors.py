"""The errors dynashard raises itself. Catch :class:`DynashardError` for all of them.

Each also subclasses the builtin users caught before these classes existed, so
``except ValueError`` / ``except RuntimeError`` keep working:

* :class:`UsageError` (``ValueError``): the model, options, plan or inputs cannot be sharded as
  asked; the message says what was expected, what was found and the fix. :class:`ShardNotHeldError`, one
  of them: eager code needed the values of a tensor dynashard sharded, which this rank does not hold.
* :class:`OptionTypeError` (``TypeError``): an option of the wrong type.
* :class:`SetupError` (``RuntimeError``): the process group is missing or was destroyed.
* :class:`PeerError` (``RuntimeError``): another rank failed, died, hangs or differs; raised on
  every rank that is still running.
* :class:`NotSupportedError` (``RuntimeError``): something dynashard does not do yet (a backward
  through a layout it cannot differentiate correctly); refused rather than done wrong.
* :class:`VerificationError` (``RuntimeError``): ``explain(verify=True)`` found the sharded
  computation differs from the model.
* :class:`InternalError` (``RuntimeError``): anything else that went wrong while planning,
  rewriting or compiling, wrapped with the stage (a bug: please report it).
"""

from __future__ import annotations


class DynashardError(Exception):
    """Base of every error dynashard raises itself."""


class UsageError(DynashardError, ValueError):
    pass


class ShardNotHeldError(UsageError):
    pass


class OptionTypeError(DynashardError, TypeError):
    pass


class SetupError(DynashardError, RuntimeError):
    pass


class PeerError(DynashardError, RuntimeError):
    pass


class NotSupportedError(DynashardError, RuntimeError):
    pass


class VerificationError(DynashardError, RuntimeError):
    pass


class InternalError(DynashardError, RuntimeError):
    pass
