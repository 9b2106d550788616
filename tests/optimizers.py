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
