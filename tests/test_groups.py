"""Parameter groups: per-group hyperparameters (validated in the constructor, in overrides and
at every step), add_param_group and group_by_pattern."""

from __future__ import annotations

import re

import numpy as np
import pytest

import flatopt
from flatopt import GroupAssignmentError, HyperparameterError, ParamError


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------- the seeds' fixtures
def test_seed_sgd_groups_override_default_lr():
    """0.5*(2w+b-4)^2 at w=1, b=0: gradients -4 and -2; group lrs 0.1 and 0.01 over lr=1."""
    opt = flatopt.SGD([{"params": {"w": np.array(1.0)}, "lr": 0.1},
                       {"params": {"b": np.array(0.0)}, "lr": 0.01}], lr=1.0)
    opt.zero_grad(set_to_none=True)
    w, b = float(opt.params["w"]), float(opt.params["b"])
    residual = 2 * w + b - 4
    opt.step({"w": np.array(2 * residual), "b": np.array(residual)})
    assert f"{float(opt.params['w']):.6f}" == "1.400000"
    assert f"{float(opt.params['b']):.6f}" == "0.020000"
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]


# ---------------------------------------------------------------------------- hyperparameters
def test_unknown_hyperparameter_suggests_the_near_name():
    with pytest.raises(HyperparameterError, match="'weight_decy'.*did you mean 'weight_decay'"):
        flatopt.AdamW({"a": f32(2)}, weight_decy=0.1)
    with pytest.raises(HyperparameterError,
                       match="param group 1 \\('head'\\): unknown hyperparameter 'momentun'"):
        flatopt.SGD([{"params": {"a": f32(2)}}, {"params": {"b": f32(2)}, "label": "head",
                                                 "momentun": 0.9}])


@pytest.mark.parametrize("cls, kwargs, key", [
    (flatopt.SGD, dict(lr=-0.1), "lr"),
    (flatopt.SGD, dict(momentum=-0.5), "momentum"),
    (flatopt.SGD, dict(weight_decay=-1e-4), "weight_decay"),
    (flatopt.SGD, dict(dampening=1.5), "dampening"),
    (flatopt.SGD, dict(nesterov=True), "nesterov"),
    (flatopt.SGD, dict(nesterov=True, momentum=0.9, dampening=0.1), "nesterov"),
    (flatopt.SGD, dict(lr=float("nan")), "lr"),
    (flatopt.SGD, dict(lr="0.1"), "lr"),
    (flatopt.SGD, dict(maximize=1), "maximize"),
    (flatopt.Adam, dict(betas=(1.0, 0.999)), "betas"),
    (flatopt.Adam, dict(betas=(0.9, -0.1)), "betas"),
    (flatopt.Adam, dict(betas=(0.9,)), "betas"),
    (flatopt.Adam, dict(eps=-1e-8), "eps"),
    (flatopt.AdamW, dict(weight_decay=-0.01), "weight_decay"),
    (flatopt.Adam, dict(amsgrad="yes"), "amsgrad"),
])
def test_invalid_values_raise_in_constructor_and_in_group_overrides(cls, kwargs, key):
    with pytest.raises(HyperparameterError, match=f"{cls.__name__}\\(\\): .*{key}"):
        cls({"a": f32(2)}, **kwargs)
    with pytest.raises(HyperparameterError, match=f"param group 1 \\('bad'\\): .*{key}"):
        cls([{"params": {"a": f32(2)}}, {"params": {"b": f32(2)}, "label": "bad", **kwargs}])


def test_a_group_override_beats_the_default_and_a_group_may_carry_a_label():
    opt = flatopt.AdamW([{"params": {"a": f32(2)}, "weight_decay": 0.0, "label": "no_decay"},
                         {"params": {"b": f32(2)}}], lr=0.01)
    assert opt.param_groups[0]["weight_decay"] == 0.0 and opt.param_groups[0]["label"] == "no_decay"
    assert opt.param_groups[1]["weight_decay"] == 0.01 and opt.param_groups[1]["lr"] == 0.01


