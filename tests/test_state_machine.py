"""A stateful model-based test of the public surface (hypothesis' ``RuleBasedStateMachine``).

Two kits are built alike: an optimizer of one registered rule and storage mode, with a
scheduler, an EMA, a GradScaler, a plain SGD beside it (for runs of several optimizers) and a
Lookahead where the rule takes one. The *twin* only ever steps (serially, one thread); the
*kit under test* gets the same operations under any thread count and parallel policy, and
between them every way of leaving and coming back: checkpoint files (foreground and
background), runs, state dicts, ``convert=True``, renamed paths, ``strict=False`` into an
optimizer with a group more, and refused operations of every kind.

Invariants after every rule: the kit's bits (parameters, every state dict: optimizer,
scheduler, EMA, scaler, Lookahead, the SGD beside it) equal the twin's; whatever save wrote,
``verify`` calls sound and load accepts; a refused call raises a typed ``FlatoptError`` and
leaves every byte and counter as it was (and a refused save leaves the file it would have
replaced).

Budgets: the fast loop runs a few (rule, storage) configurations with a small budget; ``slow``
runs every registered rule in float32 and every storage mode over the rules that take it.
The seed is fixed (``derandomize``) so CI is repeatable; ``FLATOPT_STATEFUL_RANDOM=1`` draws
new examples, ``FLATOPT_STATEFUL_EXAMPLES`` / ``FLATOPT_STATEFUL_STEPS`` set the budget, and
``FLATOPT_STATEFUL_SHRINK=1`` shrinks a failure to its shortest sequence (minutes: off in CI).
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import ml_dtypes
import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

import flatopt
from flatopt import registry
from flatopt.checkpoint import run as run_mod, verify_checkpoint
from flatopt.errors import FlatoptError
import examples_plugin
from optimizers import NAMES, fit_shape, info, random_settings

BF16 = np.dtype(ml_dtypes.bfloat16)
F32, F64 = np.dtype(np.float32), np.dtype(np.float64)

# storage mode -> (dtype of group 0's parameters, group 0's storage keys, optimizer keywords);
# group 1 is plain float32 or float64
STORAGES = {
    "float32": (F32, {}, {}),
    "bf16_nearest": (BF16, {}, {}),
    "bf16_stochastic": (BF16, {"rounding": "stochastic"}, {"seed": 11}),
    "bf16_kahan": (BF16, {"rounding": "kahan"}, {}),
    "bf16_master": (BF16, {"master_weights": True, "grad_dtype": "float32"}, {}),
    "bf16_state": (F32, {"state_dtype": "bfloat16"}, {"seed": 5}),
    "int8_state": (F32, {"state_dtype": "int8"}, {}),
}
SCHEDULERS = ("step", "cosine")
RANDOM = os.environ.get("FLATOPT_STATEFUL_RANDOM") == "1"
SHRINK = os.environ.get("FLATOPT_STATEFUL_SHRINK") == "1"


def accepts(name: str, storage: str) -> bool:
    """Whether the rule takes the storage mode (a refusal at construction is by design)."""
    dtype, keys, options = STORAGES[storage]
    rng = np.random.default_rng(0)
    shape = fit_shape(name, (64, 64))
    try:
        registry.lookup(name)([{"params": {"w": np.zeros(shape, dtype)},
                                **random_settings(name, rng), **keys}], **options)
    except FlatoptError:
        return False
    return True


def configurations() -> list:
    """(rule, storage) pairs: the fast loop's few, then the rest marked slow."""
    fast = {("AdamW", "bf16_stochastic"), ("SGD", "float32"), ("Lion", "int8_state"),
            ("ScheduleFreeAdamW", "float32")}
    result = []
    for name in NAMES:
        for storage in STORAGES:
            if storage != "float32" and not accepts(name, storage):
                continue
            marks = [] if (name, storage) in fast else [pytest.mark.slow]
            result.append(pytest.param(name, storage, marks=marks, id=f"{name}-{storage}"))
    # the rules of examples/, written with the public API (registered while their test runs)
    for name, storage, marks in (("AdaBelief", "float32", []),
                                 ("Adan", "float32", [pytest.mark.slow]),
                                 ("AdaBelief", "bf16_master", [pytest.mark.slow]),
                                 ("Adan", "bf16_state", [pytest.mark.slow]),
                                 ("Lamb", "float32", []),
                                 ("Lamb", "bf16_stochastic", [pytest.mark.slow]),
                                 ("AdaGradNorm", "float32", []),
                                 ("AdaGradNorm", "bf16_master", [pytest.mark.slow]),
                                 ("SFSGD", "float32", []),
                                 ("BlocksAdamW", "float32", [pytest.mark.slow]),
                                 ("BlocksAdamW", "bf16_stochastic", [pytest.mark.slow])):
        result.append(pytest.param(name, storage, marks=marks, id=f"{name}-{storage}"))
    return result


