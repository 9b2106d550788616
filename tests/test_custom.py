"""User-defined rules (flatopt.define_optimizer): every mistake a user can make is a typed
RuleDefinitionError raised before an optimizer exists, naming the rule and what is wrong; a
defined rule is an optimizer like the built-in ones (groups, missing gradients, schedulers,
clipping, reduced precision, state dicts, checkpoints, versions, CUDA)."""

from __future__ import annotations

import importlib
import importlib.util
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flatopt
from flatopt import registry
from flatopt.custom import define_optimizer
from flatopt.errors import HyperparameterError, RuleDefinitionError
from flatopt.kernels import cpu
from flatopt.schema import Hyperparameter, Slot, non_negative

from checkpoint_helpers import check_round_trip
from walks import serial_and_chunked


# ----------------------------------------------------------------------------- a small rule
def momentum_update(p, g, m, lr, beta, one_minus_beta, decay, nesterov):
    m = beta * m + one_minus_beta * g
    if nesterov:
        p = p * decay - lr * (g + beta * m)
    else:
        p = p * decay - lr * m
    return p, m


def momentum_derived(lr, beta, weight_decay):
    return {"one_minus_beta": 1.0 - beta, "decay": 1.0 - lr * weight_decay}


MOMENTUM = dict(state=("m",), derived=momentum_derived,
                hyperparameters={"lr": Hyperparameter(0.01, non_negative, (0.01, 0.1)),
                                 "beta": 0.9, "weight_decay": 0.0, "nesterov": False})


def momentum_reference(p, grads, lr=0.01, beta=0.9, weight_decay=0.0, nesterov=False):
    """The rule in float64 NumPy."""
    p, m = p.astype(np.float64), np.zeros(p.shape)
    for g in grads:
        m = beta * m + (1 - beta) * g
        p = p * (1 - lr * weight_decay) - lr * ((g + beta * m) if nesterov else m)
    return p


@pytest.fixture
def momentum():
    cls = define_optimizer("MomentumTest", momentum_update, **MOMENTUM)
    yield cls
    registry.unregister("MomentumTest")


def test_a_defined_rule_steps_like_its_reference(momentum):
    rng = np.random.default_rng(0)
    p = {"a": rng.standard_normal((3, 5)), "b": rng.standard_normal(7)}
    grads = [{k: rng.standard_normal(v.shape) for k, v in p.items()} for _ in range(4)]
    opt = momentum([{"params": {"a": p["a"].copy()}, "nesterov": True, "weight_decay": 0.1},
                    {"params": {"b": p["b"].copy()}, "lr": 0.1}])
    for g in grads:
        opt.step(g)
    np.testing.assert_allclose(opt.params["a"], momentum_reference(
        p["a"], [g["a"] for g in grads], nesterov=True, weight_decay=0.1), rtol=1e-13)
    np.testing.assert_allclose(opt.params["b"], momentum_reference(
        p["b"], [g["b"] for g in grads], lr=0.1), rtol=1e-13)
    assert opt.state_of("a").step == 4 and isinstance(opt, flatopt.Optimizer)
    assert registry.lookup("MomentumTest") is momentum


def test_a_missing_gradient_leaves_its_parameter_and_step_count(momentum):
    opt = momentum({"a": np.ones(4), "b": np.ones(3)})
    opt.step({"a": np.ones(4), "b": np.ones(3)})
    before = opt.params["b"].copy()
    opt.step({"a": np.ones(4)})
    assert opt.state_of("a").step == 2 and opt.state_of("b").step == 1
    np.testing.assert_array_equal(opt.params["b"], before)


def test_float32_buffers_stay_float32_and_match_float64_closely(momentum):
    rng = np.random.default_rng(1)
    p = rng.standard_normal(1000)
    grads = [rng.standard_normal(1000) for _ in range(5)]
    opt = momentum({"w": p.astype(np.float32)}, lr=0.05)
    for g in grads:
        opt.step({"w": g.astype(np.float32)})
    assert opt.params["w"].dtype == np.float32 and opt.state_of("w").m.dtype == np.float32
    np.testing.assert_allclose(opt.params["w"], momentum_reference(p, grads, lr=0.05),
                               rtol=2e-5, atol=2e-6)


def test_schedulers_and_clipping_take_a_defined_rule(momentum):
    opt = momentum({"w": np.ones(8)}, lr=0.1)
    scheduler = flatopt.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    result = opt.step({"w": np.full(8, 10.0)}, max_grad_norm=1.0)
    scheduler.step()
    assert result.grad_norm == pytest.approx(math.sqrt(8) * 10)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    clipped = 10.0 * 1.0 / (math.sqrt(8) * 10 + 1e-6)
    np.testing.assert_allclose(opt.params["w"], 1 - 0.1 * 0.1 * clipped, rtol=1e-12)


def test_bad_hyperparameter_values_are_refused_by_the_declared_checks(momentum):
    with pytest.raises(HyperparameterError, match="lr"):
        momentum({"w": np.ones(3)}, lr=-1.0)
    with pytest.raises(HyperparameterError, match="nesterov"):
        momentum({"w": np.ones(3)}, nesterov=1)
    with pytest.raises(HyperparameterError, match="beta"):
        momentum({"w": np.ones(3)}, beta=float("nan"))
    with pytest.raises(HyperparameterError, match="momentum"):
        momentum({"w": np.ones(3)}, momentum=0.9)  # not one of its names


def test_a_users_switches_each_compile_the_walk_of_their_values(momentum):
    """Every switch of a user's rule is a variant (as the built-in rules' loop-choosing flags):
    the generated span reads it through the flags' positions, the form kernels/variants.py
    folds into a constant, so the CPU compiles a step walk per combination of switch values
    a step uses, with the other branch gone."""
    rule = momentum.schema.rule
    assert rule.variants == rule.flags._fields == ("nesterov",)
    assert "flags[_flag_positions.nesterov]" in rule.sources[rule.span.__name__]
    compiled = cpu.compile_rule(rule)
    walks = {}
    for nesterov in (False, True):
        opt = momentum({"w": np.ones(3000, np.float32)}, nesterov=nesterov)
        buf = opt.buffers[0]
        walks[nesterov] = compiled.step_kernel(opt.plan(buf, opt.settings()[buf.group]).flags)
    assert walks[False] is not walks[True]
    assert walks[True].name.endswith("_nesterov1") and walks[False].name.endswith("_nesterov0")