def test_lr_changed_in_param_groups_takes_effect_on_the_next_step():
    opt = flatopt.SGD({"a": np.array([1.0])}, lr=0.1)
    opt.step({"a": np.array([1.0])})
    opt.param_groups[0]["lr"] = 0.5
    opt.step({"a": np.array([1.0])})
    assert opt.params["a"][0] == pytest.approx(1.0 - 0.1 - 0.5)


def test_an_invalid_value_set_mid_run_raises_at_step_and_changes_nothing():
    opt = flatopt.Adam({"a": f32(3)}, lr=0.1)
    opt.step({"a": f32(3, seed=1)})
    before = opt.state_dict()
    opt.param_groups[0]["betas"] = (0.9, 1.5)
    with pytest.raises(HyperparameterError, match="param group 0: betas"):
        opt.step({"a": f32(3, seed=2)})
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    opt.param_groups[0]["weight_decy"] = 0.1
    with pytest.raises(HyperparameterError, match="did you mean 'weight_decay'"):
        opt.step({"a": f32(3, seed=2)})
    after = opt.state_dict()
    np.testing.assert_array_equal(after["state"]["a"]["exp_avg"], before["state"]["a"]["exp_avg"])
    assert after["state"]["a"]["step"] == 1


def test_values_changed_in_place_or_retyped_are_seen_and_validated_at_the_next_step():
    opt = flatopt.Adam({"a": np.ones(3)}, lr=0.1)
    opt.param_groups[0]["betas"] = [0.9, 0.999]  # as a scheduler might set it
    opt.step({"a": np.ones(3)})
    opt.param_groups[0]["betas"][0] = 0.0  # a list mutated in place
    opt.step({"a": np.full(3, 5.0)})
    np.testing.assert_array_equal(opt.state_of("a").exp_avg, 5.0)  # beta1 = 0: m = g
    opt.param_groups[0]["betas"][0] = 5.0
    with pytest.raises(HyperparameterError, match="beta1"):
        opt.step({"a": np.ones(3)})
    opt.param_groups[0]["betas"] = np.array([0.9, 0.999])  # arrays are fine, and checked
    opt.step({"a": np.ones(3)})
    opt.param_groups[0]["amsgrad"] = 0  # equal to False, but not a bool
    with pytest.raises(HyperparameterError, match="amsgrad"):
        opt.step({"a": np.ones(3)})


def test_a_scheduled_value_is_checked_alone_and_used_at_once():
    """A changed lr is re-checked by itself (a scheduler's every step), with the same messages
    and cross-checks as a whole group; other keys stay as validated."""
    opt = flatopt.SGD([{"params": {"a": np.ones(3)}, "label": "x"}], lr=0.5, momentum=0.9,
                      nesterov=True)
    group = opt.param_groups[0]
    group["lr"] = 0.25
    assert opt.settings()[0] == {**opt.settings()[0], "lr": 0.25, "momentum": 0.9,
                                 "label": "x"}
    group["lr"] = -1.0
    with pytest.raises(HyperparameterError, match=r"param group 0 \('x'\): lr=-1.0 is invalid"):
        opt.step({"a": np.ones(3)})
    group["lr"] = 0.25
    group["momentum"] = 0.0  # nesterov needs momentum: the cross-check still runs
    with pytest.raises(HyperparameterError, match="nesterov"):
        opt.settings()
    group.update(momentum=0.0, nesterov=False, label=None)
    assert "label" not in opt.settings()[0]
    opt.step({"a": np.ones(3)})
    np.testing.assert_array_equal(opt.params["a"], 0.75)
    group["lr"] = 0.5  # the next step's plan has the new scalars
    opt.step({"a": np.ones(3)})
    np.testing.assert_array_equal(opt.params["a"], 0.25)
    group["lr_typo"] = 0.1  # a new key: the whole group is checked
    with pytest.raises(HyperparameterError, match="unknown hyperparameter 'lr_typo'"):
        opt.step({"a": np.ones(3)})


