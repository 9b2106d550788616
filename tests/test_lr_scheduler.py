"""flatopt.lr_scheduler: conformance with torch.optim.lr_scheduler 2.13 on random
configurations (values compared with ==: the same Python float expressions in the same order),
state dicts through JSON mid-schedule, and every error case."""

from __future__ import annotations

import json
import math
import random
import warnings

import numpy as np
import pytest

import flatopt
from flatopt import StateDictError
from flatopt import lr_scheduler as L

SEEDS = range(4)
CLOSED_FORM = ("StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
               "PolynomialLR", "CosineAnnealingLR")


# ----------------------------------------------------------------------------- helpers
def group_specs(rng: random.Random, count: int | None = None) -> list[float]:
    """1-3 groups with different lrs."""
    count = count or rng.randint(1, 3)
    return [round(rng.uniform(1e-3, 0.5), 6) for _ in range(count)]


def flat_optimizer(kind: str, lrs: list[float]) -> flatopt.Optimizer:
    groups = [{"params": {f"p{i}": np.zeros(2, np.float32)}, "lr": lr}
              for i, lr in enumerate(lrs)]
    if kind == "sgd":
        return flatopt.SGD(groups, lr=0.1, momentum=0.9)
    return flatopt.Adam(groups, lr=1e-3)


def torch_optimizer(kind: str, lrs: list[float]):
    torch = pytest.importorskip("torch")
    groups = [{"params": [torch.zeros(2, requires_grad=True)], "lr": lr} for lr in lrs]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return torch.optim.Adam(groups, lr=1e-3)


def pair(kind: str, lrs: list[float]):
    return flat_optimizer(kind, lrs), torch_optimizer(kind, lrs)


def group_values(opt, keys=("lr", "initial_lr", "momentum", "betas")) -> list[dict]:
    return [{k: (tuple(g[k]) if k == "betas" else g[k]) for k in keys if k in g}
            for g in opt.param_groups]


def assert_same(flat_sched, torch_sched, flat_opt, torch_opt, where: str,
                validate: bool = True) -> None:
    ours, theirs = flat_sched.get_last_lr(), torch_sched.get_last_lr()
    assert ours == theirs, f"{where}: get_last_lr {ours} != torch {theirs}"
    assert group_values(flat_opt) == group_values(torch_opt), where
    if validate:
        flat_opt.settings()  # every value the scheduler wrote is one the optimizer accepts


def run_both(flat_sched, torch_sched, flat_opt, torch_opt, steps: int, *,
             validate_until: int | None = None) -> int:
    assert_same(flat_sched, torch_sched, flat_opt, torch_opt, "after construction")
    for step in range(1, steps + 1):
        torch_opt.step()  # no gradients: a no-op that keeps torch's call-order check quiet
        flat_sched.step()
        torch_sched.step()
        validate = validate_until is None or step < validate_until
        assert_same(flat_sched, torch_sched, flat_opt, torch_opt, f"step {step}", validate)
    return steps