def test_lr_eps_and_weight_decay_given_by_a_number_are_non_negative_as_in_torch():
    def decayed(p, g, lr, eps, weight_decay, shift):
        p = p - lr * weight_decay * p - lr * g / (abs(g) + eps) + shift
        return p

    try:
        cls = define_optimizer("SignsTest", decayed, hyperparameters={
            "lr": 0.1, "eps": 1e-8, "weight_decay": 0.0, "shift": 0.0})
        for key in ("lr", "eps", "weight_decay"):
            with pytest.raises(HyperparameterError, match=key):
                cls({"w": np.ones(2)}, **{key: -1.0})
        cls({"w": np.ones(2)}, shift=-1.0)  # any other number may be negative
    finally:
        registry.unregister("SignsTest")


def inverse_update(p, g, m, inv_lr, group_step):
    m = m + g
    p = p - m / inv_lr
    return p, m


def inverse_derived(lr):
    return {"inv_lr": 1 / lr}


def test_a_group_value_derived_cannot_take_refuses_the_step_and_changes_nothing():
    """Found by a hostile probe: a derived() that raises for a scheduled value (lr = 0) failed
    the step after the group's step count had advanced."""
    try:
        cls = define_optimizer("InverseTest", inverse_update, state=("m",), derived=inverse_derived,
                               hyperparameters={"lr": 0.1})
        opt = cls({"w": np.ones(3)})
        opt.step({"w": np.ones(3)})
        before = opt.state_dict()
        opt.param_groups[0]["lr"] = 0.0
        with pytest.raises(HyperparameterError, match="param group 0.*ZeroDivisionError"):
            opt.step({"w": np.ones(3)})
        after = opt.state_dict()
        assert after["param_groups"][0]["group_step"] == before["param_groups"][0]["group_step"]
        assert after["state"]["w"]["step"] == 1
        np.testing.assert_array_equal(after["state"]["w"]["m"], before["state"]["w"]["m"])
    finally:
        registry.unregister("InverseTest")


def test_a_defined_rule_round_trips_through_checkpoints_and_state_dicts(momentum, tmp_path):
    check_round_trip("MomentumTest", tmp_path)
    opt = momentum({"w": np.arange(5.0)})
    opt.step({"w": np.ones(5)})
    twin = momentum({"w": opt.params["w"].copy()})  # a state dict holds no parameters
    twin.load_state_dict(opt.state_dict())
    for o in (opt, twin):
        o.step({"w": np.full(5, 0.5)})
    assert opt.params["w"].tobytes() == twin.params["w"].tobytes()


