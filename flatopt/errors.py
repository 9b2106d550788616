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


class StateDictError(FlatoptError, ValueError):
    """An in-memory state dict does not fit the optimizer it is loaded into."""
