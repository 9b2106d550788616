"""LambdaLR and MultiplicativeLR: torch 2.13's lr sequences (compared with ==), torch's
``lr_lambdas`` state (None for a function, a callable object's attributes), JSON round trips
and checkpoints mid-schedule, and their errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import flatopt
from flatopt import StateDictError
from flatopt import lr_scheduler as L

from test_lr_scheduler import flat_optimizer, pair, run_both


def linear_warmup_then_decay(warmup: int, total: int):
    """transformers.get_linear_schedule_with_warmup's lambda."""
    def factor(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    return factor


class Decay:
    """A callable object with state: its attributes are saved (torch's rule)."""

    def __init__(self, rate: float):
        self.rate = rate
        self.calls = 0

    def __call__(self, step: int) -> float:
        self.calls += 1
        return self.rate ** (step % 7)


CASES = {
    "LambdaLR": lambda: [linear_warmup_then_decay(10, 150),
                         lambda step: 0.5 * (1 + math.cos(math.pi * step / 150))],
    "MultiplicativeLR": lambda: [lambda step: 0.97, lambda step: 1.0 if step % 10 else 0.5],
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("shared", [False, True])
def test_conformance_with_torch(name, shared):
    torch = pytest.importorskip("torch")
    flat_opt, torch_opt = pair("adam", [0.1, 0.02])
    functions = CASES[name]()
    lr_lambda = functions[0] if shared else functions
    ours = getattr(L, name)(flat_opt, lr_lambda)
    theirs = getattr(torch.optim.lr_scheduler, name)(torch_opt, lr_lambda)
    run_both(ours, theirs, flat_opt, torch_opt, 160)
    assert ours.state_dict()["lr_lambdas"] == theirs.state_dict()["lr_lambdas"] == [None, None]


@pytest.mark.parametrize("name", CASES)
def test_a_callable_objects_attributes_are_saved_and_restored_as_in_torch(name):
    torch = pytest.importorskip("torch")
    flat_opt, torch_opt = pair("sgd", [0.1, 0.2])
    ours = getattr(L, name)(flat_opt, [Decay(0.9), lambda step: 0.99])
    theirs = getattr(torch.optim.lr_scheduler, name)(torch_opt, [Decay(0.9), lambda step: 0.99])
    run_both(ours, theirs, flat_opt, torch_opt, 20)
    saved = ours.state_dict()
    assert saved["lr_lambdas"] == theirs.state_dict()["lr_lambdas"]
    assert saved["lr_lambdas"][0] == {"rate": 0.9, "calls": ours.lr_lambdas[0].calls}
    # resume from JSON in a fresh pair: the object's attributes come back, the sequence goes on
    state = flat_opt.state_dict()
    expected = []
    for _ in range(15):
        ours.step()
        expected.append(ours.get_last_lr())
    fresh_opt = flat_optimizer("sgd", [0.1, 0.2])
    fresh = getattr(L, name)(fresh_opt, [Decay(0.5), lambda step: 0.99])
    fresh_opt.load_state_dict(state)
    fresh.load_state_dict(json.loads(json.dumps(saved)))
    assert vars(fresh.lr_lambdas[0]) == saved["lr_lambdas"][0]
    resumed = []
    for _ in range(15):
        fresh.step()
        resumed.append(fresh.get_last_lr())
    assert resumed == expected


def test_resume_from_a_checkpoint_continues_the_sequence(tmp_path):
    def run(opt, sched, steps):
        lrs = []
        for _ in range(steps):
            opt.step({path: np.ones_like(view) for path, view in opt.params.items()})
            sched.step()
            lrs.append(sched.get_last_lr())
        return lrs

    opt = flat_optimizer("adam", [0.1, 0.02])
    sched = L.LambdaLR(opt, linear_warmup_then_decay(5, 40))
    run(opt, sched, 12)
    flatopt.save(tmp_path / "ck.h5", opt, scheduler=sched)
    rest = run(opt, sched, 20)
    resumed_opt = flat_optimizer("adam", [0.1, 0.02])
    resumed = L.LambdaLR(resumed_opt, linear_warmup_then_decay(5, 40))
    flatopt.load(tmp_path / "ck.h5", resumed_opt, scheduler=resumed)
    assert run(resumed_opt, resumed, 20) == rest
    for path, view in opt.params.items():
        assert resumed_opt.params[path].tobytes() == view.tobytes()


@pytest.mark.parametrize("name", CASES)
def test_errors(name):
    cls = getattr(L, name)
    opt = flat_optimizer("sgd", [0.1, 0.2])
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match="^Expected 2 lr_lambdas, but got 1$"):
        cls(opt, [lambda step: 1.0])
    with pytest.raises(TypeError, match="lr_lambda should be a function, but got float"):
        cls(opt, 0.5)
    unsaveable = Decay(0.9)
    unsaveable.cache = {1: 2}  # an int key: not JSON data, so it could never be saved
    with pytest.raises(TypeError, match="state keys must be strings"):
        cls(opt, unsaveable)
    assert [dict(g) for g in opt.param_groups] == before
    sched = cls(opt, [Decay(0.9), lambda step: 0.9])
    sched.step()
    saved = sched.state_dict()
    other = cls(flat_optimizer("sgd", [0.1, 0.2]), [lambda step: 0.9, lambda step: 0.9])
    with pytest.raises(StateDictError, match=r"lr_lambdas\[0\] was saved from a callable "
                                             "object, but this scheduler's is a function"):
        other.load_state_dict(saved)
    state = dict(saved, lr_lambdas=[None])
    with pytest.raises(StateDictError, match="lr_lambdas must be a list of 2 entries"):
        sched.load_state_dict(state)
    last = sched.get_last_lr()
    assert sched.state_dict() == saved and sched.get_last_lr() == last


def test_get_lr_outside_step_warns_as_torch():
    opt = flat_optimizer("sgd", [0.1])
    sched = L.LambdaLR(opt, lambda step: 0.5)
    with pytest.warns(UserWarning, match="get_last_lr"):
        sched.get_lr()


def test_warm_up_by_lambda_then_cosine_in_a_sequence_matches_torch():
    torch = pytest.importorskip("torch")
    flat_opt, torch_opt = pair("adam", [0.1, 0.02])
    warm_up = linear_warmup_then_decay(10, 10)
    ours = L.SequentialLR(flat_opt, [L.LambdaLR(flat_opt, warm_up),
                                     L.CosineAnnealingLR(flat_opt, 50)], [10])
    T = torch.optim.lr_scheduler
    theirs = T.SequentialLR(torch_opt, [T.LambdaLR(torch_opt, warm_up),
                                        T.CosineAnnealingLR(torch_opt, 50)], [10])
    run_both(ours, theirs, flat_opt, torch_opt, 80)
    ours.load_state_dict(json.loads(json.dumps(ours.state_dict())))
    assert ours.get_last_lr() == theirs.get_last_lr()


# ----------------------------------------------------------------------------- ChainedScheduler
@pytest.mark.parametrize("case", range(3))
def test_chained_scheduler_matches_torch(case):
    torch = pytest.importorskip("torch")
    T = torch.optim.lr_scheduler
    flat_opt, torch_opt = pair("sgd", [0.1, 0.3])

    def children(module, opt):
        if case == 0:
            return [module.ExponentialLR(opt, 0.97), module.StepLR(opt, 7, 0.5)]
        if case == 1:
            return [module.LinearLR(opt, 0.1, total_iters=10),
                    module.CosineAnnealingLR(opt, 40, 1e-4)]
        return [module.LambdaLR(opt, linear_warmup_then_decay(5, 60)),
                module.MultiplicativeLR(opt, lambda step: 0.99)]

    ours = L.ChainedScheduler(children(L, flat_opt))
    theirs = T.ChainedScheduler(children(T, torch_opt))
    run_both(ours, theirs, flat_opt, torch_opt, 60)
    saved = ours.state_dict()
    assert set(saved) == {"scheduler", *theirs.state_dict()}
    rest = []
    for _ in range(10):
        ours.step()
        rest.append(ours.get_last_lr())
    fresh_opt = flat_optimizer("sgd", [0.1, 0.3])
    fresh = L.ChainedScheduler(children(L, fresh_opt), optimizer=fresh_opt)
    fresh.load_state_dict(json.loads(json.dumps(saved)))
    for group, lr in zip(fresh_opt.param_groups, saved["_last_lr"]):
        group["lr"] = lr  # the optimizer's own state would bring these back
    again = []
    for _ in range(10):
        fresh.step()
        again.append(fresh.get_last_lr())
    assert again == rest


def test_chained_scheduler_errors_are_torchs_and_change_nothing():
    opt = flat_optimizer("sgd", [0.1, 0.2])
    other = flat_optimizer("sgd", [0.1, 0.2])
    with pytest.raises(ValueError, match="expects at least one scheduler"):
        L.ChainedScheduler([])
    with pytest.raises(ValueError, match="does not support `ReduceLROnPlateau`"):
        L.ChainedScheduler([L.StepLR(opt, 2), L.ReduceLROnPlateau(opt)])
    with pytest.raises(ValueError, match="expects all schedulers to belong to the same"):
        L.ChainedScheduler([L.StepLR(opt, 2), L.StepLR(other, 2)])
    chain = L.ChainedScheduler([L.ExponentialLR(opt, 0.9), L.StepLR(opt, 2)])
    opt.add_param_group({"params": {"new": np.zeros(2, np.float32)}, "lr": 0.1})
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match="built for 2 param groups"):
        chain.step()
    assert [dict(g) for g in opt.param_groups] == before
    assert chain._schedulers[0].last_epoch == 0  # the first child did not step either


