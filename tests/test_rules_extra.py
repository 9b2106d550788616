"""Rule-specific behaviour the generic suite (random configurations) may not reach: RAdam's
rectification switch taken per parameter at its boundary, Rprop's sign-flip handling and
first-step seeding, Adamax's infinity norm, RMSprop's slots, Lion against hand-computed
values, NAdam's per-parameter mu_product, ASGD's eta and its switch to averaging after t0,
Adagrad's eager state and lr_decay, LAMB's per-tensor trust ratio, Muon against torch (to
bfloat16's precision) and its refusal of non-matrices, Adafactor's factored (shaped) state in
memory, state dicts and checkpoints, and the constructors' signatures and checks."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import flatopt
from flatopt.errors import HyperparameterError

torch = pytest.importorskip("torch")


def _torch_pair(kind, values, **hp):
    """A flatopt optimizer and torch's, over the same parameters."""
    opt = getattr(flatopt, kind)({k: v.copy() for k, v in values.items()}, **hp)
    tensors = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in values.items()}
    return opt, getattr(torch.optim, kind)(list(tensors.values()), **hp), tensors


def _step_both(opt, torch_opt, tensors, grads):
    opt.step(grads)
    for path, t in tensors.items():
        t.grad = torch.from_numpy(grads[path].copy()) if path in grads else None
    torch_opt.step()


# ------------------------------------------------------------------------------ RAdam
def _rho_t(beta2, t):
    rho_inf = 2 / (1 - beta2) - 1
    return rho_inf - 2 * t * beta2 ** t / (1 - beta2 ** t)


@pytest.mark.parametrize("beta2", [0.999, 0.9])
def test_radam_switches_to_the_rectified_update_at_rho_t_above_5(beta2):
    """Steps 1-5 are SGD with bias-corrected momentum (no second moment at all); step 6 is the
    first with rho_t > 5, for these betas. Matches torch bit for bit in float64 around it."""
    assert _rho_t(beta2, 5) <= 5 < _rho_t(beta2, 6)
    rng = np.random.default_rng(0)
    opt, torch_opt, tensors = _torch_pair("RAdam", {"w": rng.standard_normal(9)}, lr=0.1,
                                          betas=(0.9, beta2))
    for step in range(1, 9):
        before = opt.params["w"].copy()
        grad = rng.standard_normal(9)
        _step_both(opt, torch_opt, tensors, {"w": grad})
        np.testing.assert_allclose(opt.params["w"], tensors["w"].detach().numpy(),
                                   rtol=1e-14, atol=1e-15)
        m = opt.state_of("w").exp_avg
        unrectified = before - m / (1 - 0.9 ** step) * 0.1
        if step <= 5:
            np.testing.assert_allclose(opt.params["w"], unrectified, rtol=1e-14)
        else:
            assert not np.allclose(opt.params["w"], unrectified, rtol=1e-6)


def test_radam_rectification_follows_each_parameters_own_step_count():
    """A parameter first stepped later starts again unrectified, while its neighbour in the
    same buffer is rectified: the switch is per parameter, as in torch."""
    rng = np.random.default_rng(1)
    values = {"early": rng.standard_normal(4), "late": rng.standard_normal(4)}
    opt, torch_opt, tensors = _torch_pair("RAdam", values, lr=0.05, weight_decay=0.1,
                                          decoupled_weight_decay=True)
    for step in range(10):
        grads = {"early": rng.standard_normal(4)}
        if step >= 5:
            grads["late"] = rng.standard_normal(4)
        _step_both(opt, torch_opt, tensors, grads)
    assert opt.state_of("early").step == 10 and opt.state_of("late").step == 5
    for path, t in tensors.items():
        np.testing.assert_allclose(opt.params[path], t.detach().numpy(), rtol=1e-14)


# ------------------------------------------------------------------------------ Rprop
def test_rprop_sign_flip_shrinks_the_step_skips_the_move_and_stores_zero():
    opt = flatopt.Rprop({"w": np.zeros(4)}, lr=0.1, etas=(0.5, 2.0), step_sizes=(0.01, 0.3))
    opt.step({"w": np.array([1.0, -1.0, 1.0, 0.0])})
    # first step: step_size = lr (factor 1), clamped; p -= sign(g) * step_size
    np.testing.assert_array_equal(opt.params["w"], [-0.1, 0.1, -0.1, 0.0])
    np.testing.assert_array_equal(opt.state_of("w").step_size, [0.1, 0.1, 0.1, 0.1])
    np.testing.assert_array_equal(opt.state_of("w").prev, [1.0, -1.0, 1.0, 0.0])
    opt.step({"w": np.array([3.0, 2.0, 0.0, -1.0])})
    # same sign: x2; flipped: x0.5, no move, prev 0; product 0: unchanged
    np.testing.assert_array_equal(opt.state_of("w").step_size, [0.2, 0.05, 0.1, 0.1])
    np.testing.assert_allclose(opt.params["w"], [-0.3, 0.1, -0.1, 0.1], rtol=1e-15)
    np.testing.assert_array_equal(opt.state_of("w").prev, [3.0, 0.0, 0.0, -1.0])
    opt.step({"w": np.array([1.0, 5.0, 1.0, -1.0])})
    # after a flip prev is 0, so the next step keeps its size; 0.2 * 2 is clamped to 0.3
    np.testing.assert_array_equal(opt.state_of("w").step_size, [0.3, 0.05, 0.1, 0.2])
    np.testing.assert_allclose(opt.params["w"], [-0.6, 0.05, -0.2, 0.3], rtol=1e-15)