def test_replacing_a_groups_params_is_refused():
    opt = flatopt.SGD({"a": f32(2)})
    opt.param_groups[0]["params"] = ["a", "b"]
    with pytest.raises(HyperparameterError, match="add_param_group"):
        opt.step()


# ---------------------------------------------------------------------------- add_param_group
def test_add_param_group_leaves_existing_buffers_views_and_state_alone():
    opt = flatopt.Adam({"a": f32(3)}, lr=0.1)
    opt.step({"a": f32(3, seed=1)})
    view, flat, state = opt.params["a"], opt.buffers[0].params, opt.state_dict()
    opt.add_param_group({"params": {"b": f32(4, seed=2)}, "lr": 0.01, "label": "new"})
    assert opt.params["a"] is view and opt.buffers[0].params is flat
    assert opt.index["b"].id == 1 and opt.index["b"].group == 1
    np.testing.assert_array_equal(opt.state_of("a").exp_avg, state["state"]["a"]["exp_avg"])
    opt.step({"a": f32(3, seed=1), "b": f32(4, seed=3)})
    assert opt.state_of("a").step == 2 and opt.state_of("b").step == 1
    with pytest.raises(ParamError, match="'b' appears more than once"):
        opt.add_param_group({"params": {"b": f32(4), "c": f32(1)}})
    with pytest.raises(HyperparameterError, match="param group 2"):
        opt.add_param_group({"params": {"c": f32(1)}, "lr": -1.0})
    assert len(opt.param_groups) == 2 and "c" not in opt.index


# ---------------------------------------------------------------------------- grouping helper
def test_group_by_pattern_assigns_every_parameter_once():
    params = {"enc.0.weight": f32(2), "enc.0.bias": f32(2), "enc.norm.scale": f32(2),
              "head.weight": f32(2)}
    groups = flatopt.group_by_pattern(params, [
        {"match": ["*.bias", "*norm*"], "weight_decay": 0.0, "label": "no_decay"}],
        rest={"label": "decay"})
    opt = flatopt.AdamW(groups, weight_decay=0.1)
    assert opt.param_groups[0]["params"] == ("enc.0.bias", "enc.norm.scale")
    assert opt.param_groups[0]["weight_decay"] == 0.0
    assert opt.param_groups[1]["params"] == ("enc.0.weight", "head.weight")
    assert opt.param_groups[1]["weight_decay"] == 0.1


def test_group_by_pattern_lists_every_unmatched_and_ambiguous_path():
    params = {"a.weight": f32(1), "a.bias": f32(1), "norm.bias": f32(1), "b.weight": f32(1)}
    with pytest.raises(GroupAssignmentError) as info:
        flatopt.group_by_pattern(params, [{"match": "*.bias"}, {"match": ["norm*"]}])
    message = str(info.value)
    assert "'norm.bias' matches more than one rule" in message and "['norm*']" in message
    assert "'a.weight'" in message and "'b.weight'" in message and "'*.bias'" in message
    with pytest.raises(GroupAssignmentError, match=re.escape("rule 1 ['*enc*'] matches no parameter")):
        flatopt.group_by_pattern(params, [{"match": "*"}, {"match": "*enc*"}])
    with pytest.raises(GroupAssignmentError, match="needs 'match'"):
        flatopt.group_by_pattern(params, [{"lr": 0.1}])


def test_initial_lr_is_validated_where_every_group_value_is():
    """One group validation: what a checkpoint load would refuse never enters an optimizer."""
    with pytest.raises(HyperparameterError, match="param group 0: initial_lr='abc'"):
        flatopt.Adam([{"params": {"w": f32(2)}, "initial_lr": "abc"}])
    opt = flatopt.Adam([{"params": {"w": f32(2)}, "initial_lr": 0.1}])
    opt.param_groups[0]["initial_lr"] = float("nan")
    with pytest.raises(HyperparameterError, match="initial_lr=nan"):
        opt.step({"w": f32(2)})
    assert opt.state_of("w") is None  # nothing stepped
    opt.param_groups[0]["initial_lr"] = 0.05
    opt.step({"w": f32(2)})
    assert opt.state_of("w").step == 1