# ----------------------------------------------------------------------------- CyclicLR
class Halving:
    """A custom scale_fn object with state."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return 1 / (2.0 ** (x - 1))


def cyclic_configs():
    yield {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 7}
    yield {"base_lr": [0.01, 0.02], "max_lr": [0.1, 0.3], "step_size_up": 5,
           "step_size_down": 9, "mode": "triangular2"}
    yield {"base_lr": 0.001, "max_lr": 0.05, "step_size_up": 4, "mode": "exp_range",
           "gamma": 0.97, "base_momentum": [0.7, 0.75], "max_momentum": 0.95}
    yield {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 3.5, "scale_fn": lambda x: 0.9 ** x,
           "scale_mode": "iterations", "cycle_momentum": False}
    yield {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 6, "step_size_down": 0}


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("number", range(5))
def test_cyclic_lr_matches_torch(kind, number):
    torch = pytest.importorskip("torch")
    config = list(cyclic_configs())[number]
    flat_opt, torch_opt = pair(kind, [0.1, 0.2])
    ours = L.CyclicLR(flat_opt, **config)
    theirs = torch.optim.lr_scheduler.CyclicLR(torch_opt, **config)
    # torch writes max_momentum/base_momentum into its groups; flatopt keeps them in its state
    for group in torch_opt.param_groups:
        group.pop("max_momentum", None), group.pop("base_momentum", None)
    run_both(ours, theirs, flat_opt, torch_opt, 45)
    mine, torchs = ours.state_dict(), theirs.state_dict()
    for key in ("max_lrs", "total_size", "step_ratio", "mode", "gamma", "scale_mode",
                "cycle_momentum", "base_lrs", "last_epoch", "_last_lr"):
        assert mine[key] == torchs[key], key


def test_cyclic_lr_resumes_through_json_with_a_callable_scale_fn():
    opt = flat_optimizer("sgd", [0.1, 0.2])
    sched = L.CyclicLR(opt, 0.01, 0.1, step_size_up=3, scale_fn=Halving())
    for _ in range(10):
        sched.step()
    saved = json.loads(json.dumps(sched.state_dict()))
    assert saved["_scale_fn_custom"] == {"calls": sched._scale_fn.calls}
    state = opt.state_dict()
    expected = []
    for _ in range(12):
        sched.step()
        expected.append((sched.get_last_lr(), opt.param_groups[0]["momentum"]))
    fresh_opt = flat_optimizer("sgd", [0.1, 0.2])
    fresh = L.CyclicLR(fresh_opt, 0.01, 0.1, step_size_up=3, scale_fn=Halving())
    fresh_opt.load_state_dict(state)
    fresh.load_state_dict(saved)
    assert fresh._scale_fn.calls == saved["_scale_fn_custom"]["calls"]
    resumed = []
    for _ in range(12):
        fresh.step()
        resumed.append((fresh.get_last_lr(), fresh_opt.param_groups[0]["momentum"]))
    assert resumed == expected
    plain = L.CyclicLR(flat_optimizer("sgd", [0.1, 0.2]), 0.01, 0.1, step_size_up=3)
    with pytest.raises(StateDictError, match="_scale_fn_custom was saved from a callable"):
        plain.load_state_dict(saved)


@pytest.mark.parametrize("make, error, message", [
    (lambda o: L.CyclicLR(o, 0.01, 0.1, mode="sawtooth"), ValueError,
     "^mode is invalid and scale_fn is None$"),
    (lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=0), ValueError,
     "step_size_up must be > 0.0"),
    (lambda o: L.CyclicLR(o, [0.01], 0.1), ValueError,
     "base_lr must have the same length as optimizer.param_groups"),
    (lambda o: L.CyclicLR(o, 0.01, 0.1, scale_fn=lambda x: 1.0, scale_mode="epochs"),
     ValueError, "scale_mode must be one of"),
    (lambda o: L.CyclicLR(o, -0.01, 0.1), ValueError, "base_lr must be >= 0.0"),
])
def test_cyclic_lr_errors_change_nothing(make, error, message):
    opt = flat_optimizer("sgd", [0.1, 0.2])
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(error, match=message):
        make(opt)
    assert [dict(g) for g in opt.param_groups] == before


def test_cyclic_lr_refuses_momentums_the_optimizer_would_refuse():
    opt = flat_optimizer("adam", [0.1, 0.2])
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(flatopt.HyperparameterError,
                       match=r"CyclicLR max_momentum=1.0 would be written into betas"):
        L.CyclicLR(opt, 0.01, 0.1, max_momentum=1.0)
    assert [dict(g) for g in opt.param_groups] == before


def test_cyclic_lr_needs_momentum_or_betas_to_cycle_momentum():
    opt = flatopt.Adagrad({"w": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="optimizer must support momentum or beta1"):
        L.CyclicLR(opt, 0.01, 0.1)
    sched = L.CyclicLR(opt, 0.01, 0.1, cycle_momentum=False)
    assert sched.owned_hyperparameters == ("lr",)