def test_rprop_matches_torch_with_flips_underflow_nan_and_late_parameters():
    """Products that underflow to 0 keep the step size; a NaN gradient moves nothing (torch's
    sign of NaN is 0) but is stored as prev; a parameter first stepped after an lr change
    starts from the new lr."""
    rng = np.random.default_rng(2)
    values = {"a": rng.standard_normal(300), "b": rng.standard_normal(7)}
    opt, torch_opt, tensors = _torch_pair("Rprop", values, lr=0.02, step_sizes=(1e-4, 0.05))
    for step in range(12):
        grads = {"a": np.where(rng.random(300) < 0.5, 1.0, -1.0) * rng.random(300)}
        grads["a"][:3] = 1e-200 * (-1) ** step  # g * prev underflows to +-0
        if step == 4:
            grads["a"][5] = np.nan
        if step >= 6:
            grads["b"] = rng.standard_normal(7)
        if step == 6:
            opt.param_groups[0]["lr"] = torch_opt.param_groups[0]["lr"] = 0.005
        _step_both(opt, torch_opt, tensors, grads)
        if step == 6:
            np.testing.assert_array_equal(opt.state_of("b").step_size, 0.005)
        for path, t in tensors.items():
            np.testing.assert_array_equal(opt.params[path], t.detach().numpy(), err_msg=path)
            state = opt.state_of(path)
            if state is not None:
                for name in ("prev", "step_size"):
                    np.testing.assert_array_equal(getattr(state, name),
                                                  torch_opt.state[t][name].numpy())


# ------------------------------------------------------------------------------ others
def test_adamax_infinity_norm_and_bias_correction_by_hand():
    opt = flatopt.Adamax({"w": np.array([1.0, 1.0])}, lr=0.1, betas=(0.5, 0.5), eps=0.0)
    opt.step({"w": np.array([2.0, -4.0])})
    state = opt.state_of("w")
    np.testing.assert_array_equal(state.exp_avg, [1.0, -2.0])
    np.testing.assert_array_equal(state.exp_inf, [2.0, 4.0])
    # lr / (1 - 0.5) * m / u
    np.testing.assert_allclose(opt.params["w"], [1.0 - 0.1, 1.0 + 0.1], rtol=1e-15)
    opt.step({"w": np.array([1.0, 0.0])})
    np.testing.assert_array_equal(state.exp_inf, [1.0, 2.0])  # max(0.5 * u, |g|)


