"""The registry of optimizers: name -> class (and with it its schema and schema version).

Checkpoints, state dicts, the CLI, the tests and the benchmark find optimizers here; nothing
else lists them. An optimizer module registers its class with :func:`register` (a decorator),
which checks that the schema and the kernel rule agree, so a missed edit fails at import.
"""

from __future__ import annotations

from typing import Iterator

from .schema import Schema

_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Add an optimizer class (with a ``schema``) under ``cls.schema.name``; returns ``cls``."""
    schema: Schema = getattr(cls, "schema", None)
    if not isinstance(schema, Schema):
        raise TypeError(f"{cls.__name__} has no flatopt Schema in its 'schema' attribute")
    problems = schema_problems(schema)
    if problems:
        raise TypeError(f"optimizer {schema.name!r} cannot be registered: " + "; ".join(problems))
    existing = _REGISTRY.get(schema.name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"an optimizer named {schema.name!r} is already registered "
                         f"({existing.__module__}.{existing.__qualname__})")
    _REGISTRY[schema.name] = cls
    return cls


def schema_problems(schema: Schema) -> list[str]:
    """Disagreements between a schema, its kernel rule and its state record."""
    rule = schema.rule
    problems = []
    if tuple(schema.slots) != rule.slots:
        problems.append(f"schema slots {tuple(schema.slots)} differ from the rule's {rule.slots}")
    for name, column in schema.columns.items():
        if rule.columns.get(name) != column.dtype:
            problems.append(f"column {name!r} is {column.dtype} in the schema but "
                            f"{rule.columns.get(name)!r} in the rule")
    fields = tuple(getattr(schema.record, "_fields", ()))
    expected = (*schema.state_dict_columns, *schema.slots)
    if set(fields) != set(expected):
        problems.append(f"state record fields {fields} should be {expected}")
    for name, hyper in schema.hyperparameters.items():
        if not hyper.examples:
            problems.append(f"hyperparameter {name!r} has no example values for tests")
    return problems


def lookup(name: str) -> type | None:
    """The optimizer class registered as ``name``, or None."""
    return _REGISTRY.get(name)


def names() -> list[str]:
    return list(_REGISTRY)


def optimizers() -> Iterator[type]:
    return iter(list(_REGISTRY.values()))


def unregister(name: str) -> None:
    """Remove ``name`` (for tests that register a throwaway optimizer)."""
    _REGISTRY.pop(name, None)
