"""Every CUDA kernel flatopt can launch, with the argument types it launches it with.

Found by running flatopt, not from a list: every registered optimizer (``flatopt.registry``)
with its parameters in each dtype the flat buffers take (``flatopt._layout.SUPPORTED_DTYPES``)
and, where its schema has a coded form, in every storage layout the settings of
``flatopt/_storage.py`` give (16-bit parameters, ``HALF_NAMES``, with each of ``ROUNDINGS``
or master weights, float32 gradients, each of ``STATE_DTYPES``; the combinations it refuses
left out), with its default settings and with each of its flags turned; each on
``device="cuda"`` with ``bit_exact`` off and on, and on the CUDA backend over host arrays (the
simulator tests' path, which launches the rule's prepare on the device), through everything
that touches the device (:func:`exercise`): steps (plain, and with a gradient scale and a clip:
the gradient totals and the walk's scaling), accumulation, zeroing, scaling and clipping
outside the step, a parameter written, an EMA's update and swap, ``train()``/``eval()``.

All of it runs in Numba's CUDA simulator with :func:`flatopt.kernels.cuda_launch.recording`
on: every launch is recorded (the kernel's name, the call that makes it, the block size and the
Numba types of its arguments) and none runs, so the enumeration needs no GPU and the tiny
buffers it steps cost nothing. A new rule, storage setting or device kernel is covered with no
list to edit. ``bench/cuda_static.py`` compiles what it finds.

Lookahead and ZeRO-1 sharding refuse ``device="cuda"`` (their passes are host kernels), so they
launch nothing on the device and have no kernel here.
"""

from __future__ import annotations

import itertools
import os
import warnings
from typing import NamedTuple

import numpy as np

import flatopt
from flatopt import _layout, _storage
from flatopt.errors import HyperparameterError
from flatopt.kernels._cuda_import import simulated
from flatopt.kernels.cuda_launch import recording

FAMILIES = ("step", "step, float64", "reduce", "reduce, float64", "finalize", "prepare",
            "coded step", "coded 8-bit block step",
            "coded reduce", "gradient totals", "gradient totals (16-bit)", "scaling",
            "scaling (16-bit)", "accumulation", "accumulation (16-bit)", "fill", "EMA lerp",
            "EMA decode (16-bit)", "EMA encode (16-bit)", "state map")
"""The kernel families, in the order the tables print them."""


class Scenario(NamedTuple):
    """One optimizer configuration the enumeration runs."""

    optimizer: str
    dtype: str
    """The parameters' dtype name."""
    storage: tuple = ()
    """Storage keywords, as sorted (key, value) pairs."""
    settings: tuple = ()
    """Hyperparameters that differ from the defaults, as sorted (key, value) pairs."""

    @property
    def label(self) -> str:
        extra = [f"{k}={v}" for k, v in (*self.storage, *self.settings)]
        return " ".join([self.optimizer, self.dtype, *extra])


class Found(NamedTuple):
    """A kernel compiled for one argument signature, and what launches it."""

    launch: object
    """The first ``cuda_launch.Launch`` recorded for it."""
    family: str
    scenarios: tuple


# ----------------------------------------------------------------------------- scenarios
def _flag_settings(schema) -> list[tuple]:
    """The defaults with each flag turned (made valid from the schema's examples where the
    other defaults do not allow it); the defaults first."""
    found = [()]
    rng = np.random.default_rng(0)
    defaults = {key: hyper.default for key, hyper in schema.hyperparameters.items()}
    for key, hyper in schema.hyperparameters.items():
        if not hyper.is_flag or hyper.state:
            continue
        values = {**defaults, key: not hyper.default}
        for _ in range(200):
            if not schema.check_group(values, "cuda_launches")[1]:
                found.append(tuple(sorted((k, v) for k, v in values.items()
                                          if v != defaults[k])))
                break
            values = {k: h.examples[int(rng.integers(len(h.examples)))] if h.examples
                      else h.default for k, h in schema.hyperparameters.items()}
            values[key] = not hyper.default
    return found


def _storages(schema) -> list[tuple[str, tuple]]:
    """(parameter dtype, storage keywords) of every coded layout the schema allows."""
    if _storage.rule_problem(schema, _storage.Storage(master_weights=True)) is not None:
        return []
    modes = [{"rounding": r} for r in _storage.ROUNDINGS] + [{"master_weights": True}]
    found = []
    for dtype in (*map(_storage.numpy_dtype, _storage.HALF_NAMES), _storage.FLOAT32):
        for mode, state, grad in itertools.product(modes, (None, *_storage.STATE_DTYPES),
                                                   (None, "float32")):
            keywords = {**mode, "state_dtype": state, "grad_dtype": grad}
            try:
                storage = _storage.checked(schema, keywords, _storage.Storage(), "enumeration")
                resolved = _storage.resolve(storage, dtype, 1 << 20, "enumeration")
            except (_storage.StorageProblem, HyperparameterError):
                continue
            half_only = storage.master_weights or storage.rounding != "nearest" or grad
            if resolved.plain or (half_only and not _storage.is_half(dtype)):
                continue
            found.append((_storage.dtype_name(dtype), tuple(sorted(
                (k, v) for k, v in storage.as_dict().items() if v != getattr(
                    _storage.Storage(), k)))))
    return found