def random_config(name: str, rng: random.Random, steps: int) -> dict:
    """Constructor arguments for scheduler ``name`` in the ranges a user would pick."""
    if name == "StepLR":
        return {"step_size": rng.randint(1, 25), "gamma": rng.uniform(0.1, 0.99)}
    if name == "MultiStepLR":  # any order, repeats and 0 included: torch's Counter semantics
        milestones = [rng.randint(0, steps) for _ in range(rng.randint(1, 6))]
        milestones.append(rng.choice(milestones))  # a repeat: gamma ** 2 there
        return {"milestones": milestones, "gamma": rng.uniform(0.1, 0.99)}
    if name == "ExponentialLR":
        return {"gamma": rng.uniform(0.9, 0.999)}
    if name == "CosineAnnealingLR":  # runs past T_max, up the other side of the cosine
        return {"T_max": rng.randint(1, max(1, steps // 2)),
                "eta_min": rng.choice([0, 0.0, rng.uniform(0, 1e-3)])}
    if name == "CosineAnnealingWarmRestarts":
        return {"T_0": rng.randint(1, 30), "T_mult": rng.choice([1, 2]),
                "eta_min": rng.choice([0, rng.uniform(0, 1e-3)])}
    if name == "LinearLR":
        return {"start_factor": rng.uniform(0.01, 1.0), "end_factor": rng.uniform(0.0, 1.0),
                "total_iters": rng.randint(1, 60)}
    if name == "ConstantLR":
        return {"factor": rng.uniform(0.05, 1.0), "total_iters": rng.randint(0, 60)}
    if name == "PolynomialLR":
        return {"total_iters": rng.randint(1, 120),
                "power": rng.choice([1.0, 2, rng.uniform(0.3, 3)])}
    raise AssertionError(name)


CHAINABLE = ("StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR",
             "CosineAnnealingWarmRestarts", "LinearLR", "ConstantLR", "PolynomialLR")


# ----------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", CHAINABLE)
def test_conformance_random_configurations(name, seed):
    torch = pytest.importorskip("torch")
    rng = random.Random(f"{name}-{seed}")
    steps = rng.randint(50, 300)
    lrs = group_specs(rng)
    kind = rng.choice(["sgd", "adam"])
    config = random_config(name, rng, steps)
    flat_opt, torch_opt = pair(kind, lrs)
    ours = getattr(L, name)(flat_opt, **config)
    theirs = getattr(torch.optim.lr_scheduler, name)(torch_opt, **config)
    run_both(ours, theirs, flat_opt, torch_opt, steps)
    assert ours.last_epoch == theirs.last_epoch == steps


def one_cycle_config(rng: random.Random, groups: int, cycle_momentum: bool) -> dict:
    max_lr = rng.uniform(0.01, 1.0)
    config = {
        "max_lr": [rng.uniform(0.01, 1.0) for _ in range(groups)] if rng.random() < 0.5
        else max_lr,
        "pct_start": rng.uniform(0.05, 0.6), "anneal_strategy": rng.choice(["cos", "linear"]),
        "three_phase": rng.random() < 0.5, "cycle_momentum": cycle_momentum,
        "div_factor": rng.choice([25.0, rng.uniform(2, 100)]),
        "final_div_factor": rng.choice([1e4, rng.uniform(10, 1e5)]),
    }
    if rng.random() < 0.5:
        config["total_steps"] = rng.randint(50, 300)
    else:
        config["epochs"], config["steps_per_epoch"] = rng.randint(2, 10), rng.randint(10, 30)
    if cycle_momentum:
        config["base_momentum"] = rng.uniform(0.6, 0.88)
        config["max_momentum"] = ([rng.uniform(0.9, 0.99) for _ in range(groups)]
                                  if rng.random() < 0.5 else rng.uniform(0.9, 0.99))
    return config


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("cycle_momentum", [True, False])
def test_conformance_one_cycle(kind, cycle_momentum, seed):
    """lr, and momentum (SGD) or betas (Adam), after construction and every step up to
    total_steps; stepping once more is torch's ValueError and changes nothing."""
    torch = pytest.importorskip("torch")
    rng = random.Random(f"onecycle-{kind}-{cycle_momentum}-{seed}")
    lrs = group_specs(rng)
    config = one_cycle_config(rng, len(lrs), cycle_momentum)
    flat_opt, torch_opt = pair(kind, lrs)
    ours = L.OneCycleLR(flat_opt, **config)
    theirs = torch.optim.lr_scheduler.OneCycleLR(torch_opt, **config)
    if cycle_momentum:
        assert ours.owned_hyperparameters == ("lr", "betas" if kind == "adam" else "momentum")
    else:
        assert ours.owned_hyperparameters == ("lr",)
    # The call reaching total_steps extrapolates past the schedule's end (torch allows it;
    # with 'linear' the lr goes below zero), so validation stops before it.
    run_both(ours, theirs, flat_opt, torch_opt, ours.total_steps,
             validate_until=ours.total_steps)
    before = (ours.state_dict(), group_values(flat_opt))
    with pytest.raises(ValueError, match=r"Tried to step \d+ times") as ours_error:
        ours.step()
    with pytest.raises(ValueError) as torch_error:
        theirs.step()
    assert str(ours_error.value) == str(torch_error.value)
    assert (ours.state_dict(), group_values(flat_opt)) == before


@pytest.mark.parametrize("seed", range(8))
def test_conformance_sequential(seed):
    """Two or three children, any of the chainable schedulers (OneCycleLR last, long
    enough), switching at random milestones."""
    torch = pytest.importorskip("torch")
    rng = random.Random(f"sequential-{seed}")
    steps = rng.randint(60, 300)
    lrs = group_specs(rng)
    kind = rng.choice(["sgd", "adam"])
    count = rng.choice([2, 3])
    milestones = sorted(rng.sample(range(1, steps), count - 1))
    flat_opt, torch_opt = pair(kind, lrs)
    ours_children, torch_children = [], []
    names = [rng.choice(CHAINABLE) for _ in range(count)]
    if seed % 4 == 3:
        names[-1] = "OneCycleLR"
    for name in names:
        if name == "OneCycleLR":
            config = one_cycle_config(rng, len(lrs), rng.random() < 0.5)
            config.pop("epochs", None), config.pop("steps_per_epoch", None)
            config["total_steps"] = steps
        else:
            config = random_config(name, rng, steps)
        ours_children.append(getattr(L, name)(flat_opt, **config))
        torch_children.append(getattr(torch.optim.lr_scheduler, name)(torch_opt, **config))
    ours = L.SequentialLR(flat_opt, ours_children, milestones)
    theirs = torch.optim.lr_scheduler.SequentialLR(torch_opt, torch_children, milestones)
    expected = {"lr"} | {k for c in ours_children for k in c.owned_hyperparameters}
    assert set(ours.owned_hyperparameters) == expected
    run_both(ours, theirs, flat_opt, torch_opt, steps, validate_until=steps)
    for child, torch_child in zip(ours_children, torch_children):
        assert child.last_epoch == torch_child.last_epoch


def metric_sequence(rng: random.Random, count: int) -> list[float]:
    """A noisy curve with plateaus and exact repeats (ties exercise the thresholds)."""
    value, values = rng.uniform(0.5, 5), []
    for _ in range(count):
        r = rng.random()
        if r < 0.3:
            value += rng.uniform(-0.2, 0.05)
        elif r < 0.5:
            value *= rng.uniform(0.999, 1.001)
        elif r < 0.6:
            value += rng.uniform(-0.5, 0.5)
        values.append(round(value, rng.choice([2, 4, 8])))
    return values


def plateau_case(mode: str, threshold_mode: str, seed: int) -> int:
    """One random ReduceLROnPlateau configuration against torch; returns the reductions."""
    torch = pytest.importorskip("torch")
    rng = random.Random(f"plateau-{mode}-{threshold_mode}-{seed}")
    lrs = group_specs(rng)
    config = {
        "mode": mode, "threshold_mode": threshold_mode, "factor": rng.uniform(0.1, 0.9),
        "patience": rng.randint(0, 6), "cooldown": rng.randint(0, 4),
        "threshold": [0.0, 1e-4, 1e-2][seed],  # 0.0: exact ties with best
        "min_lr": ([rng.uniform(0, 1e-3) for _ in lrs] if rng.random() < 0.5
                   else rng.choice([0, 1e-4])),
        "eps": rng.choice([1e-8, 0.0, 1e-4]),
    }
    flat_opt, torch_opt = pair(rng.choice(["sgd", "adam"]), lrs)
    ours = L.ReduceLROnPlateau(flat_opt, **config)
    theirs = torch.optim.lr_scheduler.ReduceLROnPlateau(torch_opt, **config)
    metrics = metric_sequence(rng, rng.randint(50, 300))
    if mode == "max":
        metrics = [-m for m in metrics]
    assert_same(ours, theirs, flat_opt, torch_opt, "after construction")
    reductions = 0
    for step, metric in enumerate(metrics, start=1):
        before = ours.get_last_lr()
        ours.step(metric)
        theirs.step(metric)
        assert_same(ours, theirs, flat_opt, torch_opt, f"step {step}")
        for attr in ("best", "num_bad_epochs", "cooldown_counter", "last_epoch"):
            assert getattr(ours, attr) == getattr(theirs, attr), (step, attr)
        reductions += ours.get_last_lr() != before
    assert "initial_lr" not in flat_opt.param_groups[0]  # torch sets none either
    return reductions


@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("threshold_mode", ["rel", "abs"])
def test_conformance_reduce_on_plateau(mode, threshold_mode):
    """Three seeds per mode pair; the metric sequences do make the lr come down."""
    reductions = [plateau_case(mode, threshold_mode, seed) for seed in range(3)]
    assert sum(reductions) >= 3, reductions


def test_plateau_eps_boundary_and_epoch_argument():
    """A decrease of exactly eps is ignored (torch: ``old - new > eps``); step(metrics,
    epoch) sets last_epoch with torch's warning."""
    torch = pytest.importorskip("torch")
    flat_opt, torch_opt = pair("sgd", [1.0, 0.25])
    ours = L.ReduceLROnPlateau(flat_opt, factor=0.5, eps=0.5, patience=0)
    theirs = torch.optim.lr_scheduler.ReduceLROnPlateau(torch_opt, factor=0.5, eps=0.5,
                                                        patience=0)
    for metric in (1.0, 2.0, 3.0):
        ours.step(metric)
        theirs.step(metric)
        assert_same(ours, theirs, flat_opt, torch_opt, f"metric {metric}")
    assert ours.get_last_lr() == [1.0, 0.25]
    with pytest.warns(UserWarning, match="epoch parameter"):
        ours.step(4.0, epoch=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.step(4.0, epoch=10)
    assert ours.last_epoch == theirs.last_epoch == 10


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", CLOSED_FORM)
def test_conformance_deprecated_epoch_argument(name, seed):
    """step(epoch) uses the closed form with torch's UserWarning, interleaved with step()."""
    torch = pytest.importorskip("torch")
    rng = random.Random(f"epoch-{name}-{seed}")
    lrs = group_specs(rng)
    config = random_config(name, rng, 100)
    flat_opt, torch_opt = pair("sgd", lrs)
    ours = getattr(L, name)(flat_opt, **config)
    theirs = getattr(torch.optim.lr_scheduler, name)(torch_opt, **config)
    for step in range(40):
        torch_opt.step()
        if rng.random() < 0.4:
            epoch = rng.randint(0, 150)
            with pytest.warns(UserWarning, match="epoch parameter"):
                ours.step(epoch)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs.step(epoch)
        else:
            ours.step()
            theirs.step()
        assert_same(ours, theirs, flat_opt, torch_opt, f"step {step}")


@pytest.mark.parametrize("T_mult", [1, 2, 3])
def test_conformance_warm_restarts_fractional_epochs(T_mult):
    """torch's documented use: step(epoch + i / iters), with restarts at T_0 * T_mult**k."""
    torch = pytest.importorskip("torch")
    flat_opt, torch_opt = pair("sgd", [0.1, 0.03])
    ours = L.CosineAnnealingWarmRestarts(flat_opt, T_0=3, T_mult=T_mult, eta_min=1e-4)
    theirs = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        torch_opt, T_0=3, T_mult=T_mult, eta_min=1e-4)
    iters = 7
    for epoch in range(30):
        for i in range(iters):
            ours.step(epoch + i / iters)
            theirs.step(epoch + i / iters)
            assert_same(ours, theirs, flat_opt, torch_opt, f"epoch {epoch} + {i}/{iters}")
            assert (ours.T_cur, ours.T_i, ours.last_epoch) == \
                (theirs.T_cur, theirs.T_i, theirs.last_epoch)
    state = json.loads(json.dumps(ours.state_dict()))
    assert isinstance(state["T_cur"], float)
    with pytest.raises(ValueError, match="Expected non-negative epoch, but got -1"):
        ours.step(-1)


@pytest.mark.parametrize("name", CHAINABLE + ("OneCycleLR",))
def test_conformance_resuming_with_last_epoch(name):
    """last_epoch >= 0 with initial_lr already in the groups: torch's initial step from
    there (StepLR at a multiple of step_size decays once more, as torch does)."""
    torch = pytest.importorskip("torch")
    rng = random.Random(name)
    lrs = group_specs(rng, 2)
    flat_opt, torch_opt = pair("sgd", lrs)
    for opt in (flat_opt, torch_opt):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"] * 2
    if name == "OneCycleLR":
        config = {"max_lr": 0.5, "total_steps": 100}
        for group in torch_opt.param_groups:  # what a loaded torch optimizer state holds
            group.update(max_lr=0.5, min_lr=0.5 / 25 / 1e4, max_momentum=0.95,
                         base_momentum=0.85, initial_lr=0.5 / 25)
        for group in flat_opt.param_groups:
            group["initial_lr"] = 0.5 / 25
    else:
        config = random_config(name, rng, 100)
    ours = getattr(L, name)(flat_opt, last_epoch=9, **config)
    theirs = getattr(torch.optim.lr_scheduler, name)(torch_opt, last_epoch=9, **config)
    assert ours.last_epoch == theirs.last_epoch == 10
    assert ours.get_last_lr() == theirs.get_last_lr()
    for _ in range(30):
        torch_opt.step()
        ours.step()
        theirs.step()
        assert ours.get_last_lr() == theirs.get_last_lr()


def test_constructor_writes_lrs_and_initial_lr_as_torch():
    opt = flat_optimizer("sgd", [1.0, 0.5])
    sched = L.LinearLR(opt, start_factor=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.05]
    assert [g["initial_lr"] for g in opt.param_groups] == [1.0, 0.5]
    assert (sched.last_epoch, sched._step_count) == (0, 1)
    # a second scheduler keeps the first initial_lr (setdefault)
    L.StepLR(opt, step_size=2)
    assert [g["initial_lr"] for g in opt.param_groups] == [1.0, 0.5]
    # torch's documented example: StepLR(step_size=2, gamma=.1) from lr 1.0
    opt = flat_optimizer("sgd", [1.0])
    sched = L.StepLR(opt, step_size=2, gamma=0.1)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        sched.step()
    assert seen == [1.0, 1.0, 0.1, 0.1, 0.1 * 0.1]  # chainable: 0.010000000000000002


def test_one_cycle_keeps_its_values_out_of_the_groups():
    opt = flat_optimizer("adam", [0.1, 0.2])
    sched = L.OneCycleLR(opt, max_lr=[1.0, 2.0], total_steps=50)
    for group in opt.param_groups:
        assert not {"max_lr", "min_lr", "max_momentum", "base_momentum"} & set(group)
    assert sched.max_lrs == [1.0, 2.0] and sched.min_lrs == [1.0 / 25 / 1e4, 2.0 / 25 / 1e4]
    assert [g["initial_lr"] for g in opt.param_groups] == [1.0 / 25, 2.0 / 25]
    assert [g["betas"] for g in opt.param_groups] == [(0.95, 0.999)] * 2
    opt.settings()


def test_training_steps_match_torch_under_one_cycle():
    """End to end: real optimizer steps with SGD momentum cycled by OneCycleLR (float64)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(5)
    grads = rng.standard_normal((25, 5))
    opt = flatopt.SGD({"w": w0.copy()}, lr=0.1, momentum=0.9)
    tw = torch.tensor(w0.copy(), requires_grad=True)
    topt = torch.optim.SGD([tw], lr=0.1, momentum=0.9)
    sched = L.OneCycleLR(opt, max_lr=0.5, total_steps=25, anneal_strategy="linear")
    tsched = torch.optim.lr_scheduler.OneCycleLR(topt, max_lr=0.5, total_steps=25,
                                                 anneal_strategy="linear")
    for g in grads[:24]:
        opt.step({"w": g})
        tw.grad = torch.tensor(g)
        topt.step()
        sched.step()
        tsched.step()
        np.testing.assert_allclose(opt.params["w"], tw.detach().numpy(), rtol=1e-12,
                                   atol=1e-15)
    assert sched.get_last_lr() == tsched.get_last_lr()


# ----------------------------------------------------------------------------- state dicts
def is_json_data(value) -> bool:
    if value is None or type(value) in (bool, int, float, str):
        return True
    if type(value) is list:
        return all(is_json_data(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and is_json_data(v) for k, v in value.items())
    return False


def build(name: str, opt, rng: random.Random):
    """A scheduler ``name`` on ``opt`` from ``rng`` (the same rng state gives the same one)."""
    if name in CHAINABLE:
        return getattr(L, name)(opt, **random_config(name, rng, 120))
    if name == "OneCycleLR":
        config = one_cycle_config(rng, len(opt.param_groups), rng.random() < 0.7)
        config.pop("epochs", None), config.pop("steps_per_epoch", None)
        config["total_steps"] = 200
        return L.OneCycleLR(opt, **config)
    if name == "SequentialLR":
        first = L.LinearLR(opt, start_factor=rng.uniform(0.05, 0.5), total_iters=20)
        second = L.CosineAnnealingLR(opt, T_max=rng.randint(20, 60), eta_min=1e-5)
        third = L.OneCycleLR(opt, max_lr=rng.uniform(0.1, 1), total_steps=200)
        return L.SequentialLR(opt, [first, second, third], milestones=[20, 60])
    if name == "ReduceLROnPlateau":
        return L.ReduceLROnPlateau(opt, patience=rng.randint(0, 3), cooldown=1,
                                   factor=rng.uniform(0.2, 0.8), min_lr=1e-5)
    raise AssertionError(name)


ALL = CHAINABLE + ("OneCycleLR", "SequentialLR", "ReduceLROnPlateau")


def advance(sched, steps: int, metrics: list[float]) -> list:
    """Step ``steps`` times; the lrs and group values after each step."""
    seen = []
    for _ in range(steps):
        if isinstance(sched, L.ReduceLROnPlateau):
            sched.step(metrics.pop(0))
        else:
            sched.step()
        seen.append((sched.get_last_lr(), group_values(sched.optimizer)))
    return seen


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ALL)
def test_state_dict_json_round_trip_mid_schedule(name, seed):
    """Save optimizer and scheduler at step k (scheduler state through JSON text), load both
    into a fresh optimizer and scheduler (documented order), continue: the same sequence as
    an uninterrupted run."""
    rng = random.Random(f"roundtrip-{name}-{seed}")
    kind = rng.choice(["sgd", "adam"])
    lrs = group_specs(rng)
    config_seed, k = rng.random(), rng.randint(1, 90)
    metrics = metric_sequence(rng, 200)

    opt = flat_optimizer(kind, lrs)
    sched = build(name, opt, random.Random(config_seed))
    advance(sched, k, metrics)
    text = json.dumps(sched.state_dict(), allow_nan=True)
    opt_state = opt.state_dict()
    expected = advance(sched, 100, list(metrics))

    state = json.loads(text)
    assert is_json_data(state) and state["scheduler"] == name
    fresh = flat_optimizer(kind, [0.9] * len(lrs))  # other lrs: they are overwritten
    resumed = build(name, fresh, random.Random(config_seed))
    fresh.load_state_dict(opt_state)
    resumed.load_state_dict(state)
    assert json.dumps(resumed.state_dict(), allow_nan=True) == text
    assert advance(resumed, 100, metrics) == expected
    fresh.settings()


def test_plateau_infinite_best_round_trips():
    opt = flat_optimizer("sgd", [0.1])
    sched = L.ReduceLROnPlateau(opt, mode="max")
    text = json.dumps(sched.state_dict(), allow_nan=True)
    assert "-Infinity" in text
    other = L.ReduceLROnPlateau(flat_optimizer("sgd", [0.1]), mode="max")
    other.best = 3.0
    other.load_state_dict(json.loads(text))
    assert other.best == -math.inf and other.state_dict() == sched.state_dict()


def test_load_restores_the_saved_configuration():
    """As torch: the saved gamma and step_size replace the constructor's."""
    opt = flat_optimizer("sgd", [1.0])
    saved = L.StepLR(opt, step_size=3, gamma=0.5)
    other = L.StepLR(flat_optimizer("sgd", [1.0]), step_size=10, gamma=0.9)
    other.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    assert (other.step_size, other.gamma) == (3, 0.5)
    multi = L.MultiStepLR(flat_optimizer("sgd", [1.0]), milestones=[9, 3, 3], gamma=0.5)
    assert multi.state_dict()["milestones"] == [3, 3, 9]
    other = L.MultiStepLR(flat_optimizer("sgd", [1.0]), milestones=[1])
    other.load_state_dict(json.loads(json.dumps(multi.state_dict())))
    assert other.milestones == multi.milestones


def test_checkpoint_resume_with_scheduler(tmp_path):
    """flatopt.save(..., scheduler=) and the documented resume order: build optimizer, build
    scheduler, flatopt.load(path, opt, scheduler=sched)."""
    def make():
        opt = flatopt.Adam({"w": np.zeros(3, np.float32)}, lr=1e-3)
        return opt, L.OneCycleLR(opt, max_lr=0.01, total_steps=100)

    opt, sched = make()
    for _ in range(30):
        sched.step()
    flatopt.save(tmp_path / "ckpt.h5", opt, scheduler=sched)
    expected = advance(sched, 20, [])

    opt2, sched2 = make()
    flatopt.load(tmp_path / "ckpt.h5", opt2, scheduler=sched2, hyperparameters="saved")
    assert sched2.last_epoch == 30
    assert advance(sched2, 20, []) == expected


# ----------------------------------------------------------------------------- errors
class NotAnOptimizer:
    param_groups = ({"lr": 0.1},)  # a tuple, not a list


def constructors(opt):
    return {
        "StepLR": lambda o: L.StepLR(o, 1), "MultiStepLR": lambda o: L.MultiStepLR(o, [1]),
        "ExponentialLR": lambda o: L.ExponentialLR(o, 0.9),
        "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, 10),
        "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, 10),
        "LinearLR": lambda o: L.LinearLR(o), "ConstantLR": lambda o: L.ConstantLR(o),
        "PolynomialLR": lambda o: L.PolynomialLR(o),
        "OneCycleLR": lambda o: L.OneCycleLR(o, 0.1, total_steps=10),
        "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o),
        "SequentialLR": lambda o: L.SequentialLR(o, [L.StepLR(opt, 1)], []),
    }


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [None, [], NotAnOptimizer()])
def test_not_an_optimizer(name, bad):
    make = constructors(flat_optimizer("sgd", [0.1]))[name]
    with pytest.raises(TypeError, match=f"^{type(bad).__name__} is not an Optimizer"):
        make(bad)


def test_any_object_with_param_groups_works():
    class Duck:
        param_groups = [{"lr": 1.0}]
    duck = Duck()
    sched = L.StepLR(duck, step_size=1, gamma=0.5)
    sched.step()
    assert duck.param_groups == [{"lr": 0.5, "initial_lr": 1.0}]


@pytest.mark.parametrize("name", CHAINABLE)
def test_last_epoch_without_initial_lr_is_torchs_key_error(name):
    opt = flat_optimizer("sgd", [0.1, 0.2])
    before = group_values(opt)
    with pytest.raises(KeyError, match=r"param 'initial_lr' is not specified in "
                                       r"param_groups\[0\] when resuming scheduler"):
        getattr(L, name)(opt, last_epoch=3, **random_config(name, random.Random(0), 50))
    assert group_values(opt) == before


ARGUMENT_ERRORS = [
    (lambda o: L.StepLR(o, 0), ValueError, "step_size must be an integer >= 1, got 0"),
    (lambda o: L.StepLR(o, 2.5), TypeError, "step_size must be an integer"),
    (lambda o: L.StepLR(o, 2, gamma=-0.1), ValueError, "gamma must be >= 0.0"),
    (lambda o: L.StepLR(o, 2, gamma="0.1"), TypeError, "gamma must be a real number"),
    (lambda o: L.StepLR(o, 2, last_epoch=-2), ValueError, "last_epoch must be an integer >= -1"),
    (lambda o: L.MultiStepLR(o, [1, 2.5]), TypeError, r"milestones\[1\] must be an integer"),
    (lambda o: L.MultiStepLR(o, [-1]), ValueError, r"milestones\[0\] must be an integer >= 0"),
    (lambda o: L.MultiStepLR(o, 5), TypeError, "milestones must be a list of integers"),
    (lambda o: L.ExponentialLR(o, float("nan")), ValueError, "gamma must be finite"),
    (lambda o: L.ConstantLR(o, factor=1.5), ValueError,
     "Constant multiplicative factor expected to be between 0 and 1."),
    (lambda o: L.ConstantLR(o, factor=0), ValueError, "refuses 0 too"),
    (lambda o: L.LinearLR(o, start_factor=0), ValueError,
     "Starting multiplicative factor expected to be greater than 0 and less or equal to 1."),
    (lambda o: L.LinearLR(o, end_factor=1.5), ValueError,
     "Ending multiplicative factor expected to be between 0 and 1."),
    (lambda o: L.LinearLR(o, total_iters=0), ValueError, "total_iters must be an integer >= 1"),
    (lambda o: L.PolynomialLR(o, power=-1), ValueError, "power must be >= 0.0"),
    (lambda o: L.CosineAnnealingLR(o, T_max=0), ValueError, "T_max must be an integer >= 1"),
    (lambda o: L.CosineAnnealingLR(o, T_max=10.0), TypeError, "T_max must be an integer"),
    (lambda o: L.CosineAnnealingLR(o, T_max=10, eta_min=-1e-3), ValueError,
     "eta_min must be >= 0.0"),
    (lambda o: L.CosineAnnealingWarmRestarts(o, T_0=0), ValueError,
     "Expected positive integer T_0, but got 0"),
    (lambda o: L.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=0), ValueError,
     "Expected integer T_mult >= 1, but got 0"),
    (lambda o: L.CosineAnnealingWarmRestarts(o, T_0=2, eta_min="0"), ValueError,
     "Expected float or int eta_min, but got 0 of type"),
    (lambda o: L.OneCycleLR(o, 0.1), ValueError,
     r"You must define either total_steps OR \(epochs AND steps_per_epoch\)"),
    (lambda o: L.OneCycleLR(o, 0.1, total_steps=0), ValueError,
     "Expected positive integer total_steps, but got 0"),
    (lambda o: L.OneCycleLR(o, 0.1, epochs=0, steps_per_epoch=3), ValueError,
     "Expected positive integer epochs, but got 0"),
    (lambda o: L.OneCycleLR(o, 0.1, epochs=2, steps_per_epoch=-1), ValueError,
     "Expected positive integer steps_per_epoch, but got -1"),
    (lambda o: L.OneCycleLR(o, 0.1, total_steps=10, pct_start=1.5), ValueError,
     "Expected float between 0 and 1 pct_start, but got 1.5"),
    (lambda o: L.OneCycleLR(o, 0.1, total_steps=10, pct_start=0), ValueError,
     "Expected float between 0 and 1 pct_start, but got 0"),
    (lambda o: L.OneCycleLR(o, 0.1, total_steps=10, anneal_strategy="exp"), ValueError,
     "anneal_strategy must be one of 'cos' or 'linear', instead got exp"),
    (lambda o: L.OneCycleLR(o, [0.1], total_steps=10), ValueError,
     "max_lr must have the same length as optimizer.param_groups. max_lr has 1 values, "
     "param_groups has 2."),
    (lambda o: L.OneCycleLR(o, 0.1, total_steps=10, max_momentum=[0.9]), ValueError,
     "max_momentum must have the same length as optimizer.param_groups"),
    (lambda o: L.OneCycleLR(o, 0.1, total_steps=10, div_factor=0), ValueError,
     "div_factor must be > 0.0"),
    (lambda o: L.OneCycleLR(o, 0.1, total_steps=10, base_momentum=-0.5), ValueError,
     "^base_momentum must be >= 0.0, got -0.5$"),
    (lambda o: L.OneCycleLR(o, [0.1, 0.2], total_steps=10, max_momentum=[0.9, "x"]),
     TypeError, r"max_momentum\[1\] must be a real number"),
    (lambda o: L.ReduceLROnPlateau(o, factor=1.0), ValueError, r"^Factor should be < 1.0.$"),
    (lambda o: L.ReduceLROnPlateau(o, factor=-0.5), ValueError, "factor must be >= 0.0"),
    (lambda o: L.ReduceLROnPlateau(o, mode="avg"), ValueError, "^mode avg is unknown!$"),
    (lambda o: L.ReduceLROnPlateau(o, threshold_mode="x"), ValueError,
     "^threshold mode x is unknown!$"),
    (lambda o: L.ReduceLROnPlateau(o, min_lr=[0.1]), ValueError, "^expected 2 min_lrs, got 1$"),
    (lambda o: L.ReduceLROnPlateau(o, patience=-1), ValueError, "patience must be an integer >= 0"),
    (lambda o: L.ReduceLROnPlateau(o, cooldown=1.5), TypeError, "cooldown must be an integer"),
]