def test_rmsprop_allocates_momentum_and_grad_average_only_when_used():
    w = {"w": np.ones(3, np.float32)}
    plain = flatopt.RMSprop(w)
    plain.step({"w": np.ones(3, np.float32)})
    assert plain.state_of("w").momentum_buffer is None and plain.state_of("w").grad_avg is None
    assert set(plain.state_dict()["state"]["w"]) == {"step", "square_avg"}
    both = flatopt.RMSprop(w, momentum=0.9, centered=True)
    both.step({"w": np.ones(3, np.float32)})
    assert set(both.state_dict()["state"]["w"]) == {"step", "square_avg", "momentum_buffer",
                                                   "grad_avg"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lion_by_hand(dtype):
    """c = b1 m + (1 - b1) g; p = p (1 - lr wd) - lr sign(c); m = b2 m + (1 - b2) g."""
    opt = flatopt.Lion({"w": np.array([1.0, -2.0, 0.5, 3.0], dtype)}, lr=0.25,
                       betas=(0.5, 0.75), weight_decay=0.5)
    opt.step({"w": np.array([2.0, -1.0, 0.0, 4.0], dtype)})
    # m = 0: c = g / 2 -> sign(g); decay factor 1 - 0.125 = 0.875
    np.testing.assert_array_equal(opt.params["w"], np.array([0.625, -1.5, 0.4375, 2.375], dtype))
    np.testing.assert_array_equal(opt.state_of("w").exp_avg, np.array([0.5, -0.25, 0, 1], dtype))
    opt.step({"w": np.array([-0.25, 1.0, 0.0, -2.0], dtype)})
    # c = [0.25 - 0.125, -0.125 + 0.5, 0, 0.5 - 1] = [+, +, 0, -]
    np.testing.assert_array_equal(opt.params["w"], np.array(
        [0.625 * 0.875 - 0.25, -1.5 * 0.875 - 0.25, 0.4375 * 0.875, 2.375 * 0.875 + 0.25],
        dtype))
    np.testing.assert_array_equal(opt.state_of("w").exp_avg,
                                  np.array([0.3125, 0.0625, 0, 0.25], dtype))
    assert opt.state_of("w").step == 2


def test_lion_maximize_ascends_and_a_zero_gradient_still_decays():
    opt = flatopt.Lion({"a": np.array([1.0]), "b": np.array([1.0])}, lr=0.1, weight_decay=1.0,
                       maximize=True)
    opt.step({"a": np.array([1.0]), "b": np.array([0.0])})
    np.testing.assert_allclose(opt.params["a"], [0.9 + 0.1])
    np.testing.assert_allclose(opt.params["b"], [0.9])


# ------------------------------------------------------------------------------ NAdam, ASGD
@pytest.fixture
def torch_float64():
    """torch keeps NAdam's mu_product and ASGD's eta and mu in its default dtype; flatopt in
    float64, which is torch's with float64 as the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _mu(beta1, momentum_decay, t):
    return beta1 * (1.0 - 0.5 * 0.96 ** (t * momentum_decay))


def test_nadam_mu_product_is_per_parameter_and_matches_torch(torch_float64):
    """mu_product starts at 1 at a parameter's own first step and multiplies in mu_t of its
    own step counts; it is a float in the state dict, survives a state-dict round trip, and
    equals torch's."""
    rng = np.random.default_rng(3)
    values = {"early": rng.standard_normal(6), "late": rng.standard_normal(6)}
    opt, torch_opt, tensors = _torch_pair("NAdam", values, lr=0.01, momentum_decay=0.2,
                                          weight_decay=0.1)
    for step in range(8):
        grads = {"early": rng.standard_normal(6)}
        if step >= 5:
            grads["late"] = rng.standard_normal(6)
        if step == 6:
            opt.param_groups[0]["lr"] = torch_opt.param_groups[0]["lr"] = 0.003
        _step_both(opt, torch_opt, tensors, grads)
        for path, t in tensors.items():
            np.testing.assert_allclose(opt.params[path], t.detach().numpy(), rtol=1e-14)
    expected = {"early": np.prod([_mu(0.9, 0.2, t) for t in range(1, 9)]),
                "late": np.prod([_mu(0.9, 0.2, t) for t in range(1, 4)])}
    for path, t in tensors.items():
        entry = opt.state_dict()["state"][path]
        assert type(entry["mu_product"]) is float
        np.testing.assert_allclose(entry["mu_product"], expected[path], rtol=1e-15)
        np.testing.assert_allclose(entry["mu_product"],
                                   torch_opt.state[t]["mu_product"].item(), rtol=1e-15)
    snapshot = opt.state_dict()
    copy = flatopt.NAdam({k: v.copy() for k, v in opt.params.items()}, lr=0.003,
                         momentum_decay=0.2, weight_decay=0.1)
    copy.load_state_dict(snapshot)
    grads = {k: rng.standard_normal(6) for k in values}
    opt.step(grads)
    copy.step(grads)
    for path in values:
        np.testing.assert_array_equal(copy.params[path], opt.params[path])
        assert copy.state_of(path).mu_product == opt.state_of(path).mu_product


@pytest.mark.parametrize("entry, message", [
    ({"mu_product": 1.5}, "mu_product"), ({"mu_product": float("nan")}, "mu_product"),
    ({"mu_product": -0.1}, "mu_product"), ({"mu_product": True}, "mu_product"),
])
def test_nadam_mu_product_in_a_state_dict_is_checked(entry, message):
    opt = flatopt.NAdam({"w": np.zeros(3)})
    opt.step({"w": np.ones(3)})
    snapshot = opt.state_dict()
    snapshot["state"]["w"].update(entry)
    with pytest.raises(flatopt.StateDictError, match=message):
        opt.load_state_dict(snapshot)


def test_asgd_switches_to_averaging_after_t0_and_matches_torch(torch_float64):
    """With t0 = 2.5, mu = 1 / max(1, t - t0) is 1 after steps 1 to 3 (ax is a copy of the
    parameter) and 1/1.5 after step 4, so step 5 is the first averaged one. eta starts at
    the lr of the parameter's first step and follows the lr of the step before."""
    rng = np.random.default_rng(4)
    values = {"w": rng.standard_normal(5), "late": rng.standard_normal(5)}
    opt, torch_opt, tensors = _torch_pair("ASGD", values, lr=0.1, lambd=0.5, alpha=0.75,
                                          t0=2.5, weight_decay=0.05)
    for step in range(1, 9):
        grads = {"w": rng.standard_normal(5)}
        if step >= 4:
            grads["late"] = rng.standard_normal(5)
        if step == 3:
            opt.param_groups[0]["lr"] = torch_opt.param_groups[0]["lr"] = 0.05
        before = opt.state_of("w").ax.copy() if step > 1 else None
        _step_both(opt, torch_opt, tensors, grads)
        state = opt.state_of("w")
        if step <= 4:
            np.testing.assert_array_equal(state.ax, opt.params["w"])
        elif step == 5:
            np.testing.assert_allclose(state.ax, before + (opt.params["w"] - before) / 1.5,
                                       rtol=1e-15)
        assert state.mu == 1 / max(1, step - 2.5)
        for path, t in tensors.items():
            np.testing.assert_allclose(opt.params[path], t.detach().numpy(), rtol=1e-14)
            ours, theirs = opt.state_of(path), torch_opt.state.get(t)
            if ours is None:
                assert not theirs
                continue
            np.testing.assert_allclose(ours.ax, theirs["ax"].numpy(), rtol=1e-14)
            assert ours.eta == theirs["eta"].item() and ours.mu == theirs["mu"].item()
    late = opt.state_dict()["state"]["late"]
    assert late["step"] == 5 and type(late["eta"]) is float
    # first stepped at step 4, after the lr change: eta then was 0.05, and now follows it
    assert late["eta"] == 0.05 / (1 + 0.5 * 0.05 * 5) ** 0.75


def test_asgd_eta_starts_at_the_lr_of_the_first_step():
    opt = flatopt.ASGD({"w": np.array([1.0])}, lr=0.5, lambd=0.0)
    opt.param_groups[0]["lr"] = 0.25
    opt.step({"w": np.array([2.0])})  # p = p * (1 - 0) - 0.25 * g
    np.testing.assert_array_equal(opt.params["w"], [0.5])
    assert opt.state_of("w").eta == 0.25 and opt.state_of("w").mu == 1.0


# ------------------------------------------------------------------------------ Adagrad
def test_adagrad_state_exists_from_construction_like_torchs():
    values = {"a": np.ones(3, np.float32), "b": np.zeros((2, 2), np.float32)}
    opt, torch_opt, tensors = _torch_pair("Adagrad", values, initial_accumulator_value=0.5)
    ours = opt.state_dict()["state"]
    assert set(ours) == {"a", "b"}
    for path, t in tensors.items():
        assert ours[path]["step"] == 0 == torch_opt.state[t]["step"].item()
        np.testing.assert_array_equal(ours[path]["sum"], torch_opt.state[t]["sum"].numpy())
        assert ours[path]["sum"].dtype == np.float32
    _step_both(opt, torch_opt, tensors, {"a": np.ones(3, np.float32)})
    assert opt.state_of("b").step == 0  # a missing gradient: state untouched
    np.testing.assert_array_equal(opt.state_of("b").sum, 0.5)
    np.testing.assert_allclose(opt.params["a"], tensors["a"].detach().numpy(), rtol=1e-6)


def test_adagrad_lr_decay_by_hand():
    """clr = lr / (1 + (t - 1) * lr_decay); sum = sum + g * g; p -= clr * g / (sqrt(sum) + eps)."""
    opt = flatopt.Adagrad({"w": np.array([0.0])}, lr=1.0, lr_decay=0.5, eps=0.0,
                          initial_accumulator_value=3.0)
    opt.step({"w": np.array([1.0])})
    np.testing.assert_array_equal(opt.params["w"], [-0.5])  # 1 * 1 / sqrt(4)
    opt.step({"w": np.array([-4.0])})
    np.testing.assert_allclose(opt.params["w"], [-0.5 + (1 / 1.5) * 4 / np.sqrt(20.0)],
                               rtol=1e-15)
    np.testing.assert_array_equal(opt.state_of("w").sum, [20.0])
    assert opt.state_of("w").step == 2


def test_adagrad_fresh_state_comes_from_each_groups_initial_value():
    """Construction, add_param_group and a state dict lacking an entry all give a parameter
    step 0 and its group's initial_accumulator_value (torch: always the constructor's, and
    a later group's state is created at its first gradient)."""
    opt = flatopt.Adagrad([{"params": {"a": np.zeros(2)}, "initial_accumulator_value": 0.3},
                           {"params": {"b": np.zeros(2)}}], initial_accumulator_value=0.1)
    opt.add_param_group({"params": {"c": np.zeros(2)}, "initial_accumulator_value": 0.7})
    expected = {"a": 0.3, "b": 0.1, "c": 0.7}
    for path, value in expected.items():
        assert opt.state_of(path).step == 0
        np.testing.assert_array_equal(opt.state_of(path).sum, value)
    opt.step({path: np.ones(2) for path in expected})
    snapshot = opt.state_dict()
    del snapshot["state"]["a"]
    opt.load_state_dict(snapshot)
    assert opt.state_of("a").step == 0 and opt.state_of("b").step == 1
    np.testing.assert_array_equal(opt.state_of("a").sum, 0.3)
    np.testing.assert_array_equal(opt.state_of("c").sum, 1.7)
    opt.restore({})  # every parameter back to fresh state
    for path, value in expected.items():
        assert opt.state_of(path).step == 0
        np.testing.assert_array_equal(opt.state_of(path).sum, value)


def test_adagrad_never_stepped_parameters_round_trip_through_a_checkpoint(tmp_path):
    opt = flatopt.Adagrad({"a": np.ones(3), "frozen": np.ones(2)}, initial_accumulator_value=0.2)
    opt.step({"a": np.ones(3)})
    flatopt.save(tmp_path / "ck.h5", opt)
    # the saved state wins over the live group's initial value
    live = flatopt.Adagrad({"a": np.zeros(3), "frozen": np.zeros(2)},
                           initial_accumulator_value=0.5)
    flatopt.load(tmp_path / "ck.h5", live, hyperparameters="saved")
    assert live.param_groups[0]["initial_accumulator_value"] == 0.2
    assert live.state_of("frozen").step == 0 and live.state_of("a").step == 1
    np.testing.assert_array_equal(live.state_of("frozen").sum, 0.2)
    np.testing.assert_array_equal(live.state_of("a").sum, 1.2)


# ------------------------------------------------------------------------------ LAMB
def test_lamb_trust_ratio_is_per_tensor_by_hand():
    """One step from zero moments: m_hat = g, v_hat = g*g, so the direction is
    g / (|g| + eps) + wd * p, and each tensor moves by lr * ||p|| / ||direction|| along it."""
    rng = np.random.default_rng(3)
    values = {"big": 10.0 * rng.standard_normal((4, 5)), "small": 0.1 * rng.standard_normal(7)}
    grads = {k: rng.standard_normal(v.shape) for k, v in values.items()}
    lr, wd, eps = 0.01, 0.1, 1e-6
    opt = flatopt.LAMB({k: v.copy() for k, v in values.items()}, lr=lr, weight_decay=wd,
                       eps=eps)
    opt.step(grads)
    for path, p in values.items():
        g = grads[path]
        direction = g / (np.abs(g) + eps) + wd * p
        ratio = np.linalg.norm(p) / np.linalg.norm(direction)
        np.testing.assert_allclose(opt.params[path], p - lr * ratio * direction, rtol=1e-12)
    moved = {k: np.linalg.norm(opt.params[k] - values[k]) / np.linalg.norm(values[k])
             for k in values}
    assert moved["big"] == pytest.approx(moved["small"], rel=1e-9)  # the same relative move


def test_lamb_without_weight_decay_does_not_adapt_unless_asked():
    """apex's FusedLAMB: the ratio applies with weight decay or always_adapt; a zero
    parameter (norm 0) takes the plain lr."""
    values = {"w": np.array([3.0, -4.0]), "zero": np.zeros(3)}
    grads = {"w": np.array([1.0, 1.0]), "zero": np.array([1.0, -2.0, 0.5])}
    plain = flatopt.LAMB({k: v.copy() for k, v in values.items()}, lr=0.1, weight_decay=0.0)
    adapted = flatopt.LAMB({k: v.copy() for k, v in values.items()}, lr=0.1, weight_decay=0.0,
                           always_adapt=True)
    plain.step(grads)
    adapted.step(grads)
    direction = grads["w"] / (np.abs(grads["w"]) + 1e-6)
    np.testing.assert_allclose(plain.params["w"], values["w"] - 0.1 * direction, rtol=1e-12)
    ratio = 5.0 / np.linalg.norm(direction)
    np.testing.assert_allclose(adapted.params["w"], values["w"] - 0.1 * ratio * direction,
                               rtol=1e-12)
    for opt in (plain, adapted):
        np.testing.assert_allclose(opt.params["zero"],
                                   -0.1 * grads["zero"] / (np.abs(grads["zero"]) + 1e-6))


# ------------------------------------------------------------------------------ Muon
@pytest.mark.parametrize("ns_dtype, wide, tall, steps", [(None, (6, 10), (12, 5), 3),
                                                         ("bfloat16", (80, 144), (144, 80), 4)])
def test_muon_matches_torch_to_bfloat16_precision(ns_dtype, wide, tall, steps):
    """torch orthogonalises in bfloat16, flatopt in the parameter's dtype (``ns_dtype``
    None) or with bfloat16 products (``"bfloat16"``): the momentum buffers agree to rounding
    (torch's vectorised lerp fuses its multiply-add), the parameter moves to about
    bfloat16's precision. (With bfloat16 products both sides round independently: at 6 x 10
    a fifth to a half of the seeds exceed 2e-2, at 80 x 144 none of 60.)"""
    rng = np.random.default_rng(4)
    values = {"wide": rng.standard_normal(wide).astype(np.float32),
              "tall": rng.standard_normal(tall).astype(np.float32)}
    hp = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    _, torch_opt, tensors = _torch_pair("Muon", values, **hp)
    opt = flatopt.Muon({k: v.copy() for k, v in values.items()}, ns_dtype=ns_dtype, **hp)
    for step in range(steps):
        grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in values.items()
                 if step != 1 or k == "wide"}  # "tall" misses step 1
        before = {k: opt.params[k].copy() for k in values}
        _step_both(opt, torch_opt, tensors, grads)
        for path, t in tensors.items():
            np.testing.assert_allclose(opt.state_of(path).momentum_buffer,
                                       torch_opt.state[t]["momentum_buffer"].numpy(),
                                       rtol=1e-6, atol=1e-7)
            ours = opt.params[path] - before[path]
            theirs = t.detach().numpy() - before[path]
            if path not in grads:
                assert not ours.any()
                continue
            assert np.linalg.norm(ours - theirs) <= 2e-2 * np.linalg.norm(theirs), path
            t.data.copy_(torch.from_numpy(opt.params[path].copy()))  # no drift between them