# ----------------------------------------------------------------------------- kits
def shapes_for(name: str, storage: str, rng) -> list[list[tuple]]:
    """Parameter shapes per group: group 0 in the storage's dtype (with a tensor of 4,096
    elements where int8 state applies), group 1 plain float32 or float64."""
    big = [(64, 64)] if storage == "int8_state" else []
    first = big + [tuple(int(d) for d in rng.integers(1, 6, size=int(rng.integers(1, 3))))
                   for _ in range(int(rng.integers(1, 3)))]
    second = [tuple(int(d) for d in rng.integers(1, 5, size=int(rng.integers(1, 3))))
              for _ in range(int(rng.integers(1, 3)))]
    return [[fit_shape(name, s) for s in first], [fit_shape(name, s) for s in second]]


class Recipe:
    """How to build a kit again from scratch: groups (paths, shapes, dtypes, settings), the
    storage keywords, the groups added since (in order), the scheduler, whether a Lookahead
    wraps the optimizer, and a prefix for renamed paths."""

    def __init__(self, name: str, storage: str, seed: int):
        rng = np.random.default_rng(seed)
        self.name, self.storage = name, storage
        dtype, self.keys, self.options = STORAGES[storage]
        self.groups = []
        for number, shapes in enumerate(shapes_for(name, storage, rng)):
            self.groups.append({
                "shapes": {f"g{number}.p{k}": s for k, s in enumerate(shapes)},
                "dtype": dtype if number == 0 else (F32 if rng.random() < 0.5 else F64),
                "settings": {**random_settings(name, rng), **(self.keys if number == 0
                                                                else {})}})
        self.added: list[dict] = []   # {"params": {path: array}, **settings}
        self.scheduler = SCHEDULERS[int(rng.integers(len(SCHEDULERS)))]
        self.lookahead = rng.random() < 0.5
        self.ema_decay = float(rng.choice([0.5, 0.9]))

    def paths(self) -> list[str]:
        return [p for g in self.groups for p in g["shapes"]] + \
            [p for g in self.added for p in g["params"]]