@pytest.mark.parametrize("make, error, message", ARGUMENT_ERRORS)
def test_bad_arguments(make, error, message):
    """A clear error, raised before any group is changed."""
    opt = flat_optimizer("sgd", [0.1, 0.2])
    before = group_values(opt)
    with pytest.raises(error, match=message):
        make(opt)
    assert group_values(opt) == before


@pytest.mark.parametrize("make, torch_make", [
    (lambda o: L.ConstantLR(o, factor=1.5),
     lambda t, o: t.ConstantLR(o, factor=1.5)),
    (lambda o: L.LinearLR(o, start_factor=0),
     lambda t, o: t.LinearLR(o, start_factor=0)),
    (lambda o: L.ReduceLROnPlateau(o, mode="avg"),
     lambda t, o: t.ReduceLROnPlateau(o, mode="avg")),
    (lambda o: L.OneCycleLR(o, 0.1, total_steps=10, pct_start=0),
     lambda t, o: t.OneCycleLR(o, 0.1, total_steps=10, pct_start=0)),
    (lambda o: L.CosineAnnealingWarmRestarts(o, T_0=0),
     lambda t, o: t.CosineAnnealingWarmRestarts(o, T_0=0)),
])
def test_messages_are_torchs_where_torch_checks(make, torch_make):
    torch = pytest.importorskip("torch")
    flat_opt, torch_opt = pair("sgd", [0.1, 0.2])
    with pytest.raises(ValueError) as ours:
        make(flat_opt)
    with pytest.raises(ValueError) as theirs:
        torch_make(torch.optim.lr_scheduler, torch_opt)
    assert str(ours.value) == str(theirs.value)


