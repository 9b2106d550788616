"""The one list of optimizers under test, read from the registry; the test facts of each
(:class:`OptimizerInfo`, as torch's ``OptimizerInfo``/``optim_db``: the generic tests ask these
instead of testing names); and the configurations the generic tests draw for any of them (from
each schema's example values)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import flatopt
from flatopt import registry

NAMES = registry.names()


# ----------------------------------------------------------------------------- test facts
FLOAT32, FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)
# shapes whose element count is a multiple of torch's fused CPU kernel's vector width (16): it
# computes the last (size mod 16) elements of each chunk without fused multiply-adds
FUSED_SHAPES = ((16,), (4, 32), (64, 64), (3, 16, 16))


@dataclasses.dataclass(frozen=True)
class BitExact:
    """flatopt's steps equal torch's bit for bit (parameters and state, whole runs without
    re-synchronising): ``torch_options`` select the torch implementation that is the oracle
    (``{"foreach": False}``: the single-tensor path), for ``dtypes`` and ``shapes`` (None: every
    shape the conformance test draws)."""

    torch_options: dict
    dtypes: tuple = (FLOAT32, FLOAT64)
    shapes: tuple | None = None
    why: str = ""

    @property
    def single_tensor(self) -> bool:
        """torch's default single-tensor path is the oracle (not a fused kernel)."""
        return self.torch_options == {"foreach": False}


@dataclasses.dataclass(frozen=True)
class OptimizerInfo:
    """What the generic tests need to know about one registered optimizer. Everything the
    schema says is derived from it (:func:`info`); the rest is written in :data:`EXPLICIT`,
    with defaults that fit a new optimizer, so a new registry entry is tested without one."""

    name: str
    torch: str | None
    """The torch.optim class the conformance tests compare with (``Schema.torch_name``); None:
    the NumPy reference (tests/reference.py) is its only oracle."""
    torch_refuses_empty: str | None
    """Why torch's class fails on a zero-size parameter (which flatopt leaves alone): torch is
    not given such parameters. None: torch takes them."""
    bit_exact: BitExact | None
    """Where flatopt's steps equal torch's bit for bit; None: within :attr:`tolerance`."""
    tolerance: dict
    """dtype -> (rtol, atol) against torch and the NumPy reference (float64 over a whole run;
    float32 per step, each from the same state)."""
    has_state: bool
    """Per-parameter state (slots or state-dict columns): False for a stateless rule, whose
    cold start is a correct resume (it is not asked to differ from one)."""
    eager_state: bool
    """State from construction (Adagrad): a never-stepped parameter has state, step 0."""
    matrices_only: bool
    """The schema refuses some shapes (Muon: 2-D only): generic tests reshape parameters with
    :func:`fit_shape`, and leave out those with no 2-D form."""
    per_matrix_update: bool
    """The update is NumPy code per matrix (``Rule.per_parameter``): no element step kernel."""
    train_eval: bool
    """The optimizer has ``train()``/``eval()`` (schedule-free): a step needs train mode."""
    group_state: tuple
    """Group values that are state (counters kept in ``param_groups``), restored by loads."""
    cautious: bool
    """It takes ``caution`` (timm's cautious update)."""
    checkpoint_settings: dict | None
    """The settings :func:`checkpoint_helpers.make_opt` builds it with (None: a configuration
    from the schema's examples that uses every state slot, :func:`rich_settings`)."""
    every_slot: dict
    """Settings added to ``checkpoint_settings`` so that every state slot is used (Adam's
    ``amsgrad``): the checkpoint tests over every optimizer save every slot."""
    skips: dict
    """test function name -> why that generic test does not apply (see :func:`cases`)."""


EXPLICIT: dict[str, dict[str, Any]] = {
    # bits: torch's single-tensor path, every option and shape
    "SGD": dict(bit_exact=BitExact({"foreach": False}), every_slot={},
                checkpoint_settings={"lr": 0.1, "momentum": 0.9}),
    "Adamax": dict(bit_exact=BitExact({"foreach": False})),
    "Rprop": dict(bit_exact=BitExact({"foreach": False})),
    "ASGD": dict(bit_exact=BitExact(
        {"foreach": False}, dtypes=(FLOAT64,),
        why="torch keeps eta and mu as 0-d tensors of its default dtype and steps with them "
            "rounded to it (float32 by default), where flatopt keeps them in float64")),
    # torch's single-tensor Adam takes a float32 sqrt that is not correctly rounded (1 ULP on
    # ~16% of elements, see docs/guide/semantics.md): its fused CPU kernel, on one thread, is
    # the oracle
    "Adam": dict(bit_exact=BitExact({"fused": True}, shapes=FUSED_SHAPES,
                                    why="torch's fused CPU kernel (correctly rounded sqrt)"),
                 checkpoint_settings={"lr": 0.01}, every_slot={"amsgrad": True}),
    "AdamW": dict(bit_exact=BitExact({"fused": True}, shapes=FUSED_SHAPES,
                                     why="torch's fused CPU kernel (correctly rounded sqrt)"),
                  checkpoint_settings={"lr": 0.01}, every_slot={"amsgrad": True}),
    "Adafactor": dict(torch_refuses_empty="ZeroDivisionError: ||p|| / sqrt(numel) with numel 0"),
    # torch.optim.Muon exists, but runs Newton-Schulz in bfloat16 where flatopt keeps the
    # parameter's dtype: no conformance oracle (Schema.torch_name is None)
    "Muon": dict(skips={"test_matches_torch_optim":
                        "torch.optim.Muon computes in bfloat16: compared within bfloat16 precision "
                        "in tests/test_rules_extra.py; its NumPy reference covers it"}),
}
"""Facts the schema cannot tell, by registry name (the keys of :class:`OptimizerInfo`)."""

