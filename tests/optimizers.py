"""The one list of optimizers under test, read from the registry, and the configurations the
generic tests draw for any of them (from each schema's example values)."""

from __future__ import annotations

import numpy as np

import flatopt
from flatopt import registry

NAMES = registry.names()


def schema_of(name: str) -> flatopt.Schema:
    return registry.lookup(name).schema


def random_settings(name: str, rng: np.random.Generator) -> dict:
    """Hyperparameters drawn from the schema's examples until they form a valid group."""
    schema = schema_of(name)
    for _ in range(1000):
        values = {key: hyper.examples[int(rng.integers(len(hyper.examples)))]
                  for key, hyper in schema.hyperparameters.items()}
        _, problems = schema.check_group(values, "test")
        if not problems:
            return values
    raise AssertionError(f"{name}: no valid configuration among the schema's examples")


def torch_keys(name: str) -> set[str]:
    """The hyperparameters torch.optim's class of ``name`` takes."""
    import inspect

    import torch
    return set(inspect.signature(getattr(torch.optim, schema_of(name).torch_name)).parameters)


def torch_settings(name: str, settings: dict) -> dict:
    """``settings`` with the hyperparameters torch.optim's class lacks (timm's ``caution``) at
    their defaults: a configuration torch runs too. Give torch :func:`torch_group` of it."""
    keys = torch_keys(name)
    schema = schema_of(name)
    return {key: value if key in keys else schema.hyperparameters[key].default
            for key, value in settings.items()}


def torch_group(name: str, settings: dict) -> dict:
    """``settings`` without the keys torch.optim's class does not take (torch would keep them
    in its groups unread)."""
    keys = torch_keys(name) | {"params", "label", "initial_lr"}
    return {key: value for key, value in settings.items() if key in keys}


def rich_settings(name: str, seed: int = 0) -> dict:
    """A valid configuration that uses every state slot (so every buffer gets exercised)."""
    schema = schema_of(name)
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(500):
        values = random_settings(name, rng)
        if best is None or len(schema.used_slots(values)) > len(schema.used_slots(best)):
            best = values
        if len(schema.used_slots(best)) == len(schema.slots):
            break
    return best


def fit_shape(name: str, shape: tuple) -> tuple:
    """``shape``, or a 2-D shape with the same elements when the optimizer takes only
    matrices (Muon): the generic tests' parameters, fitted to what a schema accepts."""
    schema = schema_of(name)
    if schema.param_problem is None or schema.param_problem(tuple(shape)) is None:
        return tuple(shape)
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else (shape[0] if shape
                                                                            else 1)
    fitted = (rows, shape[-1]) if len(shape) > 1 else (rows, 1)
    assert schema.param_problem(fitted) is None, (name, shape, fitted)
    return fitted


def fit_params(name: str, params: dict) -> dict:
    """The arrays of ``params`` reshaped by :func:`fit_shape` (same values, same order)."""
    return {path: np.ascontiguousarray(array).reshape(fit_shape(name, array.shape))
            for path, array in params.items()}


def build(name: str, groups, **kwargs):
    """The registered optimizer ``name`` over group dicts (or one params dict), each
    parameter fitted to the schema."""
    cls = registry.lookup(name)
    if isinstance(groups, dict) and "params" not in groups:
        return cls(fit_params(name, groups), **kwargs)
    return cls([{**group, "params": fit_params(name, dict(group["params"]))}
                for group in groups], **kwargs)