def test_one_cycle_zero_length_phase_is_refused_where_torch_divides_by_zero():
    torch = pytest.importorskip("torch")
    flat_opt, torch_opt = pair("sgd", [0.1])
    with pytest.raises(ZeroDivisionError):
        torch.optim.lr_scheduler.OneCycleLR(torch_opt, 0.1, total_steps=10, pct_start=0.1)
    before = group_values(flat_opt)
    with pytest.raises(ValueError, match="phase 1 of the schedule has zero length"):
        L.OneCycleLR(flat_opt, 0.1, total_steps=10, pct_start=0.1)
    assert group_values(flat_opt) == before
    L.OneCycleLR(flat_opt, 0.1, total_steps=10, pct_start=0.25)  # fine


def test_one_cycle_momentum_errors():
    class Plain:  # neither momentum nor betas
        param_groups = [{"lr": 0.1}]
        defaults = {"lr": 0.1}
    with pytest.raises(ValueError, match="optimizer must support momentum or beta1 with "
                                         "`cycle_momentum` option enabled"):
        L.OneCycleLR(Plain(), 0.1, total_steps=10)
    L.OneCycleLR(Plain(), 0.1, total_steps=10, cycle_momentum=False)
    adam = flat_optimizer("adam", [0.1])
    before = group_values(adam)
    with pytest.raises(flatopt.HyperparameterError, match=r"max_momentum=1.0 would be "
                                                          r"written into betas.*beta1"):
        L.OneCycleLR(adam, 0.1, total_steps=10, max_momentum=1.0)
    assert group_values(adam) == before


