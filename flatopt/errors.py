"""Typed errors. Every one names the parameter path, group or file involved and what to do."""


class FlatoptError(Exception):
    """Base class of every error flatopt raises on purpose."""


class ParamError(FlatoptError, ValueError, TypeError):
    """Parameters given to an optimizer are unusable (dtype, duplicates, empty, tied, a set)."""


class HyperparameterError(FlatoptError, ValueError):
    """An unknown hyperparameter name or an invalid value, in the constructor or a group."""


class GroupAssignmentError(FlatoptError, ValueError):
    """Parameters matched no group pattern, or more than one."""


class GradientError(FlatoptError, ValueError):
    """A gradient with an unknown path, a wrong shape or a wrong dtype."""


class UnknownPathError(FlatoptError, KeyError):
    """A path (or key) that names no parameter of this optimizer. A ``KeyError`` too, so
    ``opt.params`` and ``opt.grads`` behave as mappings (``in``, ``.get``)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class UnknownGradientError(UnknownPathError, GradientError):
    """A gradient given or marked for a path that names no parameter."""


class ModeError(FlatoptError, RuntimeError):
    """A schedule-free optimizer was stepped in eval mode (its parameters hold the average
    ``x``, not the training point): call ``opt.train()`` first."""


class StepLimitError(FlatoptError, OverflowError):
    """A step would take a count past the largest flatopt keeps, saves and loads (2**53, a
    step count that float64 holds exactly): a parameter's or group's step count, or the
    draws of a reduced-precision buffer. Nothing was changed."""


class RuleDefinitionError(FlatoptError, TypeError):
    """A user-defined rule (:func:`flatopt.define_optimizer`, :func:`flatopt.chain`) cannot
    become an optimizer: a name that clashes, an update that Numba cannot compile or that gives
    NaN from finite inputs, a state slot it never writes, a hyperparameter nothing reads. The
    message names the rule and the function or name at fault. Raised when the rule is defined,
    before any optimizer or buffer exists."""


class StateDictError(FlatoptError, ValueError):
    """An in-memory state dict does not fit the optimizer it is loaded into."""


class DeviceError(FlatoptError, RuntimeError):
    """``device="cuda"`` cannot be used (what is missing and how to install it is named), or
    an array lives on another device than the optimizer's."""


class EnvironmentVariableError(FlatoptError, ValueError):
    """An environment variable flatopt reads (``FLATOPT_PARALLEL``) holds a value it does not
    know. Raised where the value would be used (a kernel call), not at import, so tools that
    never step (``flatopt inspect``, checkpoint reading) still run."""


class NonFiniteGradientWarning(UserWarning):
    """A NaN or infinite gradient reached a step that was not skipped, so the parameters it
    updates are NaN or infinite now (torch's semantics). Said once per optimizer; pass
    ``skip_nonfinite=True`` or ``error_if_nonfinite=True`` to ``step`` to act on it instead."""


class CheckpointError(FlatoptError):
    """A checkpoint could not be saved or loaded. ``path`` names the file (or None)."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class CheckpointOptionError(CheckpointError, ValueError, TypeError):
    """An option of ``save`` or ``load`` (``staging=``, ``strict=``, ``rename=`` ...) has a
    wrong type or value; it is checked before any file is touched."""


class CheckpointMismatch(CheckpointError, ValueError):
    """The checkpoint is sound but does not fit the optimizer it is loaded into.

    ``differences`` lists every difference found (a list of
    :class:`flatopt.checkpoint.Difference`), all collected before anything was changed;
    ``report()`` gives them as plain dicts. The message names each one and the option that
    would relax it.
    """

    def __init__(self, message: str, *, path: str | None = None, differences=()):
        super().__init__(message, path=path)
        self.differences = list(differences)

    def report(self) -> list[dict]:
        return [difference.to_dict() for difference in self.differences]


class CheckpointCorrupt(CheckpointError, ValueError):
    """The file is damaged, incomplete (an interrupted save) or hostile (external storage,
    links, virtual datasets, unknown filters, impossible sizes). ``buffer`` names the dataset
    when the damage was found in one."""

    def __init__(self, message: str, *, path: str | None = None, buffer: str | None = None):
        super().__init__(message, path=path)
        self.buffer = buffer


MAX_PROBLEM_LINES = 20


def raise_problems(problems: list[str], error: type[Exception]) -> None:
    """One error for every problem, its message cut to the first ``MAX_PROBLEM_LINES``
    (a 10,000-parameter model with one mistake repeated should not print 10,000 lines)."""
    if problems:
        shown = problems[:MAX_PROBLEM_LINES]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more problems like these")
        raise error("\n".join(shown))