def test_muon_refuses_non_matrices_and_names_the_path():
    with pytest.raises(flatopt.ParamError, match=r"'enc\.bias'.*2-D.*AdamW"):
        flatopt.Muon({"enc.weight": np.zeros((3, 4)), "enc.bias": np.zeros(4)})


# ------------------------------------------------------------------------------ Adafactor
ADAFACTOR_SHAPES = {"w": (300, 200), "t": (2, 5, 7), "b": (200,), "s": (), "e": (3, 0)}


def _adafactor_problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in ADAFACTOR_SHAPES.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in ADAFACTOR_SHAPES.items()
              if (step + len(k)) % 4} for step in range(5)]
    return params, grads


def test_adafactor_keeps_rows_plus_columns_of_state_per_matrix_as_torch_does():
    params, grads = _adafactor_problem()
    del params["e"]  # torch divides by zero on a zero-size parameter
    opt, torch_opt, tensors = _torch_pair("Adafactor", params, weight_decay=0.1)
    for step_grads in grads:
        _step_both(opt, torch_opt, tensors, {k: v for k, v in step_grads.items() if k != "e"})
    for path, t in tensors.items():
        ours, theirs = opt.state_of(path), torch_opt.state[t]
        assert ours.step == int(theirs["step"].item())
        for name in ("row_var", "col_var", "variance"):
            value = getattr(ours, name)
            assert (value is None) == (name not in theirs), (path, name)
            if value is not None:
                np.testing.assert_allclose(value, theirs[name].numpy(), rtol=1e-5, err_msg=path)
        np.testing.assert_allclose(opt.params[path], t.detach().numpy(), rtol=1e-5, atol=1e-6)
    state = {name: flat for buf in opt.buffers for name, flat in buf.state.items()}
    # 300 + 10 and 200 + 14 values of the factors (each entry aligned to 16 float32), 200 + 1
    # of the vectors' variance: not the 60,000 + 70 a parameter-sized second moment takes
    assert state["row_var"].size == 304 + 16 and state["col_var"].size == 208 + 16
    assert state["variance"].size == 208 + 16