def test_sequential_errors():
    opt = flat_optimizer("sgd", [0.1])
    other = flat_optimizer("sgd", [0.1])
    a, b = L.StepLR(opt, 2), L.ExponentialLR(opt, 0.9)
    cases = [
        (([], []), ValueError,
         "SequentialLR expects at least one scheduler, but got no scheduler."),
        (([a, b], []), ValueError, "Sequential Schedulers expects number of schedulers provided "
                                   "to be one more than the number of milestone points"),
        (([a, L.ReduceLROnPlateau(opt)], [3]), ValueError,
         "SequentialLR does not support `ReduceLROnPlateau` scheduler"),
        (([a, L.StepLR(other, 2)], [3]), ValueError,
         "SequentialLR expects all schedulers to belong to the same optimizer"),
        (([a, "StepLR"], [3]), TypeError, "SequentialLR at index 1 should have `optimizer`"),
        (([a, b], [0]), ValueError, r"milestones\[0\] must be an integer >= 1"),
        (([a, b, L.StepLR(opt, 3)], [5, 5]), ValueError, "strictly increasing"),
        (([a, b], [2.5]), TypeError, r"milestones\[0\] must be an integer"),
    ]
    for (children, milestones), error, message in cases:
        with pytest.raises(error, match=message):
            L.SequentialLR(opt, children, milestones)
    inner = L.SequentialLR(opt, [a, b], [3])
    with pytest.raises(ValueError, match="nesting is not supported"):
        L.SequentialLR(opt, [L.StepLR(opt, 2), inner], [3])