class Kit:
    def __init__(self, recipe: Recipe, seed: int, prefix: str = "", extra: dict | None = None):
        rng = np.random.default_rng(seed)
        cls = registry.lookup(recipe.name)
        groups = [{"params": {prefix + p: rng.standard_normal(s).astype(g["dtype"])
                              for p, s in g["shapes"].items()}, **g["settings"]}
                  for g in recipe.groups]
        self.opt = cls(groups, **recipe.options)
        for group in recipe.added + ([extra] if extra else []):   # as the kit gained them
            self.opt.add_param_group({**group, "params": {
                prefix + p: a.copy() for p, a in group["params"].items()}})
        self.aux = flatopt.SGD({prefix + "aux.w": rng.standard_normal((4, 3)).astype(F32)},
                               lr=0.1, momentum=0.9)
        self.remake(recipe)
        self.scaler = flatopt.GradScaler(init_scale=16.0, growth_interval=3)
        self.lookahead = None
        if recipe.lookahead:
            try:
                self.lookahead = flatopt.Lookahead(self.opt, alpha=0.5, k=2)
            except FlatoptError:
                pass   # refused by design for this storage (see docs/guide/reduced-precision.md)

    def remake(self, recipe: Recipe) -> None:
        """The scheduler and the EMA cover the groups they were made with: made again after
        a group is added (save refuses the old ones, as their step and update do)."""
        self.scheduler = (flatopt.lr_scheduler.StepLR(self.opt, 2, gamma=0.5)
                          if recipe.scheduler == "step" else
                          flatopt.lr_scheduler.CosineAnnealingLR(self.opt, T_max=7))
        self.ema = flatopt.EMA(self.opt, recipe.ema_decay)

    @property
    def stepper(self):
        return self.lookahead if self.lookahead is not None else self.opt

    def extras(self) -> dict:
        return dict(scheduler=self.scheduler, ema=self.ema, scaler=self.scaler,
                    **({"lookahead": self.lookahead} if self.lookahead is not None else {}))


def plain(value):
    """A state dict as comparable Python values: arrays as (dtype, shape, bytes)."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return ("scalar", value.dtype.str, value.tobytes())
    if isinstance(value, float):
        return ("float", np.float64(value).tobytes())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def fingerprint(kit: Kit, prefix: str = "") -> dict:
    """Everything a kit would resume from, by unprefixed path."""
    cut = len(prefix)
    return plain({
        "params": {p[cut:]: np.array(v) for p, v in kit.opt.params.items()},
        "opt": kit.opt.state_dict(), "aux": kit.aux.state_dict(),
        "aux_params": {p[cut:]: np.array(v) for p, v in kit.aux.params.items()},
        "scheduler": kit.scheduler.state_dict(),
        "ema": {p[cut:]: np.array(v) for p, v in kit.ema.params.items()},
        "scaler": kit.scaler.state_dict(),
        "lookahead": None if kit.lookahead is None else {
            k: ({p[cut:]: v for p, v in v.items()} if k == "slow" else v)
            for k, v in kit.lookahead.state_dict().items()},
    })


def views_of(record, opt) -> dict:
    """The fields of a ``state_of`` record that view the optimizer's state buffers (step
    counts are numbers, and 8-bit or bfloat16 state comes decoded: copies)."""
    stored = [a for buf in opt.buffers for a in buf.state.values() if isinstance(a, np.ndarray)]
    return {name: value for name, value in record._asdict().items()
            if isinstance(value, np.ndarray) and any(np.shares_memory(value, a) for a in stored)}


@contextlib.contextmanager
def serial():
    """The twin's way: one thread, no parallel kernels."""
    policy, threads = flatopt.get_parallel_policy(), numba.get_num_threads()
    flatopt.set_parallel_policy("never")
    numba.set_num_threads(1)
    try:
        yield
    finally:
        flatopt.set_parallel_policy(policy)
        numba.set_num_threads(threads)


def outcome(call):
    """(result, None) or (None, the exception's type)."""
    try:
        return call(), None
    except FlatoptError as exc:
        return None, type(exc)


