"""What changed in a param group since it was last validated: at every step, a group whose
keys and value objects are the ones last validated is unchanged (no check at all), and a group
with changed values has only those checked again (``Schema.check_group(changes, base=...)``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import HyperparameterError
from .errors import raise_problems as _raise
from .schema import describe_group

_IMMUTABLE = (type(None), bool, int, float, str)


def _frozen(value: Any) -> Any:
    """A type-exact, immutable copy of a group value, to tell whether it changed since the
    last validation (a list mutated in place, or 0 replacing False, counts as a change); None
    for a value that cannot change in place (the same object is then the same value)."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return None
    if kind in (tuple, list):
        items = tuple(_frozen(item) for item in value)
        if kind is tuple and not any(items):
            return None
        return (kind, tuple((type(item), item) if frozen is None else frozen
                            for item, frozen in zip(value, items)))
    return (kind, id(value), repr(value))


class Validated:
    """A group as last validated: its keys, its value objects (and a frozen copy of each that
    can change in place) and the normalised values. At every step a group whose keys are the
    same and whose values are the same objects is this; otherwise only the values that changed
    are checked again (a scheduler's ``lr``: a few microseconds)."""

    __slots__ = ("keys", "objects", "mutable", "values")

    def __init__(self, group: Mapping[str, Any], values: dict[str, Any],
                 previous: "Validated | None" = None, changes: Mapping[str, Any] = ()):
        """``previous``, ``changes``: the record ``group`` differs from by ``changes`` only
        (its frozen copies of the other values are kept)."""
        self.keys = tuple(group)
        self.objects = tuple(group.values())
        self.mutable = {} if previous is None else dict(previous.mutable)
        for key, value in (group.items() if previous is None else changes.items()):
            frozen = _frozen(value)
            if frozen is None:
                self.mutable.pop(key, None)
            else:
                self.mutable[key] = frozen
        self.values = values

    def changes(self, group: Mapping[str, Any]) -> dict[str, Any] | None:
        """The keys of ``group`` whose values changed (empty: none did); None when keys were
        added or removed. ``params`` is compared by identity, like every value."""
        if len(group) != len(self.keys) or tuple(group) != self.keys:
            return None
        changed = {key: value for key, value, known
                   in zip(self.keys, group.values(), self.objects) if value is not known}
        for key, frozen in self.mutable.items():
            if key not in changed and _frozen(group[key]) != frozen:
                changed[key] = group[key]
        return changed


def validate_groups(schema, groups: Any, group_paths: list, validated_groups: list) -> list:
    """Every group's validated values (``Optimizer.settings``): an unchanged group's from its
    :class:`Validated` record in ``validated_groups``, a group with changed values checked for
    those (``Schema.check_group(changes, base=...)``), any other group checked whole (and its
    record replaced); groups removed, replaced or reordered (``group_paths``: each group's
    paths as built) are an error. Raises :class:`HyperparameterError` naming every
    problem."""
    if not isinstance(groups, list) or len(groups) != len(group_paths):
        count = len(groups) if isinstance(groups, list) else type(groups).__name__
        raise HyperparameterError(
            f"param_groups was changed from {len(group_paths)} groups to {count}; "
            "groups cannot be removed or replaced: use add_param_group() to add one, and "
            "set a group's lr to 0 (or leave its gradients missing) to freeze it")
    settings = []
    problems: list[str] = []
    for number, group in enumerate(groups):
        if not isinstance(group, dict):
            problems.append(f"param group {number} was replaced by a "
                            f"{type(group).__name__}; change values inside the group dict")
            continue
        validated = validated_groups[number]
        changes = None if validated is None else validated.changes(group)
        if changes == {}:
            settings.append(validated.values)
            continue
        if changes is not None and "params" not in changes:  # values changed: those only
            values, value_problems = schema.check_group(changes, "", base=validated.values)
            if not value_problems:
                settings.append(values)
                validated_groups[number] = Validated(group, values, validated, changes)
                continue
        where = describe_group(number, group)
        if group.get("params") is not group_paths[number]:
            problems.append(f"{where}: 'params' was changed or the groups were reordered; "
                            "groups keep their parameters: use add_param_group() to add "
                            "parameters")
        values, value_problems = schema.check_group(group, where)
        problems += value_problems
        settings.append(values)
        if not value_problems:
            validated_groups[number] = Validated(group, values)
    _raise(problems, HyperparameterError)
    return settings