def test_adafactor_passes_compile_once_per_dtype_and_do_not_depend_on_threads(monkeypatch):
    """On threads (forced for these small matrices) and on one thread (the serial kernels),
    the same bits."""
    import numba

    from flatopt.kernels import threads
    from flatopt.kernels.rules import adafactor as rule
    passes = [p.parallel for p in (rule._square_sums, rule._update_square_sums, rule._apply)]
    params, grads = _adafactor_problem(1)
    opt = flatopt.Adafactor(params, weight_decay=0.1)
    monkeypatch.setattr(threads, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(threads, "_policy", "always")
    opt.step(grads[0])
    counts = [len(p.signatures) for p in passes]
    assert all(counts)
    opt.param_groups[0]["lr"] = 0.5e-2
    opt.param_groups[0]["maximize"] = True
    for step_grads in grads[1:]:
        opt.step(step_grads)
    assert [len(p.signatures) for p in passes] == counts
    one_thread = flatopt.Adafactor(params, weight_decay=0.1)
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        one_thread.step(grads[0])
        one_thread.param_groups[0].update(lr=0.5e-2, maximize=True)
        for step_grads in grads[1:]:
            one_thread.step(step_grads)
    finally:
        numba.set_num_threads(previous)
    for path in params:
        assert one_thread.params[path].tobytes() == opt.params[path].tobytes(), path


def test_adafactor_leaves_a_zero_size_parameter_alone_and_counts_its_steps():
    opt = flatopt.Adafactor({"e": np.zeros((3, 0), np.float32), "v": np.zeros(0, np.float32)})
    opt.step({"e": np.zeros((3, 0), np.float32), "v": np.zeros(0, np.float32)})
    assert opt.state_of("e").step == 1 and opt.state_of("e").col_var.shape == (1, 0)
    assert opt.state_of("e").row_var.shape == (3, 1) and opt.state_of("e").variance is None
    assert opt.state_of("v").variance.shape == (0,)


def test_adafactor_state_dict_entries_are_checked_against_each_parameters_shape():
    params, grads = _adafactor_problem()
    opt = flatopt.Adafactor(params)
    opt.step(grads[0])
    snapshot = opt.state_dict()
    entry = snapshot["state"]["w"]
    bad = {**snapshot, "state": {**snapshot["state"], "w": {**entry, "row_var": entry["col_var"]},
                                 "b": {**snapshot["state"]["b"],
                                       "row_var": np.zeros((200, 1), np.float32)}}}
    fresh = flatopt.Adafactor(params)
    with pytest.raises(flatopt.StateDictError) as info:
        fresh.load_state_dict(bad)
    assert "'w': row_var" in str(info.value) and "(300, 1)" in str(info.value)
    assert "'b' has 'row_var'" in str(info.value)
    assert fresh.state_of("w") is None  # nothing changed
    fresh.load_state_dict(snapshot)
    np.testing.assert_array_equal(fresh.state_of("w").col_var, opt.state_of("w").col_var)


def test_adafactor_saves_what_a_state_dict_load_left(tmp_path):
    """Found by tests/test_state_machine.py: a step allocates every slot, a state-dict load
    only those its parameters have entries in (a buffer of matrices has no ``variance``, one
    of vectors no factors); the saved file then lacked those datasets and load refused it as
    damaged. A slot no parameter of a buffer has an entry in holds nothing: not required."""
    from flatopt.checkpoint import verify_checkpoint

    def build():
        return flatopt.Adafactor([{"params": {"m": np.ones((3, 4), np.float32)}},
                                  {"params": {"v": np.ones(4, np.float64)}}])
    stepped = build()
    stepped.step({p: np.ones(v.shape, v.dtype) for p, v in stepped.params.items()})
    restored = build()
    restored.load_state_dict(stepped.state_dict())
    flatopt.save(tmp_path / "ck.h5", restored)
    assert verify_checkpoint(tmp_path / "ck.h5")["ok"]
    resumed = build()
    flatopt.load(tmp_path / "ck.h5", resumed)
    for opt in (restored, resumed):
        opt.step({p: np.full(v.shape, 0.5, v.dtype) for p, v in opt.params.items()})
    assert all(restored.params[p].tobytes() == resumed.params[p].tobytes()
               for p in restored.params)


def test_adafactor_checkpoints_store_the_factors_and_load_into_another_layout(tmp_path):
    import h5py
    params, grads = _adafactor_problem()
    opt = flatopt.Adafactor(params, weight_decay=0.1)
    for step_grads in grads[:3]:
        opt.step(step_grads)
    path = tmp_path / "adafactor.h5"
    flatopt.save(path, opt)
    with h5py.File(path) as f:
        assert f.attrs["format_version"] == 3  # shaped slots have their own lengths
        buffer = f["groups/0/float32"]
        # the factors' entries, aligned to 16 float32: (300 + 4) + 16 for (2, 5, 1) + 16 for
        # the zero-size (3, 0) matrix's (3, 1)
        assert buffer["row_var"].shape == (336,) and buffer["params"].shape[0] > 60_000
    same = flatopt.Adafactor({k: np.zeros_like(v) for k, v in params.items()}, weight_decay=0.1)
    flatopt.load(path, same)
    # another layout: a new parameter first moves every offset; the state goes path by path
    other = flatopt.Adafactor({"new": np.ones((4, 4), np.float32),
                               **{k: np.zeros_like(v) for k, v in params.items()}},
                              weight_decay=0.1)
    flatopt.load(path, other, strict=False)
    assert other.state_of("new") is None
    for step_grads in grads[3:]:
        for each in (opt, same, other):
            each.step(step_grads)
    for key in params:
        assert same.params[key].tobytes() == opt.params[key].tobytes(), key
        assert other.params[key].tobytes() == opt.params[key].tobytes(), key
    adam_path = tmp_path / "adam.h5"
    flatopt.save(adam_path, flatopt.Adam({"w": np.ones(3, np.float32)}))
    with h5py.File(adam_path) as f:
        assert f.attrs["format_version"] == 2  # readable by a flatopt that reads version 2


# ------------------------------------------------------------------------------ constructors
KINDS = ["Adamax", "RAdam", "Adadelta", "RMSprop", "Rprop", "NAdam", "ASGD", "Adagrad", "Muon",
         "Adafactor"]
TORCH_ONLY = {"foreach", "fused", "capturable", "differentiable"}
FLATOPT_ONLY = {"Muon": ["ns_dtype"]}
"""flatopt's own settings, keyword-only after torch's, defaulting to torch's behaviour or
flatopt's documented one."""


@pytest.mark.parametrize("kind", KINDS)
def test_signature_and_defaults_are_torchs(kind):
    ours = inspect.signature(getattr(flatopt, kind).__init__).parameters
    theirs = inspect.signature(getattr(torch.optim, kind).__init__).parameters
    names = [n for n in theirs if n not in TORCH_ONLY]
    extras = FLATOPT_ONLY.get(kind, [])
    assert [n for n in ours if n != "unknown"] == names + extras
    assert all(ours[n].kind is ours[n].KEYWORD_ONLY for n in extras)
    for name in names[1:]:
        assert ours[name].default == theirs[name].default, name
    torch_keyword_only = {n for n, p in theirs.items() if p.kind is p.KEYWORD_ONLY}
    for name in names:
        if name in torch_keyword_only:
            assert ours[name].kind is ours[name].KEYWORD_ONLY, name


@pytest.mark.parametrize("kind, kwargs", [
    ("Adamax", {"lr": -1.0}), ("Adamax", {"eps": -1e-8}), ("Adamax", {"betas": (1.0, 0.9)}),
    ("Adamax", {"betas": (0.9, -0.1)}), ("Adamax", {"weight_decay": -0.1}),
    ("RAdam", {"lr": -1.0}), ("RAdam", {"betas": (0.9, 1.0)}), ("RAdam", {"eps": -1.0}),
    ("RAdam", {"weight_decay": -1.0}),
    ("Adadelta", {"lr": -1.0}), ("Adadelta", {"rho": 1.5}), ("Adadelta", {"rho": -0.1}),
    ("Adadelta", {"eps": -1.0}), ("Adadelta", {"weight_decay": -1.0}),
    ("RMSprop", {"lr": -1.0}), ("RMSprop", {"eps": -1.0}), ("RMSprop", {"momentum": -0.5}),
    ("RMSprop", {"weight_decay": -1.0}), ("RMSprop", {"alpha": -0.5}),
    ("Rprop", {"lr": -1.0}), ("Rprop", {"etas": (0.0, 1.2)}), ("Rprop", {"etas": (0.5, 1.0)}),
    ("Rprop", {"etas": (1.0, 1.2)}),
    ("NAdam", {"lr": -1.0}), ("NAdam", {"eps": -1.0}), ("NAdam", {"betas": (1.0, 0.9)}),
    ("NAdam", {"betas": (0.9, -0.1)}), ("NAdam", {"weight_decay": -1.0}),
    ("NAdam", {"momentum_decay": -1.0}),
    ("ASGD", {"lr": -1.0}), ("ASGD", {"weight_decay": -1.0}),
    ("Adagrad", {"lr": -1.0}), ("Adagrad", {"lr_decay": -1.0}),
    ("Adagrad", {"weight_decay": -1.0}), ("Adagrad", {"initial_accumulator_value": -1.0}),
    ("Adagrad", {"eps": -1.0}),
    ("Adafactor", {"lr": -1.0}), ("Adafactor", {"beta2_decay": 0.5}),
    ("Adafactor", {"eps": (-1.0, 1e-3)}), ("Adafactor", {"eps": (None, -1.0)}),
    ("Adafactor", {"d": 0.5}), ("Adafactor", {"weight_decay": -1.0}),
])
def test_torchs_constructor_checks_are_kept(kind, kwargs):
    with pytest.raises(ValueError):
        getattr(torch.optim, kind)([torch.zeros(1, requires_grad=True)], **kwargs)
    with pytest.raises(HyperparameterError, match=next(iter(kwargs))):
        getattr(flatopt, kind)({"w": np.zeros(1)}, **kwargs)
    with pytest.raises(HyperparameterError, match="param group 0"):
        getattr(flatopt, kind)([{"params": {"w": np.zeros(1)}, **kwargs}])


@pytest.mark.parametrize("kind, kwargs", [
    ("RMSprop", {"alpha": 1.5}), ("Rprop", {"step_sizes": (0.1, 0.01)}),
    ("Rprop", {"step_sizes": (-1.0, 1.0)}), ("Lion", {"betas": (0.9, 1.0)}),
    ("Lion", {"lr": -1.0}), ("Lion", {"weight_decay": -1.0}),
    ("ASGD", {"lambd": -1e-4}), ("ASGD", {"alpha": -0.75}), ("ASGD", {"t0": -1.0}),
])
def test_flatopt_is_stricter_where_torch_checks_nothing(kind, kwargs):
    with pytest.raises(HyperparameterError, match=next(iter(kwargs))):
        getattr(flatopt, kind)({"w": np.zeros(1)}, **kwargs)