def test_step_past_one_cycle_and_bad_epochs_change_nothing():
    opt = flat_optimizer("sgd", [0.1])
    sched = L.StepLR(opt, 2)
    before = sched.state_dict()
    with pytest.raises(TypeError, match="epoch must be an integer"):
        sched.step(1.5)
    with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
        sched.step(-3)
    assert sched.state_dict() == before
    plateau = L.ReduceLROnPlateau(opt)
    with pytest.raises(TypeError, match="metrics must be a number"):
        plateau.step("0.5")
    plateau.step(np.float32(0.5))  # numpy scalars (and 0-d arrays) are numbers
    assert plateau.best == 0.5


def test_a_schedule_ending_at_zero_never_stops_training():
    """torch's chained LinearLR rounds its last lr to -1.48e-18; the group gets
    0.0 there (the optimizer refuses a negative lr) and torch's numbers everywhere else. A
    negative lr beyond rounding (a subclass's bug) still reaches the optimizer, which refuses
    it."""
    torch = pytest.importorskip("torch")
    flat_opt, torch_opt = pair("sgd", [0.1, 7.0])
    ours = L.LinearLR(flat_opt, start_factor=1 / 3, end_factor=0, total_iters=5)
    theirs = torch.optim.lr_scheduler.LinearLR(torch_opt, start_factor=1 / 3, end_factor=0,
                                               total_iters=5)
    clamped = 0
    for step in range(8):
        flat_opt.step({"p0": np.ones(2, np.float32), "p1": np.ones(2, np.float32)})
        torch_opt.step()
        ours.step()
        theirs.step()
        expected = [0.0 if lr < 0 else lr for lr in theirs.get_last_lr()]
        clamped += expected != theirs.get_last_lr()
        assert ours.get_last_lr() == expected, step
        assert [g["lr"] for g in flat_opt.param_groups] == expected, step
    assert clamped  # torch did go below zero

    class Negative(L.LRScheduler):
        def get_lr(self):
            return [-0.5 * self.last_epoch * base for base in self.base_lrs]

    opt = flat_optimizer("sgd", [0.1])
    Negative(opt).step()
    assert opt.param_groups[0]["lr"] == -0.05
    with pytest.raises(flatopt.HyperparameterError, match="lr"):
        opt.step({"p0": np.ones(2, np.float32)})