def covering(layouts: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """The first of ``layouts`` that together hold every parameter dtype and every storage
    setting's every value among them."""
    chosen, seen = [], set()
    for dtype, storage in layouts:
        new = {("dtype", dtype), *storage} - seen
        if new:
            chosen.append((dtype, storage))
            seen |= new
    return chosen


def scenarios(names=None, complete: bool = True) -> list[Scenario]:
    """The configurations the enumeration runs (``names``: the optimizers, by default every
    registered one): each flag setting in each dtype and each storage layout; not
    ``complete``: each flag setting in each dtype and in one storage layout, and the default
    settings in layouts that hold every storage setting's every value (which launches the
    same kernels: the coded walks take the formats at run time)."""
    found = []
    for name in flatopt.registry.names() if names is None else names:
        schema = flatopt.registry.lookup(name).schema
        plain = [(np.dtype(dtype).name, ()) for dtype in _layout.SUPPORTED_DTYPES]
        coded = _storages(schema) if complete else covering(_storages(schema))
        for n, settings in enumerate(_flag_settings(schema)):
            for dtype, storage in plain + (coded if complete or not n else coded[:1]):
                found.append(Scenario(name, dtype, storage, settings))
    return found


def representatives() -> list[str]:
    """The first registered optimizer of each kind of rule (a reduce pass with a finalize
    or with global totals, int8 state, ``train()``/``eval()``, an update over whole
    matrices): the fast tests' set, which launches a kernel of every family in every storage
    layout and dtype."""
    kinds = {
        "finalize": lambda cls: cls.schema.rule.finalize is not None,
        "global totals": lambda cls: cls.schema.rule.global_reductions,
        "int8 state": lambda cls: cls.schema.int8_state,
        "train/eval": lambda cls: callable(getattr(cls, "train", None)),
        "whole matrices": lambda cls: cls.schema.rule.per_parameter is not None}
    chosen = []
    for has in kinds.values():
        name = next(n for n in flatopt.registry.names() if has(flatopt.registry.lookup(n)))
        if name not in chosen:
            chosen.append(name)
    return chosen


# ----------------------------------------------------------------------------- running
SHAPES = {"w": (64, 64), "b": (10,), "e": (0,)}
"""4,096 elements (int8 state keeps float32 below it), a vector and an empty one."""
HOST_SHAPES = {"w": (3, 4), "b": (3,)}
"""Over host arrays the kernels run (the simulator is slow): few elements."""


def _parameters(schema, dtype: str, rng, shapes: dict) -> dict:
    shapes = {k: s for k, s in shapes.items()
              if schema.param_problem is None or schema.param_problem(s) is None}
    return {k: rng.standard_normal(s).astype(_storage.numpy_dtype(dtype))
            for k, s in shapes.items()}


LOOSE = 1e30
"""A clipping norm no gradient here reaches: the totals are taken, the bits left as they are
(so a GPU's run compares bit for bit with the CPU's, whatever order its totals add in)."""


def _grads(scenario: Scenario, params: dict) -> dict:
    grad_dtype = dict(scenario.storage).get("grad_dtype")
    return {k: v.astype(grad_dtype or v.dtype) for k, v in params.items()}


def exercise(scenario: Scenario, device: str = "cuda", bit_exact: bool = False,
             shapes: dict = SHAPES):
    """Everything ``scenario``'s optimizer does on ``device``; returns (optimizer, EMA):
    steps (plain, with a gradient scale, with the clipping and non-finite checks that take
    the gradient totals), accumulation, scaling and clipping outside the step, zeroing, a
    parameter written, an EMA's update and swap, ``eval()`` and ``train()``."""
    cls = flatopt.registry.lookup(scenario.optimizer)
    params = _parameters(cls.schema, scenario.dtype, np.random.default_rng(0), shapes)
    exact = {"bit_exact": bit_exact} if device == "cuda" else {}
    opt = cls(params, device=device, **exact, **dict(scenario.storage),
              **dict(scenario.settings))
    grads = _grads(scenario, params)
    opt.step(grads)
    opt.step(grads, grad_scale=2.0, max_grad_norm=LOOSE, norm_type=3.0)
    opt.step(grads, max_grad_norm=LOOSE, norm_type=float("inf"), skip_nonfinite=True)
    opt.grads.add(grads)
    flatopt.scale_gradients(opt, 0.5)
    flatopt.clip_grad_norm(opt, LOOSE)
    opt.zero_grad(set_to_none=False)
    opt.params["w"] = params["w"]
    ema = flatopt.EMA(opt, decay=0.9)
    ema.update()
    with ema.swapped():
        pass
    if callable(getattr(cls, "train", None)) and callable(getattr(cls, "eval", None)):
        opt.eval()
        opt.train()
    return opt, ema


def exercise_host(scenario: Scenario) -> None:
    """One step over host arrays with the CUDA backend (the simulator tests' path: the rule's
    prepare runs on the device); its kernels run (the host reads what prepare writes)."""
    cls = flatopt.registry.lookup(scenario.optimizer)
    params = _parameters(cls.schema, scenario.dtype, np.random.default_rng(0), HOST_SHAPES)
    opt = cls(params, **dict(scenario.storage), **dict(scenario.settings))
    opt._set_backend("cuda")
    opt.step(_grads(scenario, params))


def family(launch, rules: set) -> str:
    """The family of a recorded launch, from its kernel's name and source (``rules``: the ids
    of the registered optimizers' rules)."""
    name = launch.kernel
    if name.startswith("half_"):
        return {"add": "accumulation (16-bit)", "decode": "EMA decode (16-bit)",
                "encode": "EMA encode (16-bit)"}[name.split("_")[1]]
    named = {"lerp_kernel": "EMA lerp", "fill_kernel": "fill", "add_kernel": "accumulation"}
    if name.split("_flatoptnofma")[0] in named:
        return named[name.split("_flatoptnofma")[0]]
    if name.startswith("reduce_gradients_kernel"):  # (then the walk's fingerprint)
        return "gradient totals"
    if name.startswith("reduce_half_gradients"):
        return "gradient totals (16-bit)"
    rule = launch.source.arguments[0]
    if id(rule) not in rules:  # a tool rule: the walk's scaling alone, or a map over the state
        scaling = not rule.slots
        if name.startswith("coded_"):
            return "scaling (16-bit)"
        return "scaling" if scaling else "state map"
    for prefix, label in (("coded_step", "coded step"), ("coded_block", "coded 8-bit block step"),
                          ("coded_reduce", "coded reduce"), ("prepare", "prepare"),
                          ("finalize", "finalize"), ("reduce", "reduce"), ("step", "step"),
                          ("wide_reduce", "reduce, float64"), ("wide_step", "step, float64")):
        if name.startswith(prefix):
            return label
    raise ValueError(f"kernel {name!r} belongs to no family")


def enumerate_launches(names=None, progress=None) -> dict[tuple, Found]:
    """(kernel name, argument types) -> :class:`Found`, over every scenario, in Numba's CUDA
    simulator (``NUMBA_ENABLE_CUDASIM=1`` must be set before Numba is imported)."""
    if not simulated():
        raise RuntimeError("the enumeration runs in Numba's CUDA simulator: set "
                           "NUMBA_ENABLE_CUDASIM=1 before importing numba")
    rules = {id(flatopt.registry.lookup(n).schema.rule) for n in flatopt.registry.names()}
    found: dict[tuple, Found] = {}
    for scenario in scenarios(names):
        # over host arrays only the prepare kernel is new, and its arguments' types depend
        # on the dtype alone
        plain = not scenario.storage and not scenario.settings
        for bit_exact, host in ((False, False), (True, False), (False, True))[:3 if plain
                                                                             else 2]:
            with warnings.catch_warnings(), recording(run=host) as launched:
                warnings.simplefilter("ignore")  # no kernel runs: totals read back are zeros
                if host:
                    exercise_host(scenario)
                else:
                    exercise(scenario, "cuda", bit_exact)
            for launch in launched:
                key = (launch.kernel, launch.types)
                entry = found.get(key)
                if entry is None:
                    entry = Found(launch, family(launch, rules), ())
                if scenario.label not in entry.scenarios:
                    entry = entry._replace(scenarios=(*entry.scenarios, scenario.label))
                found[key] = entry
        if progress:
            progress(scenario, len(found))
    return found


def main() -> None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    found = enumerate_launches(progress=lambda s, n: print(f"{s.label}: {n}", flush=True))
    counts: dict[str, int] = {}
    for entry in found.values():
        counts[entry.family] = counts.get(entry.family, 0) + 1
    for name in FAMILIES:
        print(f"{name:28s} {counts.get(name, 0)}")
    print(f"{'all':28s} {len(found)}")


if __name__ == "__main__":
    main()