# ----------------------------------------------------------------------------- the machine
class Machine(RuleBasedStateMachine):
    NAME = "SGD"
    STORAGE = "float32"

    def __init__(self):
        super().__init__()
        self.recipe = self.kit = self.twin = None
        self.dir = None
        self.saves = 0
        self.findings = []

    # ------------------------------------------------------------------- set-up
    @initialize(seed=st.integers(0, 2 ** 16))
    def build(self, seed):
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="flatopt-stateful-")
        self.recipe = Recipe(self.NAME, self.STORAGE, seed)
        self.kit = Kit(self.recipe, seed + 1)
        self.twin = Kit(self.recipe, seed + 1)
        self.rng = np.random.default_rng(seed + 2)

    def teardown(self):
        import shutil
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        flatopt.set_parallel_policy("auto")
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)

    def fresh(self, **more) -> Kit:
        """A kit built as this one was, with other values (every load must replace them)."""
        return Kit(self.recipe, int(self.rng.integers(1 << 30)), **more)

    def path(self, what: str) -> str:
        self.saves += 1
        return os.path.join(self.dir, f"{what}{self.saves}")

    # ------------------------------------------------------------------- stepping
    def gradients(self, opt, kind: str) -> dict:
        grads = {}
        for path, value in opt.params.items():
            draw = self.rng.random()
            if draw < 0.2:
                continue   # a missing gradient: the parameter is left alone
            dtype = np.float32 if value.dtype == BF16 and "grad_dtype" in self.recipe.keys \
                else value.dtype
            g = (self.rng.standard_normal(value.shape) * 0.5).astype(dtype)
            if draw < 0.3:
                g[...] = 0   # a zero gradient is a real step
            grads[path] = g
        if kind != "finite" and grads:
            path = sorted(grads)[int(self.rng.integers(len(grads)))]
            if grads[path].size:
                grads[path].reshape(-1)[0] = np.inf if kind == "inf" else np.nan
        return grads

    @rule(kind=st.sampled_from(["finite"] * 12 + ["inf", "nan"]),
          clip=st.sampled_from([None, None, 0.5, 1e6]),
          skip=st.booleans(), ema=st.booleans(), use_scaler=st.booleans())
    def step(self, kind, clip, skip, ema, use_scaler):
        grads = self.gradients(self.kit.opt, kind)
        aux = self.gradients(self.kit.aux, "finite")
        options = {"max_grad_norm": clip} if clip is not None else {}
        if not use_scaler:
            options["skip_nonfinite"] = skip

        def on(kit):
            def call():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if use_scaler:
                        scaled = {p: g * np.asarray(kit.scaler.get_scale(), g.dtype)
                                  for p, g in grads.items()}
                        result = kit.scaler.step(kit.stepper, scaled, **options)
                        kit.scaler.update()
                    else:
                        result = kit.stepper.step({p: g.copy() for p, g in grads.items()},
                                                  **options)
                kit.aux.step({p: g.copy() for p, g in aux.items()})
                if ema:
                    kit.ema.update()
                return (result.skipped, result.nonfinite,
                        None if result.grad_norm is None
                        else np.float64(result.grad_norm).tobytes())
            return outcome(call)
        mine = on(self.kit)
        with serial():
            theirs = on(self.twin)
        assert mine == theirs

    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none):
        self.kit.stepper.zero_grad(set_to_none)
        self.twin.stepper.zero_grad(set_to_none)

    @rule()
    def scheduler_step(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch's order-of-calls warning
            self.kit.scheduler.step()
            self.twin.scheduler.step()

    @rule(data=st.data())
    def set_parameter(self, data):
        path = data.draw(st.sampled_from(sorted(self.kit.opt.params)))
        value = self.rng.standard_normal(self.kit.opt.params[path].shape)
        value = value.astype(self.kit.opt.params[path].dtype)
        self.kit.opt.params[path] = value
        self.twin.opt.params[path] = value.copy()

    @precondition(lambda self: len(self.recipe.added) < 2)
    @rule(dtype=st.sampled_from(["first", F32, F64]))
    def add_param_group(self, dtype):
        number = len(self.recipe.groups) + len(self.recipe.added)
        keys = self.recipe.keys if dtype == "first" else {}
        dtype = self.recipe.groups[0]["dtype"] if dtype == "first" else dtype
        shape = fit_shape(self.NAME, (3, 2))
        group = {"params": {f"g{number}.p0": self.rng.standard_normal(shape).astype(dtype)},
                 **random_settings(self.NAME, self.rng), **keys}
        mine = outcome(lambda: self.kit.opt.add_param_group(
            {**group, "params": {p: a.copy() for p, a in group["params"].items()}}))
        theirs = outcome(lambda: self.twin.opt.add_param_group(
            {**group, "params": {p: a.copy() for p, a in group["params"].items()}}))
        assert mine[1] == theirs[1]
        if mine[1] is None:
            self.recipe.added.append(group)
            # an EMA covers the groups it was made with; save refuses it now, as update does
            self.outgrown()

    def outgrown(self) -> None:
        """After a group was added: saving the scheduler or the EMA made before it is refused
        before the file is touched; both kits make them again."""
        for what, more in (("gained a parameter group", {"ema": self.kit.ema}),
                           ("built for", {"scheduler": self.kit.scheduler})):
            target = self.path("outgrown") + ".h5"
            with pytest.raises(flatopt.CheckpointOptionError, match=what):
                flatopt.save(target, self.kit.opt, **more)
            assert not os.path.exists(target)
        for kit in (self.kit, self.twin):
            kit.remake(self.recipe)

    @precondition(lambda self: info(self.NAME).train_eval)
    @rule(train=st.booleans())
    def train_eval(self, train):
        for kit in (self.kit, self.twin):
            kit.opt.train() if train else kit.opt.eval()

    @rule(threads=st.sampled_from([1, 2]), policy=st.sampled_from(["auto", "always", "never"]))
    def threads(self, threads, policy):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        flatopt.set_parallel_policy(policy)

    # ------------------------------------------------------------------- leaving and coming back
    def adopt(self, kit: Kit, aux: bool = True) -> None:
        """Continue with ``kit``; with ``aux``, its SGD beside takes this one's state (what
        was saved held the main optimizer only)."""
        if aux:
            kit.aux.load_state_dict(self.kit.aux.state_dict())
            for path, value in self.kit.aux.params.items():
                kit.aux.params[path] = np.array(value)
        self.kit = kit

    def save_file(self, kit: Kit, background: bool, **more) -> str | None:
        """A checkpoint of ``kit``, verified sound; None where save refused it (state a
        non-finite gradient reached, which load would refus: nothing is written)."""
        target = self.path("ck") + ".h5"
        arrays = {"loader": {"order": np.arange(self.saves), "seed": np.int64(self.saves)}}

        def save():
            handle = flatopt.save(target, kit.opt, metadata={"save": self.saves},
                                  arrays=arrays, background=background, **kit.extras(), **more)
            return handle.wait() if background else handle
        _, error = outcome(save)
        if error is not None:
            self.refused_as_nonfinite(error, target)
            return None
        verified = verify_checkpoint(target)
        assert verified["ok"], (target, verified["problems"], [
            (b.group, b.dtype.name, b.paths, [b.layout(n) if hasattr(b, "layout") else None
                                              for n in ("row_var", "col_var")][:0],
             {p: kit.opt.state_of(p) is not None for p in b.paths}) for b in kit.opt.buffers])
        return target

    def refused_as_nonfinite(self, error, target: str) -> None:
        """A save refused because a NaN or infinite gradient reached the state (which load
        would refuse): allowed only then, and nothing may be written. (Group state a
        non-finite gradient reached, AdaGradNorm's b^2, is refused as the group's value:
        HyperparameterError, as the next step is.)"""
        assert issubclass(error, (flatopt.CheckpointError, flatopt.HyperparameterError)), error
        assert self.nonfinite(), f"save refused {error.__name__} with finite state"
        assert not os.path.exists(target)

    def nonfinite(self) -> bool:
        """Whether a NaN or infinity is anywhere in the kit's parameters or state."""
        def bad(value) -> bool:
            if isinstance(value, np.ndarray) and value.dtype.kind == "f" or \
                    isinstance(value, np.ndarray) and value.dtype == BF16:
                return not np.isfinite(value.astype(np.float64)).all()
            if isinstance(value, dict):
                return any(bad(v) for v in value.values())
            if isinstance(value, (list, tuple)):
                return any(bad(v) for v in value)
            if isinstance(value, float):
                return not np.isfinite(value)
            return False
        return bad({p: np.array(v) for p, v in self.kit.opt.params.items()}) or \
            bad(self.kit.opt.state_dict())

    @rule(background=st.booleans(), convert=st.booleans())
    def save_and_load_file(self, background, convert):
        target = self.save_file(self.kit, background)
        if target is None:
            return
        fresh = self.fresh()
        result = flatopt.load(target, fresh.opt, convert=convert, **fresh.extras())
        assert result.metadata == {"save": self.saves}
        assert np.array_equal(result.arrays["loader"]["order"], np.arange(self.saves))
        self.adopt(fresh)

    @rule(data=st.data())
    def load_in_place_keeps_views_live(self, data):
        """A load into the same optimizer: parameter views and ``state_of`` records taken
        before it show the loaded values after it, and later steps (they view the buffers)."""
        target = self.save_file(self.kit, False)
        if target is None:
            return
        path = data.draw(st.sampled_from(sorted(self.kit.opt.params)))
        view, record = self.kit.opt.params[path], self.kit.opt.state_of(path)
        views = {} if record is None else views_of(record, self.kit.opt)
        flatopt.load(target, self.kit.opt, **self.kit.extras())
        assert np.shares_memory(view, self.kit.opt.params[path]) or view.size == 0
        live = self.kit.opt.state_of(path)
        assert (record is None) == (live is None)
        for name, value in views.items():
            assert plain(value) == plain(getattr(live, name)), (path, name)
        self.record, self.record_owner = (path, views), self.kit

    @invariant()
    def a_record_stays_live(self):
        """The ``state_of`` record taken before the last load in place still shows the
        optimizer's current state (the arrays were not replaced)."""
        if getattr(self, "record", None) is None or self.kit is None:
            return
        path, views = self.record
        live = self.kit.opt.state_of(path) if path in self.kit.opt.params else None
        if live is None or self.record_owner is not self.kit:
            return
        for name, value in views.items():
            assert plain(value) == plain(getattr(live, name)), (path, name)

    @rule()
    def save_and_load_run(self):
        target = self.path("run")
        _, error = outcome(lambda: flatopt.save(
            target, {"main": self.kit.opt, "aux": self.kit.aux},
            schedulers={"main": self.kit.scheduler}, ema=[self.kit.ema],
            scaler=self.kit.scaler, metadata={"save": self.saves},
            arrays={"nested": {"a": {"b": np.arange(3.0)}}}))
        if error is not None:
            return self.refused_as_nonfinite(error, target)
        assert run_mod.verify_run(target)["ok"]
        fresh = self.fresh()
        if fresh.lookahead is not None:
            return   # a run holds no Lookahead beside a plain optimizer: see save_and_load_file
        results = flatopt.load(target, {"main": fresh.opt, "aux": fresh.aux},
                               schedulers={"main": fresh.scheduler}, ema=[fresh.ema],
                               scaler=fresh.scaler)
        assert results["main"].metadata == {"save": self.saves}
        assert np.array_equal(results["main"].arrays["nested"]["a"]["b"], np.arange(3.0))
        self.adopt(fresh, aux=False)

    @rule()
    def state_dict_round_trip(self):
        fresh = self.fresh()
        # parameters are not in a state dict: they travel as the user's arrays, written first
        # (writing a parameter resets its master copy and compensation, as documented)
        for path, value in self.kit.opt.params.items():
            fresh.opt.params[path] = np.array(value)
        _, error = outcome(lambda: fresh.opt.load_state_dict(
            copy.deepcopy(self.kit.opt.state_dict())))
        if error is not None:
            # state_dict() returns what a NaN gradient left (torch's does); load_state_dict
            # refuses a non-finite second moment as damage, as checkpoint saves do
            assert issubclass(error, flatopt.StateDictError) and self.nonfinite(), error
            return
        fresh.scheduler.load_state_dict(self.kit.scheduler.state_dict())
        fresh.ema.load_state_dict(self.kit.ema.state_dict())
        fresh.scaler.load_state_dict(self.kit.scaler.state_dict())
        if fresh.lookahead is not None:
            fresh.lookahead.load_state_dict(self.kit.lookahead.state_dict())
        self.adopt(fresh)

    @rule()
    def load_renamed_and_back(self):
        target = self.save_file(self.kit, False)
        if target is None:
            return
        renamed = self.fresh(prefix="r/")
        flatopt.load(target, renamed.opt, rename={p: "r/" + p for p in self.recipe.paths()},
                     **renamed.extras())
        assert fingerprint(renamed, "r/")["params"] == fingerprint(self.kit)["params"]
        back_file = self.save_file(renamed, False)
        if back_file is None:
            return
        back = self.fresh()
        flatopt.load(back_file, back.opt, rename={"r/" + p: p for p in self.recipe.paths()},
                     **back.extras())
        self.adopt(back)

    @rule()
    def load_not_strict_into_a_group_more(self):
        """Into an optimizer with one group more (strict=False leaves it as built); the twin
        gains the same group by add_param_group."""
        target = self.save_file(self.kit, False)
        if target is None:
            return
        number = len(self.recipe.groups) + len(self.recipe.added)
        extra = {"params": {f"x{number}.w": self.rng.standard_normal(
                     fit_shape(self.NAME, (2, 3))).astype(F32)},
                 **random_settings(self.NAME, self.rng)}
        fresh = self.fresh(extra=extra)
        if fresh.lookahead is not None:
            return   # a Lookahead's counts are per group: it loads into the same groups only
        # the scheduler and the EMA are made again after the new group (see outgrown)
        flatopt.load(target, fresh.opt, strict=False, regroup=True, scaler=fresh.scaler,
                     hyperparameters="saved")
        twin_added = outcome(lambda: self.twin.opt.add_param_group(
            {**extra, "params": {p: a.copy() for p, a in extra["params"].items()}}))
        assert twin_added[1] is None
        self.recipe.added.append(extra)
        self.adopt(fresh)
        for kit in (self.kit, self.twin):
            kit.remake(self.recipe)

    # ------------------------------------------------------------------- refused operations
    def refused(self, call, *, file: str | None = None) -> None:
        before = fingerprint(self.kit)
        on_disk = open(file, "rb").read() if file and os.path.exists(file) else None
        result, error = outcome(call)
        assert error is not None, f"not refused: {call}"
        assert fingerprint(self.kit) == before, f"a refused call changed the kit ({error})"
        if file:
            now = open(file, "rb").read() if os.path.exists(file) else None
            assert now == on_disk, f"a refused save touched {file}"

    @rule(how=st.sampled_from(["shape", "unknown", "dtype"]))
    def refused_step(self, how):
        path = sorted(self.kit.opt.params)[0]
        shape = self.kit.opt.params[path].shape
        grads = {"shape": {path: np.zeros(shape + (2,), np.float32)},
                 "unknown": {"no.such.path": np.zeros(3, np.float32)},
                 "dtype": {path: np.zeros(shape, np.complex64)}}[how]
        self.refused(lambda: self.kit.stepper.step(grads))

    @rule(value=st.sampled_from([-1.0, float("nan"), "fast"]))
    def refused_hyperparameter(self, value):
        group = self.kit.opt.param_groups[0]
        lr = group["lr"]
        group["lr"] = value
        try:
            self.refused(lambda: self.kit.stepper.step(
                {p: np.zeros(v.shape, np.float32) for p, v in self.kit.opt.params.items()}))
        finally:
            group["lr"] = lr

    @rule()
    def refused_duplicate_group(self):
        path = sorted(self.kit.opt.params)[0]
        value = np.array(self.kit.opt.params[path])
        self.refused(lambda: self.kit.opt.add_param_group({"params": {path: value}}))

    @rule(how=st.sampled_from(["other_rule", "damaged", "truncated"]))
    def refused_load(self, how):
        if how == "other_rule":
            other = "Adam" if self.NAME != "Adam" else "SGD"
            params = {p: np.zeros(v.shape, np.float32) for p, v in self.kit.opt.params.items()}
            target = self.path("other") + ".h5"
            flatopt.save(target, registry.lookup(other)(params))
        else:
            target = self.save_file(self.kit, False)
            if target is None:
                return
            data = bytearray(open(target, "rb").read())
            if how == "damaged":
                data[len(data) // 2] ^= 0x5A
            else:
                del data[len(data) * 2 // 3:]
            with open(target, "wb") as f:
                f.write(bytes(data))
            if verify_checkpoint(target)["ok"]:
                return   # the flipped byte was in unused space: the file is still sound
        self.refused(lambda: flatopt.load(target, self.kit.opt, **self.kit.extras()))

    @rule(how=st.sampled_from(["shape", "step", "text", "hyperparameter", "unknown"]))
    def refused_state_dict(self, how):
        sd = copy.deepcopy(self.kit.opt.state_dict())
        arrays = [(k, n) for k in sorted(sd["state"]) for n in sorted(sd["state"][k])
                  if isinstance(sd["state"][k][n], np.ndarray) and sd["state"][k][n].size]
        if how == "hyperparameter":
            sd["param_groups"][0]["lr"] = -3.0
        elif how == "unknown" or not arrays:
            sd["param_groups"][0]["no_such_setting"] = 1.0
        elif how == "step" and any("step" in e for e in sd["state"].values()):
            key = next(k for k in sorted(sd["state"]) if "step" in sd["state"][k])
            sd["state"][key]["step"] = -5
        else:
            key, name = arrays[0]
            sd["state"][key][name] = ("not a number" if how != "shape"
                                      else np.zeros((7, 7, 7), np.float32))
        self.refused(lambda: self.kit.opt.load_state_dict(sd))

    @rule(how=st.sampled_from(["no_directory", "bad_metadata", "bad_arrays"]))
    def refused_save(self, how):
        good = self.save_file(self.kit, False)
        if good is None:
            return
        if how == "no_directory":
            target = os.path.join(self.dir, "missing", "x.h5")
            self.refused(lambda: flatopt.save(target, self.kit.opt), file=target)
            assert not os.path.exists(os.path.dirname(target))
            return
        more = ({"metadata": {"f": object()}} if how == "bad_metadata"
                else {"arrays": {"a": np.array([object()])}})
        self.refused(lambda: flatopt.save(good, self.kit.opt, **more), file=good)

    # ------------------------------------------------------------------- the invariant
    @invariant()
    def same_bits_as_the_twin(self):
        if self.kit is None:
            return
        mine, theirs = fingerprint(self.kit), fingerprint(self.twin)
        if mine != theirs:
            differing = [k for k in mine if mine[k] != theirs[k]]
            raise AssertionError(f"the kit differs from its twin in {differing}")


def machine(name: str, storage: str) -> type:
    return type(f"Machine_{name}_{storage}", (Machine,), {"NAME": name, "STORAGE": storage})


@pytest.mark.parametrize("name,storage", configurations())
def test_the_public_surface_against_a_twin_that_never_saves(name, storage, request):
    slow = request.node.get_closest_marker("slow") is not None
    examples = int(os.environ.get("FLATOPT_STATEFUL_EXAMPLES", 5 if slow else 3))
    steps = int(os.environ.get("FLATOPT_STATEFUL_STEPS", 25 if slow else 20))
    example = name in examples_plugin.MODULES
    with examples_plugin.registered(name) if example else contextlib.nullcontext():
        run(name, storage, examples, steps)


def run(name: str, storage: str, examples: int, steps: int) -> None:
    run_state_machine_as_test(machine(name, storage), settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None,
        derandomize=not RANDOM, database=None, print_blob=True,
        phases=[p for p in Phase if SHRINK or p not in (Phase.shrink, Phase.explain)],
        suppress_health_check=list(HealthCheck)))