def test_added_param_group_is_refused_at_step():
    opt = flat_optimizer("sgd", [0.1])
    sched = L.CosineAnnealingLR(opt, T_max=10)
    opt.add_param_group({"params": {"extra": np.zeros(1, np.float32)}, "lr": 0.5})
    with pytest.raises(ValueError, match="built for 1 param groups, but the optimizer now has 2"):
        sched.step()
    assert sched.last_epoch == 0
    # ReduceLROnPlateau follows torch: a scalar min_lr covers the new group
    opt = flat_optimizer("sgd", [0.1])
    plateau = L.ReduceLROnPlateau(opt, patience=0)
    opt.add_param_group({"params": {"extra": np.zeros(1, np.float32)}, "lr": 0.5})
    plateau.step(1.0)
    plateau.step(2.0)
    assert plateau.get_last_lr() == [0.1 * 0.1, 0.5 * 0.1]
    listed = L.ReduceLROnPlateau(flat_optimizer("sgd", [0.1]), min_lr=[0.0], patience=0)
    listed.optimizer.add_param_group({"params": {"x": np.zeros(1, np.float32)}, "lr": 0.5})
    with pytest.raises(RuntimeError, match=r"The number of param groups in the `optimizer` \(2\)"):
        listed.step(1.0)


def test_load_state_dict_errors_change_nothing():
    opt = flat_optimizer("sgd", [0.1, 0.2])
    sched = L.StepLR(opt, 3)
    sched.step()
    good = sched.state_dict()
    bad_cases = [
        ([1, 2], "takes the dict state_dict"),
        ({**good, "scheduler": "ExponentialLR"}, "from 'ExponentialLR', not 'StepLR'"),
        ({k: v for k, v in good.items() if k != "gamma"}, r"missing \['gamma'\]"),
        ({**good, "lr_lambdas": None}, "unknown 'lr_lambdas'"),
        ({**good, "gamma": "x"}, "gamma must be a real number"),
        ({**good, "step_size": 0}, "step_size must be an integer >= 1"),
        ({**good, "base_lrs": [0.1]}, "base_lrs must have one value per param group"),
        ({**good, "last_epoch": 1.0}, "last_epoch must be an integer"),
        ({**good, "base_lrs": [0.1, float("nan")]}, r"base_lrs\[1\] must be finite"),
    ]
    for state, message in bad_cases:
        with pytest.raises(StateDictError, match=message):
            sched.load_state_dict(state)
        assert sched.state_dict() == good
    seq = L.SequentialLR(opt, [L.StepLR(opt, 2), L.ExponentialLR(opt, 0.9)], [4])
    state = seq.state_dict()
    state["_schedulers"][1]["gamma"] = -1
    before = seq.state_dict()
    with pytest.raises(StateDictError, match=r"_schedulers\[1\].*gamma must be >= 0"):
        seq.load_state_dict(state)
    assert seq.state_dict() == before
    plateau = L.ReduceLROnPlateau(opt)
    with pytest.raises(StateDictError, match="best must be a number"):
        plateau.load_state_dict({**plateau.state_dict(), "best": None})
    # OneCycleLR: an SGD schedule (momentum) into an Adam one (betas), and momentum bounds
    # the optimizer refuses
    sgd_cycle = L.OneCycleLR(flat_optimizer("sgd", [0.1]), 1.0, total_steps=20)
    adam_cycle = L.OneCycleLR(flat_optimizer("adam", [0.1]), 1.0, total_steps=20)
    before = adam_cycle.state_dict()
    with pytest.raises(StateDictError, match="the state cycles momentum, but this Adam has "
                                             "betas"):
        adam_cycle.load_state_dict(sgd_cycle.state_dict())
    with pytest.raises(StateDictError, match=r"max_momentum=1.0 would be written into betas"):
        adam_cycle.load_state_dict({**before, "max_momentums": [1.0]})
    assert adam_cycle.state_dict() == before
    # A position past the schedule's end is no state a run reaches (its
    # next step would fail); total_steps itself is the last one
    for last_epoch in (10 ** 30, 21):
        with pytest.raises(StateDictError, match=f"last_epoch {last_epoch} is past"):
            adam_cycle.load_state_dict({**before, "last_epoch": last_epoch})
        assert adam_cycle.state_dict() == before
    adam_cycle.load_state_dict({**before, "last_epoch": 20})
    with pytest.raises(ValueError, match="Tried to step 21 times"):
        adam_cycle.step()