DEFAULT_TOLERANCE = {FLOAT32: (1e-5, 1e-6), FLOAT64: (1e-12, 1e-15)}


def info(name: str) -> OptimizerInfo:
    """The test facts of the registered optimizer ``name``: derived from its schema and class,
    then :data:`EXPLICIT`'s entries (any registered optimizer has facts, a plugin's too)."""
    cls = registry.lookup(name)
    if cls is None:
        raise LookupError(f"{name!r} is not a registered optimizer")
    schema = cls.schema
    per_matrix = schema.rule.per_parameter is not None
    derived = dict(
        name=name, torch=schema.torch_name, torch_refuses_empty=None, bit_exact=None,
        tolerance=DEFAULT_TOLERANCE,
        has_state=bool(schema.slots or schema.state_dict_columns), eager_state=schema.eager,
        matrices_only=schema.param_problem is not None, per_matrix_update=per_matrix,
        train_eval=callable(getattr(cls, "train", None)) and callable(getattr(cls, "eval", None)),
        group_state=tuple(schema.group_state), cautious="caution" in schema.hyperparameters,
        checkpoint_settings=None, every_slot={}, skips={})
    explicit = EXPLICIT.get(name, {})
    unknown = set(explicit) - set(derived)
    assert not unknown, f"EXPLICIT[{name!r}]: no such fact {sorted(unknown)}"
    facts = {**derived, **explicit}
    skips = dict(facts["skips"])
    if facts["torch"] is None:
        skips.setdefault("test_matches_torch_optim",
                         f"{name} has no torch.optim counterpart (its NumPy reference covers it)")
    if per_matrix:
        skips.setdefault("test_float32_kernels_stay_in_float32",
                         f"{name}'s update is NumPy code per matrix: no element kernel to inspect")
    facts["skips"] = skips
    return OptimizerInfo(**facts)


INFO: dict[str, OptimizerInfo] = {name: info(name) for name in NAMES}
"""Registry name -> its test facts, for every registered optimizer."""


def kind_of(facts: OptimizerInfo) -> tuple:
    """What sets an optimizer's code paths apart in the generic tests: optimizers of one kind
    exercise the same machinery (an element rule; one with a per-parameter reduction first, as
    LAMB's trust ratio or ``caution``; a per-matrix update; matrices only; group state; global
    reductions; eager state; ``train()``/``eval()``)."""
    rule = registry.lookup(facts.name).schema.rule
    return (rule.reduce is not None, facts.per_matrix_update, facts.matrices_only,
            bool(facts.group_state), rule.global_reductions, facts.eager_state,
            facts.train_eval)


def representatives(names=None) -> list[str]:
    """The first optimizer of each kind (:func:`kind_of`) among ``names`` (default: every
    registered one): what the fast loop (``pytest -m "not slow"``) runs of a heavy test over
    every optimizer. A new optimizer of a new kind is a representative by itself."""
    seen, chosen = set(), []
    for name in NAMES if names is None else names:
        kind = kind_of(info(name))
        if kind not in seen:
            seen.add(kind)
            chosen.append(name)
    return chosen


def cases(test: str, names=None, *, slow_beyond_representatives: bool | int = False) -> list:
    """``names`` (default: every registered optimizer) as pytest parameters: those whose facts
    skip ``test`` marked skipped with the reason (torch's ``DecorateInfo``); with
    ``slow_beyond_representatives``, all but :func:`representatives` (an int: the first that
    many of them, for the heaviest tests) marked ``slow``."""
    names = list(NAMES if names is None else names)
    keep = slow_beyond_representatives
    fast = set(names) if keep is False else set(
        representatives(names)[:None if keep is True else keep])
    result = []
    for name in names:
        reason = info(name).skips.get(test)
        marks = ([pytest.mark.skip(reason=reason)] if reason else []) + \
            ([] if name in fast else [pytest.mark.slow])
        result.append(pytest.param(name, marks=marks) if marks else name)
    return result


def slow_beyond(values, keep: int = 1) -> list:
    """Parametrization ``values``, the first ``keep`` as they are and the rest marked ``slow``
    (the fast loop runs the first seed, dtype or scenario of a heavy test)."""
    values = list(values)
    return values[:keep] + [pytest.param(*(v if isinstance(v, tuple) else (v,)),
                                         marks=pytest.mark.slow) for v in values[keep:]]


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