def test_reduced_precision_storage_takes_a_defined_rule(momentum):
    import ml_dtypes

    rng = np.random.default_rng(2)
    p = rng.standard_normal(300).astype(ml_dtypes.bfloat16)
    opt = momentum({"w": p}, master_weights=True)
    for _ in range(3):
        opt.step({"w": rng.standard_normal(300).astype(ml_dtypes.bfloat16)})
    assert opt.params["w"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.isfinite(opt.params["w"].astype(np.float32)).all()


def test_a_hyperparameter_added_in_a_later_version_loads_older_files(tmp_path):
    def v1_update(p, g, lr):
        p = p - lr * g
        return p

    def v2_update(p, g, lr, scale):
        p = p - lr * scale * g
        return p

    try:
        v1 = define_optimizer("VersionedTest", v1_update, hyperparameters={"lr": 0.1})
        opt = v1({"w": np.ones(3)})
        opt.step({"w": np.ones(3)})
        flatopt.save(tmp_path / "v1.h5", opt)
        v2 = define_optimizer("VersionedTest", v2_update, version=2, hyperparameters={
            "lr": 0.1, "scale": Hyperparameter(1.0, non_negative, (1.0, 2.0), since=2)})
        resumed = v2({"w": np.zeros(3)}, scale=3.0)
        flatopt.load(tmp_path / "v1.h5", resumed, hyperparameters="saved")
        assert resumed.param_groups[0]["scale"] == 1.0  # the old file's meaning
        np.testing.assert_array_equal(resumed.params["w"], np.full(3, 0.9))
        flatopt.save(tmp_path / "v2.h5", resumed)
        with pytest.raises(flatopt.CheckpointError, match="defined again"):
            flatopt.load(tmp_path / "v2.h5", v1({"w": np.zeros(3)}))
        v1 = define_optimizer("VersionedTest", v1_update, hyperparameters={"lr": 0.1})
        with pytest.raises(flatopt.CheckpointError, match="schema version 2"):
            flatopt.load(tmp_path / "v2.h5", v1({"w": np.zeros(3)}))
    finally:
        registry.unregister("VersionedTest")


def test_the_cuda_backend_takes_a_defined_rule(momentum):
    pytest.importorskip("numba_cuda")
    rng = np.random.default_rng(3)
    p = rng.standard_normal((4, 33)).astype(np.float32)
    grads = [rng.standard_normal((4, 33)).astype(np.float32) for _ in range(3)]
    cpu, gpu = momentum({"w": p.copy()}, nesterov=True), momentum({"w": p.copy()},
                                                                   nesterov=True, device="cuda")
    for g in grads:
        cpu.step({"w": g})
        gpu.step({"w": g})
    host = [a if isinstance(a, np.ndarray) else a.copy_to_host()
            for a in (gpu.params["w"], gpu.state_of("w").m)]
    np.testing.assert_allclose(host[0], cpu.params["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(host[1], cpu.state_of("w").m, rtol=1e-5, atol=1e-6)
    assert gpu.state_of("w").step == 3


# ----------------------------------------------------------------------------- mistakes
def plain(p, g, lr):
    p = p - lr * g
    return p


def never_writes_m(p, g, m, lr):
    p = p - lr * g
    return p, m


def wrong_count(p, g, m, lr):
    m = g
    p = p - lr * m
    return p


def gives_nan(p, g, m, lr):
    m = m + g * g
    p = p - lr * g / math.sqrt(m - m)  # 0/0 at a zero gradient
    return p, m


def not_numba(p, g, lr):
    p = p - lr * len(g)  # a number has no length
    return p


def returns_an_array(p, g, lr):
    p = p - lr * np.ones(1, np.float32)
    return p


def calls_a_helper(p, g, lr):
    p = helper_step(p, g, lr)
    return p


def helper_step(p, g, lr):
    return p - lr * g


def with_default(p, g, lr=0.1):
    p = p - lr * g
    return p


def takes_step(p, g, lr, step):
    p = p - lr * g * step
    return p


def many_values(p, g, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9,
                a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,
                a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33):
    # more than 30 values: CPython calls with *args past 30 arguments, which Numba cannot
    # inline; the span passes them in tuples
    p = p - (a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11
             + a12 + a13 + a14 + a15 + a16 + a17 + a18 + a19 + a20 + a21 + a22 + a23
             + a24 + a25 + a26 + a27 + a28 + a29 + a30 + a31 + a32 + a33) * g
    return p


def literal_in_body(p, g, m, lr):
    m = 0.9 * m + g  # float64 from float32 inputs
    p = p - lr * m
    return p, m


def halve(x, n):
    return x if n == 0 else halve(x * 0.5, n - 1)


def recursive(p, g, lr):
    p = p - lr * halve(g, 2)
    return p


def raises(p, g, lr):
    if g > 100.0:
        raise ValueError("gradient too large")
    p = p - lr * g
    return p


def reads_a_module(p, g, lr):
    p = p - lr * np.float32(g) * registry.MAX  # noqa: F821 (any module but math/numpy)
    return p


# per-tensor totals: a cautious momentum (timm's caution over a momentum rule)
def cautious_terms(p, g, m, beta, one_minus_beta):
    m = beta * m + one_minus_beta * g
    return (1.0 if m * g > 0 else 0.0), 1.0     # agreeing elements, elements


def kept_scale(agreeing, elements):
    return elements / max(agreeing, 1e-3 * elements)


def cautious_update(p, g, m, lr, beta, one_minus_beta, scale, zero):
    m = beta * m + one_minus_beta * g
    u = m * scale if m * g > 0 else zero
    return p - lr * u, m


def cautious_derived(beta):
    return {"one_minus_beta": 1.0 - beta, "zero": 0.0}


CAUTIOUS = dict(state=("m",), hyperparameters={"lr": 0.01, "beta": 0.9},
                derived=cautious_derived, reduce=cautious_terms,
                reduce_values=("agreeing", "elements"), per_tensor=kept_scale,
                per_tensor_values=("scale",))


def cautious_reference(p, grads, lr=0.01, beta=0.9):
    """The rule in float64 NumPy (missing gradients: None)."""
    p, m = p.astype(np.float64), np.zeros(p.shape)
    for g in grads:
        if g is None:
            continue
        m = beta * m + (1 - beta) * g
        mask = m * g > 0
        scale = p.size / max(mask.sum(), 1e-3 * p.size) if p.size else 1.0
        p = p - lr * np.where(mask, m * scale, 0.0)
    return p


def two_terms(p, g, m, beta, one_minus_beta):
    return 1.0, 2.0


def reads_a_total(p, g, m, lr, beta, one_minus_beta, agreeing, zero):
    m = beta * m + one_minus_beta * g
    return p - lr * agreeing * m, m


def reads_only_agreeing(agreeing):
    return agreeing


def infinite_scale(agreeing, elements):
    return agreeing / (elements - elements)


# per-group totals: AdaGrad-Norm (examples/adagrad_norm.py is the same rule)
def group_squares(p, g):
    return g * g


def group_accumulate(grad_norm_sq, b_sq):
    b_sq = b_sq + grad_norm_sq
    return b_sq, 1.0 / math.sqrt(b_sq)


def group_update(p, g, lr, inv_b):
    return p - (lr * inv_b) * g


NORM = dict(hyperparameters={"lr": 1.0}, group_state={"b_sq": 1e-4}, reduce=group_squares,
            reduce_values=("grad_norm_sq",), per_group=group_accumulate,
            per_group_values=("b_sq", "inv_b"))


def norm_reference(params, grads, settings):
    """AdaGrad-Norm in float64 NumPy over groups (``params``: per group a dict of arrays;
    ``grads``: per step a dict, a path missing its gradient absent): per group, b^2 adds the
    squared norm of the group's present gradients at every step."""
    params = [{k: v.astype(np.float64) for k, v in group.items()} for group in params]
    b_sq = [1e-4] * len(params)
    for g in grads:
        for number, group in enumerate(params):
            present = [k for k in group if k in g]
            if not present:
                continue
            b_sq[number] += sum(float((g[k].astype(np.float64) ** 2).sum()) for k in present)
            for k in present:
                group[k] = group[k] - settings[number]["lr"] / math.sqrt(b_sq[number]) * g[k]
    return params, b_sq


def reads_a_step_value(grad_norm_sq, b_sq, bias):
    return b_sq + grad_norm_sq * bias, 1.0


def step_bias(step):
    return 1.0


def group_update_bias(p, g, lr, inv_b):
    return p - (lr * inv_b) * g


def negative_sqrt(grad_norm_sq, b_sq):
    return b_sq, math.sqrt(-1.0 - grad_norm_sq)


# mode passes (opt.eval() / opt.train()) and state from the parameter
def mode_update(p, g, z, lr):
    return p - lr * g, z - lr * g


def mode_eval(p, z, lr):
    return p + lr * (z - p), z


def mode_eval_step(p, z, lr, bias):
    return p + bias * (z - p), z


def mode_keeps_p(p, z, lr):
    return p, z + lr


MODES = dict(state=("z",), hyperparameters={"lr": 0.1}, to_eval=mode_eval, to_train=mode_eval,
             from_param=("z",))


def optional_caution_update(p, g, m, lr, beta, one_minus_beta, scale, zero, caution):
    m = beta * m + one_minus_beta * g
    if caution:
        return p - lr * (m * scale if m * g > 0 else zero), m
    return p - lr * m, m


OPTIONAL = dict(CAUTIOUS, hyperparameters={"lr": 0.01, "beta": 0.9, "caution": False},
                reduce_when="caution")


MISTAKES = [
    ("a name clashing with a built-in optimizer", "Adam", plain, {"hyperparameters": {"lr": 0.1}},
     "built-in"),
    ("a lambda", "Mistake", lambda p, g, lr: p, {"hyperparameters": {"lr": 0.1}}, "def"),
    ("a parameter with a default", "Mistake", with_default, {"hyperparameters": {"lr": 0.1}},
     "plain positional"),
    ("a state slot never written", "Mistake", never_writes_m,
     {"state": ("m",), "hyperparameters": {"lr": 0.1}}, r"never assigns \['m'\]"),
    ("too few results", "Mistake", wrong_count,
     {"state": ("m",), "hyperparameters": {"lr": 0.1}}, "returned 1 value"),
    ("a NaN from finite inputs", "Mistake", gives_nan,
     {"state": ("m",), "hyperparameters": {"lr": 0.1}}, "non-finite"),
    ("a body Numba cannot compile", "Mistake", not_numba, {"hyperparameters": {"lr": 0.1}},
     "does not compile"),
    ("an array where a number goes", "Mistake", returns_an_array,
     {"hyperparameters": {"lr": 0.1}}, "must return numbers"),
    ("a hyperparameter nothing reads", "Mistake", plain,
     {"hyperparameters": {"lr": 0.1, "beta": 0.9}}, r"\['beta'\] are read by no function"),
    ("a name update reads that is nothing", "Mistake", plain, {"hyperparameters": {}},
     r"reads \['lr'\]"),
    ("the reserved name step", "Mistake", takes_step,
     {"hyperparameters": {"lr": 0.1, "step": 1.0}}, "reserved"),
    ("a string default", "Mistake", plain, {"hyperparameters": {"lr": "0.1"}}, "number"),
    ("a default its check refuses", "Mistake", plain,
     {"hyperparameters": {"lr": Hyperparameter(-1.0, non_negative)}}, "default"),
    ("a slot named twice", "Mistake", never_writes_m,
     {"state": ("m", "m"), "hyperparameters": {"lr": 0.1}}, "twice"),
    ("a shaped slot", "Mistake", never_writes_m,
     {"state": {"m": Slot(shape=lambda s: s)}, "hyperparameters": {"lr": 0.1}}, "parallel"),
    ("per_step without its names", "Mistake", plain,
     {"hyperparameters": {"lr": 0.1}, "per_step": helper_step}, "go together"),
    ("an empty name", "", plain, {"hyperparameters": {"lr": 0.1}}, "non-empty"),
    # found by a hostile probe: each defined, then failed (unchecked) at the first step
    ("a float literal making float32 float64", "Mistake", literal_in_body,
     {"state": ("m",), "hyperparameters": {"lr": 0.1}}, "promotes float32 to float64"),
    ("recursion", "Mistake", recursive, {"hyperparameters": {"lr": 0.1}},
     "halve -> halve: recursion"),
    ("a raise in the body", "Mistake", raises, {"hyperparameters": {"lr": 0.1}}, "raises"),
    ("a module read through its name", "Mistake", reads_a_module,
     {"hyperparameters": {"lr": 0.1}}, "reads module 'flatopt.registry'"),
    ("a generated name", "Mistake", plain,
     {"hyperparameters": {"lr": 0.1, "flatopt_values0": 1.0}}, "reserved"),
    ("betas as a number", "Mistake", plain, {"hyperparameters": {"lr": 0.1, "betas": 0.9}},
     "reserved"),
    ("a version that is not a whole number", "Mistake", plain,
     {"hyperparameters": {"lr": 0.1}, "version": 2.5}, "version"),
    ("since below 1", "Mistake", plain,
     {"hyperparameters": {"lr": Hyperparameter(0.1, non_negative, since=0)}}, "since"),
    # per-tensor totals
    ("reduce without per_tensor", "Mistake", cautious_update,
     {**CAUTIOUS, "per_tensor": None, "per_tensor_values": ()}, "goes with one of"),
    ("reduce without its names", "Mistake", cautious_update,
     {**CAUTIOUS, "reduce_values": ()}, "reduce and reduce_values go together"),
    ("a per_tensor value named as a hyperparameter", "Mistake", cautious_update,
     {**CAUTIOUS, "per_tensor_values": ("lr",)}, "clashes"),
    ("update reading a total", "Mistake", reads_a_total, CAUTIOUS, r"reads \['agreeing'\]"),
    ("a total no function reads", "Mistake", cautious_update,
     {**CAUTIOUS, "per_tensor": reads_only_agreeing}, r"\['elements'\] are computed"),
    ("reduce giving the wrong number of terms", "Mistake", cautious_update,
     {**CAUTIOUS, "reduce": two_terms, "reduce_values": ("agreeing",),
      "per_tensor": reads_only_agreeing}, r"reduce two_terms\(\) returned 2 value"),
    ("per_tensor giving an infinity", "Mistake", cautious_update,
     {**CAUTIOUS, "per_tensor": infinite_scale}, "per_tensor infinite_scale.*non-finite"),
    # per-group totals and group state
    ("per_group and per_tensor both", "Mistake", group_update,
     {**NORM, "per_tensor": kept_scale, "per_tensor_values": ("scale",)}, "one of"),
    ("group_state without per_group", "Mistake", plain,
     {"hyperparameters": {"lr": 0.1}, "group_state": {"b_sq": 1.0}}, "per_group's to update"),
    ("group_state per_group does not give", "Mistake", group_update,
     {**NORM, "group_state": {"b_sq": 1e-4, "other": 0.0}}, r"\['other'\] must be among"),
    ("a group_state named as a hyperparameter", "Mistake", group_update,
     {**NORM, "group_state": {"lr": 1.0}}, "clashes"),
    ("a group_state that is not a number", "Mistake", group_update,
     {**NORM, "group_state": {"b_sq": "1"}}, "finite number"),
    ("per_group reading a per-parameter value", "Mistake", group_update_bias,
     {**NORM, "per_group": reads_a_step_value, "per_step": step_bias,
      "per_step_values": ("bias",)}, r"per_group reads \['bias'\]"),
    ("per_group giving NaN", "Mistake", group_update,
     {**NORM, "per_group": negative_sqrt}, "per_group negative_sqrt.*non-finite"),
    ("to_eval without to_train", "Mistake", mode_update, {**MODES, "to_train": None},
     "to_eval and to_train go together"),
    ("to_eval reading a per-step value", "Mistake", mode_update,
     {**MODES, "to_eval": mode_eval_step, "per_step": step_bias, "per_step_values": ("bias",)},
     r"to_eval reads \['bias'\]"),
    ("to_eval never moving the parameter", "Mistake", mode_update,
     {**MODES, "to_eval": mode_keeps_p}, r"mode_keeps_p\(\) never assigns \['p'\]"),
    ("from_param naming no slot", "Mistake", mode_update, {**MODES, "from_param": ("m",)},
     "from_param must name state slots"),
    ("a hyperparameter named train_mode", "Mistake", plain,
     {"hyperparameters": {"lr": 0.1, "train_mode": 1.0}}, "reserved"),
    ("reduce_when naming no switch", "Mistake", optional_caution_update,
     {**OPTIONAL, "reduce_when": "lr"}, "reduce_when must name a switch"),
    ("a reduce that is a lambda", "Mistake", cautious_update,
     {**CAUTIOUS, "reduce": lambda p, g, m, beta, one_minus_beta: (1.0, 1.0)}, "def"),
]


@pytest.mark.parametrize("what, name, update, options, message", MISTAKES,
                         ids=[m[0] for m in MISTAKES])
def test_every_mistake_is_a_typed_error_before_anything_exists(what, name, update, options,
                                                                message):
    before = registry.names()
    with pytest.raises(RuleDefinitionError, match=message):
        define_optimizer(name, update, **options)
    assert registry.names() == before
    assert registry.lookup("Adam") is flatopt.Adam


def test_helpers_are_found_and_compiled_with_the_update():
    try:
        cls = define_optimizer("HelperTest", calls_a_helper, hyperparameters={"lr": 0.5})
        opt = cls({"w": np.ones(3, np.float32)})
        opt.step({"w": np.ones(3, np.float32)})
        np.testing.assert_array_equal(opt.params["w"], np.full(3, 0.5, np.float32))
    finally:
        registry.unregister("HelperTest")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(lr=st.floats(0, 10), beta=st.floats(0, 0.999), weight_decay=st.floats(0, 1),
       nesterov=st.booleans(), steps=st.integers(1, 4), data=st.data())
def test_a_defined_rule_matches_its_reference_for_generated_settings(lr, beta, weight_decay,
                                                                     nesterov, steps, data):
    cls = registry.lookup("MomentumTest") or define_optimizer("MomentumTest", momentum_update,
                                                              **MOMENTUM)
    size = data.draw(st.integers(0, 40))
    values = st.floats(-1e3, 1e3)
    p = np.array(data.draw(st.lists(values, min_size=size, max_size=size)))
    grads = [np.array(data.draw(st.lists(values, min_size=size, max_size=size)))
             for _ in range(steps)]
    opt = cls({"w": p.copy()}, lr=lr, beta=beta, weight_decay=weight_decay, nesterov=nesterov)
    for g in grads:
        opt.step({"w": g})
    np.testing.assert_allclose(opt.params["w"], momentum_reference(
        p, grads, lr, beta, weight_decay, nesterov), rtol=1e-9, atol=1e-9)


def test_an_update_reading_more_than_30_values_compiles_and_steps():
    try:
        cls = define_optimizer("ManyValuesTest", many_values,
                               hyperparameters={f"a{i}": 0.01 * i for i in range(34)})
        opt = cls({"w": np.ones(5, np.float32)})
        opt.step({"w": np.ones(5, np.float32)})
        np.testing.assert_allclose(opt.params["w"], 1 - 0.01 * sum(range(34)), rtol=1e-6)
    finally:
        registry.unregister("ManyValuesTest")


def parallel_equals_serial(cls, monkeypatch, **settings) -> None:
    """A user rule's parallel chunk walk gives its serial walk's bits."""
    serial_and_chunked(lambda params: cls(params, **settings), monkeypatch, seed=9)


def test_the_parallel_walk_gives_the_serial_bits(momentum, monkeypatch):
    parallel_equals_serial(momentum, monkeypatch, nesterov=True, weight_decay=0.1)


def test_the_parallel_walk_of_a_rule_reading_more_than_30_values(monkeypatch):
    """Found by the bench: the values' tuples were nested, which Numba's parallel array
    analysis refused (the serial walk compiled)."""
    try:
        cls = define_optimizer("ManyValuesTest", many_values,
                               hyperparameters={f"a{i}": 0.001 * i for i in range(34)})
        parallel_equals_serial(cls, monkeypatch)
    finally:
        registry.unregister("ManyValuesTest")



SCALE = np.float32(1.0)  # a float32 constant: a Python float would make the kernel float64


def scaled(p, g, lr):
    p = p - lr * SCALE * g
    return p


def test_a_changed_global_constant_is_a_new_rule():
    """Found by a hostile probe: Numba compiles globals in as constants, and the rule's
    fingerprint (its kernels' cache key) covered the source only, so a rule defined again
    after a global changed ran the old kernel (in this process and from the disk cache)."""
    global SCALE
    try:
        for scale in (1.0, 100.0):
            SCALE = np.float32(scale)
            cls = define_optimizer("ScaledTest", scaled, hyperparameters={"lr": 0.1})
            opt = cls({"w": np.zeros(3, np.float32)})
            opt.step({"w": np.ones(3, np.float32)})
            np.testing.assert_allclose(opt.params["w"], -0.1 * scale, rtol=1e-6)
    finally:
        SCALE = np.float32(1.0)
        registry.unregister("ScaledTest")


def k(step, lr):  # named like the generated prepare's loop variable
    return lr / (step - 4)


def stepped_by(p, g, c):
    p = p - c * g
    return p


def test_per_step_is_called_by_a_name_no_generated_local_shadows_and_never_stops_a_walk():
    """Found by a hostile probe: a per_step named ``k`` failed to compile in the prepare walk,
    and one dividing by zero (at step 4) stopped it halfway, some step counts advanced."""
    try:
        cls = define_optimizer("PerStepTest", stepped_by, hyperparameters={"lr": 0.1},
                               per_step=k, per_step_values=("c",))
        opt = cls({"a": np.ones(3), "b": np.ones(2)})
        for _ in range(4):
            opt.step({"a": np.ones(3), "b": np.ones(2)})
        assert opt.state_of("a").step == opt.state_of("b").step == 4
        assert np.isinf(opt.params["a"]).all()  # c = 0.1 / 0: the error model's inf
    finally:
        registry.unregister("PerStepTest")


def checked_type(value):
    value = float(value)
    return "big" if value > 1 else value


def big_constant(path, shape):
    return 1e39


def overflowing(lr):
    return {"huge": lr * 1e40}


def uses_huge(p, g, lr, huge):
    p = p - lr * g + huge * (g - g)
    return p


def test_values_checked_only_at_a_step_are_typed_errors_naming_the_group_or_path():
    """Found by a hostile probe: a check giving a string, a per_parameter value and a derived
    value beyond float32 passed (ValueError at the step; inf parameters)."""
    try:
        cls = define_optimizer("CheckTypeTest", plain, hyperparameters={
            "lr": Hyperparameter(0.1, checked_type, (0.1,))})
        opt = cls({"w": np.ones(3)})
        opt.param_groups[0]["lr"] = 5.0
        with pytest.raises(HyperparameterError, match="param group 0.*lr.*'big'"):
            opt.step({"w": np.ones(3)})
        cls = define_optimizer("BigTest", scaled_by, hyperparameters={"lr": 0.1},
                               per_parameter={"scale": big_constant})
        with pytest.raises(flatopt.ParamError, match="'w'.*float32"):
            cls({"w": np.ones(3, np.float32)})
        cls = define_optimizer("OverflowTest", uses_huge, hyperparameters={"lr": 1e-41},
                               derived=overflowing)
        opt = cls({"w": np.ones(3, np.float32)}, lr=0.1)
        with pytest.raises(HyperparameterError, match="overflow float32"):
            opt.step({"w": np.ones(3, np.float32)})
        assert opt.state_of("w") is None or opt.state_of("w").step == 0
    finally:
        for name in ("CheckTypeTest", "BigTest", "OverflowTest"):
            registry.unregister(name)


def scaled_by(p, g, lr, scale):
    p = p - lr * scale * g
    return p


# ----------------------------------------------------------------------------- per-tensor totals
def defined(name: str, update, options: dict):
    """A rule defined for one test, then removed (a fixture's body)."""
    cls = define_optimizer(name, update, **options)
    yield cls
    registry.unregister(name)


@pytest.fixture
def cautious():
    yield from defined("CautiousTest", cautious_update, CAUTIOUS)


@pytest.mark.filterwarnings("ignore:.*no gradient is marked present")
@settings(max_examples=20, deadline=None, derandomize=True)
@given(lr=st.floats(0, 1), beta=st.floats(0, 0.99), steps=st.integers(1, 4), data=st.data())
def test_per_tensor_totals_match_their_reference_for_generated_tensors(lr, beta, steps,
                                                                       data):
    """A cautious momentum (each element's update kept where it agrees in sign with the
    gradient, scaled by the tensor's kept fraction): several tensors, one of them over
    several 16K chunks (its totals added across chunks), missing gradients."""
    cls = registry.lookup("CautiousTest") or define_optimizer("CautiousTest", cautious_update,
                                                              **CAUTIOUS)
    sizes = data.draw(st.lists(st.sampled_from([0, 1, 7, 40_000]), min_size=1, max_size=3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    params = {f"t{i}": rng.standard_normal(n) for i, n in enumerate(sizes)}
    grads = [{k: rng.standard_normal(v.size) for k, v in params.items()
              if data.draw(st.booleans(), label=f"{k} has a gradient")} for _ in range(steps)]
    opt = cls({k: v.copy() for k, v in params.items()}, lr=lr, beta=beta)
    for g in grads:
        opt.step(g)
    for k, p in params.items():
        np.testing.assert_allclose(opt.params[k], cautious_reference(
            p, [g.get(k) for g in grads], lr, beta), rtol=1e-9, atol=1e-12, err_msg=k)


def test_per_tensor_totals_are_the_same_bits_serial_and_parallel(cautious, monkeypatch):
    parallel_equals_serial(cautious, monkeypatch, lr=0.1)


def test_per_tensor_totals_in_reduced_precision_and_the_cuda_simulator(cautious):
    """bf16 storage runs the reduce pass over decoded views; the CUDA backend its own reduce
    and finalize kernels: both step as the float32 host does (up to bf16's rounding)."""
    rng = np.random.default_rng(4)
    p = rng.standard_normal((6, 40)).astype(np.float32)
    host = cautious({"w": p.copy()}, lr=0.1)
    coded = cautious({"w": p.copy()}, lr=0.1, state_dtype="bfloat16")
    runs = [host, coded]
    if importlib.util.find_spec("numba_cuda"):  # the simulator's backend
        runs.append(cautious({"w": p.copy()}, lr=0.1, device="cuda"))
    for _ in range(3):
        g = rng.standard_normal((6, 40)).astype(np.float32)
        for opt in runs:
            opt.step({"w": g})
    for opt in runs[1:]:
        out = opt.params["w"]
        out = out if isinstance(out, np.ndarray) else out.copy_to_host()
        np.testing.assert_allclose(out, host.params["w"], rtol=2e-2, atol=2e-3)
    assert not np.array_equal(host.params["w"], p)


def test_per_tensor_totals_round_trip_through_checkpoints(cautious, tmp_path):
    check_round_trip("CautiousTest", tmp_path)


def shadowing(p, g, m, k, i, stride, start, present, scale):
    m = k * m + i * g
    return p - stride * scale * (m + start * present), m


def shadowing_terms(p, g, m, k, i):
    return g * g, k + i


def shadowing_scale(sums, columns, stop, flags):
    return sums / (columns + stop * flags)


def test_values_named_like_the_generated_walks_own_names_are_not_shadowed():
    """Found in review: values named as the generated walks' parameters and loop variables
    (k, i, stride, start, present, stop, flags, sums, columns) must not be read into locals
    of those names."""
    settings = dict(k=0.5, i=0.25, stride=0.1, start=4.0, present=3.0, stop=6.0, flags=7.0)
    try:
        cls = define_optimizer("ShadowTest", shadowing, state=("m",),
                               hyperparameters=settings, reduce=shadowing_terms,
                               reduce_values=("sums", "columns"), per_tensor=shadowing_scale,
                               per_tensor_values=("scale",))
        rng = np.random.default_rng(2)
        p = rng.standard_normal(10)
        grads = [rng.standard_normal(10) for _ in range(3)]
        opt = cls({"w": p.copy()})
        m = np.zeros(10)
        for g in grads:
            opt.step({"w": g})
            scale = (g @ g) / (10 * (0.5 + 0.25) + 6.0 * 7.0)
            m = 0.5 * m + 0.25 * g
            p = p - 0.1 * scale * (m + 4.0 * 3.0)
        np.testing.assert_allclose(opt.params["w"], p, rtol=1e-12)
    finally:
        registry.unregister("ShadowTest")


# ----------------------------------------------------------------------------- per-group totals
@pytest.fixture
def norm():
    yield from defined("NormTest", group_update, NORM)


@pytest.mark.filterwarnings("ignore:.*no gradient is marked present")
@settings(max_examples=20, deadline=None, derandomize=True)
@given(lrs=st.tuples(st.floats(0, 2), st.floats(0, 2)), steps=st.integers(1, 4),
       data=st.data())
def test_per_group_totals_match_their_reference_for_generated_groups(lrs, steps, data):
    """AdaGrad-Norm over two groups (their own b^2), tensors across chunks, float32 and
    float64 buffers in one group, missing gradients: totals over every buffer of a group."""
    cls = registry.lookup("NormTest") or define_optimizer("NormTest", group_update, **NORM)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    sizes = [data.draw(st.lists(st.sampled_from([1, 7, 40_000]), min_size=1, max_size=3))
             for _ in range(2)]
    params = [{f"g{n}.t{i}": rng.standard_normal(size).astype(
        np.float32 if i % 2 else np.float64) for i, size in enumerate(group)}
        for n, group in enumerate(sizes)]
    grads = [{k: rng.standard_normal(v.size).astype(v.dtype) for group in params
              for k, v in group.items() if data.draw(st.booleans(), label=f"{k} present")}
             for _ in range(steps)]
    groups = [dict(lr=lr) for lr in lrs]
    opt = cls([{"params": {k: v.copy() for k, v in group.items()}, **s}
               for group, s in zip(params, groups)])
    for g in grads:
        opt.step(g)
    expected, b_sq = norm_reference(params, grads, groups)
    for number, group in enumerate(expected):
        np.testing.assert_allclose(opt.param_groups[number]["b_sq"], b_sq[number], rtol=1e-6)
        for k, v in group.items():
            rtol = 1e-5 if opt.params[k].dtype == np.float32 else 1e-9
            np.testing.assert_allclose(opt.params[k], v, rtol=rtol, atol=1e-6, err_msg=k)


def test_group_state_round_trips_through_state_dicts_and_checkpoints(norm, tmp_path):
    """b^2 is saved with its group: a resumed optimizer steps as the one that went on."""
    rng = np.random.default_rng(5)
    params = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)}
    grads = [{k: rng.standard_normal(v.shape) for k, v in params.items()} for _ in range(4)]
    opt = norm({k: v.copy() for k, v in params.items()}, lr=0.3)
    for g in grads[:2]:
        opt.step(g)
    flatopt.save(tmp_path / "norm.h5", opt)
    state = opt.state_dict()
    by_file = norm({k: np.zeros_like(v) for k, v in params.items()}, lr=0.3)
    flatopt.load(tmp_path / "norm.h5", by_file)
    by_dict = norm({k: opt.params[k].copy() for k in params}, lr=0.3)
    by_dict.load_state_dict(state)
    assert by_file.param_groups[0]["b_sq"] == opt.param_groups[0]["b_sq"] > 1e-4
    for g in grads[2:]:
        for o in (opt, by_file, by_dict):
            o.step(g)
    for k in params:
        assert by_file.params[k].tobytes() == opt.params[k].tobytes()
        assert by_dict.params[k].tobytes() == opt.params[k].tobytes()


def test_per_group_totals_are_the_same_bits_serial_and_parallel(norm, monkeypatch):
    parallel_equals_serial(norm, monkeypatch, lr=0.5)


def test_per_group_totals_in_reduced_precision_and_the_cuda_simulator(norm):
    """bf16 parameters with stochastic rounding (the reduce pass over decoded views) and the
    CUDA backend (its reduce kernels, the totals read back per group) step as float32 does."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(6)
    p = rng.standard_normal((6, 40)).astype(np.float32)
    host = norm({"w": p.copy()}, lr=0.1)
    coded = norm({"w": p.astype(ml_dtypes.bfloat16)}, lr=0.1, rounding="stochastic", seed=3)
    runs = {"bf16": (coded, 1e-2)}
    if importlib.util.find_spec("numba_cuda"):  # the simulator's backend
        runs["cuda"] = (norm({"w": p.copy()}, lr=0.1, device="cuda"), 1e-5)
    for _ in range(3):
        g = rng.standard_normal((6, 40)).astype(np.float32)
        host.step({"w": g})
        for opt, _ in runs.values():
            opt.step({"w": g.astype(opt.grads["w"].dtype) if opt is coded else g})
    for what, (opt, tolerance) in runs.items():
        out = opt.params["w"]
        out = out if isinstance(out, np.ndarray) else out.copy_to_host()
        np.testing.assert_allclose(out.astype(np.float32), host.params["w"], rtol=tolerance,
                                   atol=tolerance, err_msg=what)
        assert opt.param_groups[0]["b_sq"] == pytest.approx(host.param_groups[0]["b_sq"],
                                                            rel=tolerance), what


# ----------------------------------------------------------------------------- mode passes
def test_mode_passes_and_state_from_the_parameter_on_every_backend(monkeypatch):
    """z starts at the parameter (from_param); opt.eval() runs to_eval over the parameters
    with state, opt.train() to_train: on the host serially and in parallel, and in the CUDA
    simulator, the same values; a parameter never stepped is not moved."""
    try:
        cls = define_optimizer("ModesTest", mode_update, **MODES)
        rng = np.random.default_rng(8)
        p = {"w": rng.standard_normal((5, 40)).astype(np.float32),
             "frozen": rng.standard_normal(3).astype(np.float32)}
        g = {"w": rng.standard_normal((5, 40)).astype(np.float32)}
        runs = [cls({k: v.copy() for k, v in p.items()}, lr=0.1)]
        if importlib.util.find_spec("numba_cuda"):  # the simulator's backend
            runs.append(cls({k: v.copy() for k, v in p.items()}, lr=0.1, device="cuda"))
        for opt in runs:
            opt.step(g)  # z = p - lr g (from p), p = p - lr g
            opt.eval()   # p + lr (z - p) = p: z and p agree after one step
        host = runs[0]
        expected = p["w"] - np.float32(0.1) * g["w"]
        np.testing.assert_allclose(host.params["w"], expected, rtol=1e-6)
        np.testing.assert_allclose(host.state_of("w").z, expected, rtol=1e-6)
        assert host.params["frozen"].tobytes() == p["frozen"].tobytes()
        for opt in runs[1:]:
            out = opt.params["w"]
            out = out if isinstance(out, np.ndarray) else out.copy_to_host()
            np.testing.assert_allclose(out, host.params["w"], rtol=1e-6)
        with pytest.raises(flatopt.ModeError):
            host.step(g)
        host.train()
        assert host.param_groups[0]["train_mode"] is True
        with pytest.raises(flatopt.HyperparameterError, match=r"train\(\)/eval\(\)"):
            cls({"w": p["w"].copy()}, state_dtype="bfloat16")  # the passes: plain buffers
    finally:
        registry.unregister("ModesTest")


def test_reduce_when_runs_the_totals_only_when_its_switch_is_on():
    """caution off: one pass (the reduce and per_tensor never run: the scale column is never
    written) and plain momentum; on: the cautious reference, in another group of the same
    optimizer at the same step."""
    try:
        cls = define_optimizer("OptionalTest", optional_caution_update, **OPTIONAL)
        rng = np.random.default_rng(3)
        p = {"off": rng.standard_normal(50), "on": rng.standard_normal(50)}
        grads = [{k: rng.standard_normal(50) for k in p} for _ in range(3)]
        opt = cls([{"params": {"off": p["off"].copy()}, "lr": 0.1},
                   {"params": {"on": p["on"].copy()}, "lr": 0.1, "caution": True}])
        for g in grads:
            opt.step(g)
        np.testing.assert_allclose(opt.params["on"], cautious_reference(
            p["on"], [g["on"] for g in grads], 0.1), rtol=1e-12)
        np.testing.assert_allclose(opt.params["off"], momentum_reference(
            p["off"], [g["off"] for g in grads], 0.1), rtol=1e-12)
        off = next(buf for buf in opt.buffers if buf.group == 0)
        assert not off.columns["scale"].any()
    finally:
        registry.unregister("OptionalTest")


def test_a_function_whose_file_changed_since_it_was_defined_is_refused(tmp_path, monkeypatch):
    """Found in review: the kernels compile update's source, read from its file at its line
    number; edited since (not reloaded), those lines are another function's or another body,
    which the kernel would run while the trial ran the old one."""
    module = tmp_path / "edited_rule.py"
    module.write_text("def edited(p, g, lr):\n    return p - lr * g\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited_rule
    for text in ("def other(p, g, lr):\n    return p\n\n\ndef edited(p, g, lr):\n"
                 "    return p - lr * g\n",                     # another function at its line
                 "def edited(p, g, lr):\n    return p + lr * g\n"):  # another body
        module.write_text(text)
        with pytest.raises(RuleDefinitionError, match="changed since it was defined"):
            define_optimizer("EditedTest", edited_rule.edited, hyperparameters={"lr": 0.1})
    importlib.reload(edited_rule)  # now the file is the function's
    try:
        cls = define_optimizer("EditedTest", edited_rule.edited, hyperparameters={"lr": 0.1})
        opt = cls({"w": np.ones(2)})
        opt.step({"w": np.ones(2)})
        np.testing.assert_allclose(opt.params["w"], 1.1)
    finally:
        registry.unregister("EditedTest")


# ----------------------------------------------------------------------------- building blocks
_BLOCKS: dict = {}


def compiled_blocks() -> dict:
    """flatopt.blocks' functions compiled for the CPU, as a rule's body gets them."""
    if not _BLOCKS:
        from numba import njit
        from flatopt.kernels._bind import bind_functions
        from flatopt.kernels.rules.moments import nearer_lerp
        _BLOCKS.update(bind_functions("blocks", [flatopt.blocks.lerp, nearer_lerp,
                                                 flatopt.blocks.square_ema,
                                                 flatopt.blocks.cautious], njit))
    return _BLOCKS


@settings(max_examples=40, deadline=None, derandomize=True)
@given(weight=st.floats(-2, 2, width=32), beta=st.floats(0, 1, width=32, exclude_max=True),
       scale=st.floats(1, 1000, width=32), seed=st.integers(0, 2**16))
def test_the_building_blocks_round_as_torchs_kernels(weight, beta, scale, seed):
    """flatopt.blocks against torch's CPU kernels, float32, bit for bit (32 elements: whole
    vectors of its kernels): lerp is torch.lerp (either end), square_ema is
    v.mul(beta).addcmul_(g, g, value=1 - beta); cautious is timm's mask times its scale."""
    torch = pytest.importorskip("torch")
    blocks = compiled_blocks()
    rng = np.random.default_rng(seed)
    start, end, v = (rng.standard_normal(32).astype(np.float32) for _ in range(3))
    v = np.abs(v)
    w, b, c = np.float32(weight), np.float32(beta), np.float32(1 - beta)
    mine = np.array([blocks["lerp"](s, e, w) for s, e in zip(start, end)], np.float32)
    theirs = torch.lerp(torch.tensor(start), torch.tensor(end), float(weight)).numpy()
    assert mine.tobytes() == theirs.tobytes()
    mine = np.array([blocks["square_ema"](x, g, b, c) for x, g in zip(v, end)], np.float32)
    theirs = torch.tensor(v).mul(float(beta)).addcmul_(torch.tensor(end), torch.tensor(end),
                                                       value=1 - float(beta)).numpy()
    assert mine.tobytes() == theirs.tobytes()
    s = np.float32(scale)
    mine = np.array([blocks["cautious"](u, g, s) for u, g in zip(start, end)], np.float32)
    assert mine.dtype == np.float32 and \
        mine.tobytes() == (start * np.where(start * end > 0, s, np.float32(0))).tobytes()