# ----------------------------------------------------------------------------- flatopt specifics
def test_owned_hyperparameters():
    sgd, adam = flat_optimizer("sgd", [0.1]), flat_optimizer("adam", [0.1])
    assert L.StepLR(sgd, 2).owned_hyperparameters == ("lr",)
    assert L.ReduceLROnPlateau(sgd).owned_hyperparameters == ("lr",)
    assert L.OneCycleLR(sgd, 1.0, total_steps=20).owned_hyperparameters == ("lr", "momentum")
    assert L.OneCycleLR(adam, 1.0, total_steps=20).owned_hyperparameters == ("lr", "betas")
    assert L.OneCycleLR(adam, 1.0, total_steps=20, cycle_momentum=False) \
        .owned_hyperparameters == ("lr",)
    seq = L.SequentialLR(adam, [L.LinearLR(adam), L.OneCycleLR(adam, 1.0, total_steps=20)],
                         [5])
    assert seq.owned_hyperparameters == ("lr", "betas")
    with pytest.raises(AttributeError):
        seq.owned_hyperparameters = ("lr",)


def test_optimizer_step_is_not_wrapped():
    opt = flat_optimizer("sgd", [0.1])
    L.StepLR(opt, 2)
    L.OneCycleLR(opt, 1.0, total_steps=10)
    assert "step" not in vars(opt) and opt.step.__func__ is type(opt).step


def test_get_lr_outside_step_warns_and_get_last_lr_is_a_copy():
    opt = flat_optimizer("sgd", [0.1])
    sched = L.ExponentialLR(opt, 0.5)
    with pytest.warns(UserWarning, match="please use `get_last_lr\\(\\)`"):
        sched.get_lr()
    last = sched.get_last_lr()
    last[0] = 99.0
    assert sched.get_last_lr() == [0.1]


def test_state_dict_is_json_data_for_every_scheduler():
    rng = random.Random(0)
    for name in ALL:
        opt = flat_optimizer(rng.choice(["sgd", "adam"]), group_specs(rng, 2))
        sched = build(name, opt, rng)
        for step in range(3):
            state = sched.state_dict()
            assert is_json_data(state), (name, state)
            assert json.loads(json.dumps(state, allow_nan=True)) == state
            assert "optimizer" not in state
            advance(sched, 1, [1.0 - step])
