"""Prodigy and AdEMAMix against the real packages: ``prodigyopt.Prodigy`` and bitsandbytes'
``_ReferenceAdEMAMix`` (torch CPU tensors), on random configurations (groups, float32 and
float64, missing gradients, several steps); float64 within 1e-10 relative over the whole run,
float32 within 2e-5 per step (each step starting from flatopt's state). Then Prodigy's global
d estimate: the same bits serial and threaded and over MPI, group state through checkpoints
and state dicts, and the refusals."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

import flatopt
from flatopt.kernels import threads
from optimizers import slow_beyond

torch = pytest.importorskip("torch")

DTYPES = [np.float32, np.float64]
SHAPES = [(), (7,), (5, 3), (17, 33), (40_000,), (2, 3, 4)]
GROUP_STATE = ("d", "d_max", "d_numerator", "k")


def _rtol(dtype):
    return 2e-5 if dtype == np.float32 else 1e-10


def _close(ours, theirs, dtype, what):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    scale = max(1.0, float(np.max(np.abs(theirs), initial=0.0)))
    np.testing.assert_allclose(ours, theirs, rtol=_rtol(dtype),
                               atol=(1e-6 if dtype == np.float32 else 1e-14) * scale,
                               err_msg=what)


def _params(rng, dtype, count, prefix):
    params = {}
    for i in range(count):
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        value = np.asarray(rng.standard_normal(shape), dtype)
        if rng.random() < 0.15:
            value[...] = 0  # prodigyopt keeps p0 of an all-zero parameter as a 0-d zero
        params[f"{prefix}{i}.w"] = value
    return params


def _gradients(rng, params, targets, dtype, zero=False):
    """A pull towards ``targets`` (so that d grows) plus noise; some missing."""
    grads = {}
    for path, p in params.items():
        if rng.random() < 0.2:
            continue
        g = (p - targets[path]) + 0.3 * rng.standard_normal(p.shape)
        grads[path] = np.zeros(p.shape, dtype) if zero else np.asarray(g, dtype)
    return grads


# ----------------------------------------------------------------------------- Prodigy
def prodigy_problem(seed, dtype):
    rng = np.random.default_rng([seed, zlib.crc32(b"Prodigy"), int(dtype == np.float64)])
    beta1 = [0.9, 0.0, 0.5][int(rng.integers(3))]
    common = {  # prodigyopt reads these from group 0: every group gets the same here
        "betas": (beta1, [0.999, 0.99][int(rng.integers(2))]),
        "beta3": [None, 0.95][int(rng.integers(2))],
        "decouple": bool(rng.integers(2)),
        "use_bias_correction": bool(rng.integers(2)),
        "d_coef": [1.0, 0.5, 2.0][int(rng.integers(3))],
        "growth_rate": [float("inf"), 1.05][int(rng.integers(2))],
    }
    d0 = [1e-6, 1e-3][int(rng.integers(2))]
    groups = []
    for number in range(int(rng.integers(1, 4))):
        hp = {"lr": 0.0 if number and rng.random() < 0.25 else 1.0,
              "eps": [1e-8, 1e-6][int(rng.integers(2))],
              "weight_decay": [0.0, 0.01, 0.1][int(rng.integers(3))],
              "safeguard_warmup": bool(rng.integers(2)),
              "d0": [d0, 1e-4][int(rng.random() < 0.2)]}
        groups.append((_params(rng, dtype, int(rng.integers(1, 4)), f"g{number}."), hp))
    targets = {path: np.asarray(rng.standard_normal(p.shape), dtype)
               for params, _ in groups for path, p in params.items()}
    return rng, common, d0, groups, targets


def _prodigy_pair(common, d0, groups):
    from prodigyopt import Prodigy as Reference
    opt = flatopt.Prodigy([{"params": {k: v.copy() for k, v in params.items()}, **hp}
                           for params, hp in groups], d0=d0, **common)
    tensors = {path: torch.tensor(p.copy(), requires_grad=True)
               for params, _ in groups for path, p in params.items()}
    ref = Reference([{"params": [tensors[path] for path in params], **hp}
                     for params, hp in groups], d0=d0, **common)
    return opt, ref, tensors


def _prodigy_state(ref, t, p_shape):
    """prodigyopt's state of one tensor as arrays of the parameter's shape."""
    state = ref.state[t]
    out = {"step": int(state["step"])}
    for name in ("exp_avg", "exp_avg_sq", "s", "p0"):
        if name in state:
            value = state[name].detach().numpy()
            out[name] = np.broadcast_to(value, p_shape) if value.ndim == 0 else \
                value.reshape(p_shape)
    return out


def _force_prodigy(opt, ref, tensors):
    """Teacher forcing: prodigyopt continues from flatopt's parameters, state and d."""
    with torch.no_grad():
        for path, t in tensors.items():
            t.copy_(torch.from_numpy(opt.params[path].copy()))
            ours = opt.state_of(path)
            if ours is None:
                continue
            theirs = ref.state[t]
            for name in ("exp_avg", "exp_avg_sq", "s", "p0"):
                value = torch.from_numpy(np.array(getattr(ours, name)))
                # (prodigyopt's p0 of an all-zero parameter is a 0-d zero: ours is zeros)
                if name in theirs and theirs[name].numel() == value.numel():
                    theirs[name] = value.reshape(theirs[name].shape)
    for ours, theirs in zip(opt.param_groups, ref.param_groups):
        theirs.update({key: ours[key] for key in GROUP_STATE})


@pytest.mark.parametrize("seed", slow_beyond(range(6)))
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_prodigy_matches_prodigyopt(dtype, seed):
    rng, common, d0, groups, targets = prodigy_problem(seed, dtype)
    opt, ref, tensors = _prodigy_pair(common, d0, groups)
    for step in range(10):
        grads = _gradients(rng, opt.params, targets, dtype, zero=step == 0 and seed == 0)
        for path, t in tensors.items():
            t.grad = torch.from_numpy(grads[path].copy()) if path in grads else None
        ref.step()
        opt.step(grads)
        for path, t in tensors.items():
            where = f"seed {seed} step {step} {path}"
            _close(opt.params[path], t.detach().numpy(), dtype, where)
            ours = opt.state_of(path)
            assert (ours is None) == (len(ref.state[t]) == 0), where
            if ours is None:
                continue
            theirs = _prodigy_state(ref, t, t.shape)
            assert ours.step == theirs["step"], where
            for name in ("exp_avg_sq", "s", "p0") + (("exp_avg",) if "exp_avg" in theirs
                                                      else ()):
                _close(getattr(ours, name), theirs[name], dtype, f"{where} {name}")
            if "exp_avg" not in theirs:  # beta1 = 0: kept, never written
                assert not np.any(ours.exp_avg), where
        for ours, theirs in zip(opt.param_groups, ref.param_groups):
            assert ours["k"] == theirs["k"], step
            for key in ("d", "d_max", "d_numerator"):
                np.testing.assert_allclose(ours[key], float(theirs[key]),
                                           rtol=1e-10 if dtype == np.float64 else 1e-5,
                                           err_msg=f"{key} step {step}")
        if dtype == np.float32:
            _force_prodigy(opt, ref, tensors)


def test_prodigys_d_grows_in_these_problems():
    """The conformance runs above exercise a moving d, not only d0."""
    grown = 0
    for seed in range(6):
        rng, common, d0, groups, targets = prodigy_problem(seed, np.float64)
        opt, _, _ = _prodigy_pair(common, d0, groups)
        for _ in range(10):
            opt.step(_gradients(rng, opt.params, targets, np.float64))
        grown += opt.param_groups[0]["d"] > 10 * d0
    assert grown >= 3


def test_prodigy_step_with_zero_gradients_only_creates_state():
    """A d denominator of 0 (every gradient zero): prodigyopt creates state (p0 taken,
    step 0) and returns before moving anything or advancing k."""
    from prodigyopt import Prodigy as Reference
    p = np.arange(6, dtype=np.float64).reshape(2, 3)
    opt = flatopt.Prodigy({"w": p.copy()}, weight_decay=0.1)
    t = torch.tensor(p.copy(), requires_grad=True)
    ref = Reference([t], weight_decay=0.1)
    t.grad = torch.zeros(2, 3, dtype=torch.float64)
    ref.step()
    opt.step({"w": np.zeros((2, 3))})
    state = opt.state_of("w")
    assert state is not None and state.step == 0 == ref.state[t]["step"]
    np.testing.assert_array_equal(state.p0.ravel(), ref.state[t]["p0"].numpy())
    np.testing.assert_array_equal(opt.params["w"], p)
    assert opt.param_groups[0]["k"] == 0 == ref.param_groups[0]["k"]


def test_prodigy_mixed_lrs_scale_their_own_groups():
    """prodigyopt refuses a group lr that is neither the largest nor 0; flatopt steps such a
    group with its own lr: with the same gradients and d, a group at lr 0.5 moves half as
    far as one at lr 1 on its first step (Adam's first step moves every element by dlr)."""
    from prodigyopt import Prodigy as Reference
    t = [torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)]
    ref = Reference([{"params": [t[0]], "lr": 1.0}, {"params": [t[1]], "lr": 0.5}])
    for x in t:
        x.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="different lr"):
        ref.step()
    opt = flatopt.Prodigy([{"params": {"a": np.ones(3)}, "lr": 1.0},
                           {"params": {"b": np.ones(3)}, "lr": 0.5}], betas=(0.0, 0.999))
    opt.step({"a": np.ones(3), "b": np.ones(3)})
    moved_a, moved_b = 1 - opt.params["a"], 1 - opt.params["b"]
    np.testing.assert_allclose(moved_b, moved_a / 2, rtol=1e-12)


def _large_prodigy(dtype):
    rng = np.random.default_rng(5)
    shapes = [(300_000,), (1000, 70), (33,), (70_001,)]
    groups = [{"params": {f"g{g}.p{i}": rng.standard_normal(s).astype(dtype)
                          for i, s in enumerate(shapes[2 * g:2 * g + 2])},
               "weight_decay": 0.01 * g, "decouple": True}
              for g in range(2)]
    return flatopt.Prodigy(groups, use_bias_correction=True), rng


def _run_large(monkeypatch, parallel: bool, dtype):
    if parallel:
        monkeypatch.setattr(threads, "PARALLEL_MIN_ELEMENTS", 0)
        monkeypatch.setattr(threads, "_policy", "always")
    else:
        monkeypatch.setattr(threads, "_policy", "never")
    opt, rng = _large_prodigy(dtype)
    for step in range(6):
        opt.step({path: (0.5 * opt.params[path] - 1
                         + rng.standard_normal(view.shape)).astype(dtype)
                  for path, view in opt.params.items() if step != 2 or path != "g0.p0"})
    monkeypatch.undo()
    return opt


@pytest.mark.parametrize("dtype", slow_beyond(DTYPES), ids=["float32", "float64"])
def test_prodigy_threaded_and_serial_give_the_same_bits(monkeypatch, dtype):
    serial = _run_large(monkeypatch, False, dtype)
    parallel = _run_large(monkeypatch, True, dtype)
    assert serial.param_groups[0]["d"] > 1e-6  # d moved: the sums mattered
    for key in GROUP_STATE:
        assert serial.param_groups[1][key] == parallel.param_groups[1][key], key
    for path in serial.index.paths:
        assert serial.params[path].tobytes() == parallel.params[path].tobytes(), path
        for name, value in serial.state_of(path)._asdict().items():
            assert np.asarray(value).tobytes() == \
                np.asarray(getattr(parallel.state_of(path), name)).tobytes(), (path, name)


def test_prodigy_resumes_bit_exactly_from_a_checkpoint_and_a_state_dict(tmp_path):
    """d, d_max, d_numerator and k travel with the state: a fresh optimizer loaded with the
    default options (or a state dict with hyperparameters="live") continues with the same
    bits as the run that never stopped."""
    def fresh():
        return _large_prodigy(np.float32)[0]

    rng = np.random.default_rng(3)
    schedule = [{path: 0.3 * rng.standard_normal(view.shape).astype(np.float32) + 1
                 for path, view in fresh().params.items()} for _ in range(8)]
    straight = fresh()
    for grads in schedule[:4]:
        straight.step(grads)
    flatopt.save(tmp_path / "p.h5", straight)
    snapshot = straight.state_dict()  # state and groups; the parameters are the model's
    values = {path: view.copy() for path, view in straight.params.items()}
    for grads in schedule[4:]:
        straight.step(grads)
    for load in (lambda opt: flatopt.load(tmp_path / "p.h5", opt),
                 lambda opt: opt.load_state_dict(snapshot, hyperparameters="live")):
        resumed = fresh()
        for path, value in values.items():
            resumed.params[path][...] = value
        load(resumed)
        assert resumed.param_groups[0]["k"] == 4 and resumed.param_groups[0]["d"] > 1e-6
        for grads in schedule[4:]:
            resumed.step(grads)
        for key in GROUP_STATE:
            assert resumed.param_groups[0][key] == straight.param_groups[0][key], key
        for path in straight.index.paths:
            assert resumed.params[path].tobytes() == straight.params[path].tobytes(), path


@pytest.mark.parametrize("values, match", [
    ({"slice_p": 2}, "slice_p=2 is invalid.*not supported yet"),
    ({"fsdp_in_use": True}, "fsdp_in_use=True is invalid.*comm="),
    ({"eps": 0.0}, "eps=0.0 is invalid"),
    ({"d0": -1.0}, "d0=-1.0 is invalid"),
    ({"growth_rate": 0.0}, "growth_rate=0.0 is invalid"),
])
def test_prodigy_refuses_what_it_cannot_do_naming_the_group(values, match):
    with pytest.raises(flatopt.HyperparameterError, match=match):
        flatopt.Prodigy({"w": np.ones(3)}, **values)
    opt = flatopt.Prodigy([{"params": {"w": np.ones(3)}, "label": "body"}])
    opt.param_groups[0].update(values)
    with pytest.raises(flatopt.HyperparameterError, match="param group 0 \\('body'\\)"):
        opt.step({"w": np.ones(3)})


@pytest.mark.mpi
@pytest.mark.slow
def test_prodigy_under_mpi_is_one_process_bit_for_bit():
    """ZeRO-1 at 2 and 3 ranks (tests/mpi_worker.py's identity check: clipping, grad_scale,
    gradients missing on some ranks, two groups and dtypes): the same bits as one process on
    the mean gradient, so the same d on every rank."""
    test_mpi = pytest.importorskip("test_mpi")
    if test_mpi._skip_reason():
        pytest.skip(test_mpi._skip_reason())
    for size in (2, 3):
        ok = test_mpi.checks_by_rank(
            test_mpi.run_job(size, "identity", "--only", "Prodigy", "AdEMAMix"), size)
        for name in ("Prodigy", "AdEMAMix"):
            assert ok.get(f"identity {name} at {size} ranks") == set(range(size)), name


# ----------------------------------------------------------------------------- AdEMAMix
def ademamix_problem(seed, dtype):
    rng = np.random.default_rng([seed, zlib.crc32(b"AdEMAMix"), int(dtype == np.float64)])
    groups = []
    for number in range(int(rng.integers(1, 4))):
        schedules = rng.random() < 0.5
        hp = {"lr": [1e-3, 1e-2][int(rng.integers(2))],
              "betas": [(0.9, 0.999, 0.9999), (0.8, 0.99, 0.999)][int(rng.integers(2))],
              "alpha": [5.0, 2.0][int(rng.integers(2))],
              "eps": [1e-8, 1e-6][int(rng.integers(2))],
              "weight_decay": [1e-2, 0.0, 0.1][int(rng.integers(3))],
              "t_alpha": int(rng.integers(2, 8)) if schedules else None,
              "t_beta3": int(rng.integers(2, 12)) if schedules else None}
        # one parameter per scheduled group: see test_ademamix_schedules_once_per_parameter
        count = 1 if schedules else int(rng.integers(1, 4))
        groups.append((_params(rng, dtype, count, f"g{number}."), hp))
    return rng, groups


@pytest.mark.parametrize("seed", slow_beyond(range(6)))
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_ademamix_matches_bitsandbytes_reference(dtype, seed):
    from bitsandbytes.optim.ademamix import _ReferenceAdEMAMix as Reference
    rng, groups = ademamix_problem(seed, dtype)
    opt = flatopt.AdEMAMix([{"params": {k: v.copy() for k, v in params.items()}, **hp}
                            for params, hp in groups])
    tensors = {path: torch.tensor(p.copy(), requires_grad=True)
               for params, _ in groups for path, p in params.items()}
    ref = Reference([{"params": [tensors[path] for path in params], **hp}
                     for params, hp in groups])
    for step in range(10):
        grads = {path: np.asarray(rng.standard_normal(tuple(t.shape)), dtype)
                 for path, t in tensors.items() if rng.random() < 0.75}
        if step == 3:
            grads = {}  # no gradient anywhere: the group counts advance all the same
        for path, t in tensors.items():
            t.grad = torch.from_numpy(grads[path].copy()) if path in grads else None
        ref.step()
        opt.step(grads)
        for ours, theirs in zip(opt.param_groups, ref.param_groups):
            assert ours["step"] == theirs["step"] == step + 1
        for path, t in tensors.items():
            where = f"seed {seed} step {step} {path}"
            _close(opt.params[path], t.detach().numpy(), dtype, where)
            ours = opt.state_of(path)
            assert (ours is None) == (len(ref.state[t]) == 0), where
            if ours is not None:
                m1_m2 = ref.state[t]["m1_m2"].numpy()
                _close(ours.m1, m1_m2[0], dtype, f"{where} m1")
                _close(ours.m2, m1_m2[1], dtype, f"{where} m2")
                _close(ours.nu, ref.state[t]["nu"].numpy(), dtype, f"{where} nu")


def test_ademamix_schedules_once_per_parameter():
    """The reference rebinds alpha inside its parameter loop, so a group's second parameter
    gets the alpha schedule applied twice; flatopt gives every parameter the schedule once:
    each equals the reference run with that parameter alone in its group."""
    from bitsandbytes.optim.ademamix import _ReferenceAdEMAMix as Reference
    hp = {"lr": 0.1, "t_alpha": 10, "t_beta3": 20}
    values = {"a": np.full(4, 1.0), "b": np.full(4, -2.0)}
    opt = flatopt.AdEMAMix({k: v.copy() for k, v in values.items()}, **hp)
    alone = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in values.items()}
    refs = [Reference([t], **hp) for t in alone.values()]
    together = [torch.tensor(v.copy(), requires_grad=True) for v in values.values()]
    ref_together = Reference(together, **hp)
    for step in range(3):
        grads = {"a": np.full(4, 0.5 + step), "b": np.full(4, 1.0 - step)}
        opt.step(grads)
        for (path, t), ref in zip(alone.items(), refs):
            t.grad = torch.from_numpy(grads[path].copy())
            ref.step()
        for t, path in zip(together, values):
            t.grad = torch.from_numpy(grads[path].copy())
        ref_together.step()
    for path, t in alone.items():
        np.testing.assert_allclose(opt.params[path], t.detach().numpy(), rtol=1e-12)
    assert not np.allclose(together[1].detach().numpy(), alone["b"].detach().numpy())


def test_ademamix_group_step_survives_a_checkpoint_and_counts_without_gradients(tmp_path):
    opt = flatopt.AdEMAMix([{"params": {"a": np.ones(3)}},
                            {"params": {"b": np.ones(2)}, "t_alpha": 4}])
    opt.step({"a": np.ones(3)})
    opt.step({})
    assert [g["step"] for g in opt.param_groups] == [2, 2]
    assert opt.state_of("b") is None
    flatopt.save(tmp_path / "a.h5", opt)
    resumed = flatopt.AdEMAMix([{"params": {"a": np.ones(3)}},
                                {"params": {"b": np.ones(2)}, "t_alpha": 4}])
    flatopt.load(tmp_path / "a.h5", resumed)
    assert [g["step"] for g in resumed.param_groups] == [2, 2]
    for o in (opt, resumed):
        o.step({"a": np.full(3, 0.5), "b": np.full(2, 0.5)})
    for path in ("a", "b"):
        assert opt.params[path].tobytes() == resumed.params[path].tobytes()


def test_ademamix_refuses_a_beta3_schedule_without_logarithms():
    with pytest.raises(flatopt.HyperparameterError, match="t_beta3=5 schedules beta3"):
        flatopt.AdEMAMix({"w": np.ones(2)}, betas=(0.0, 0.999, 0.9999), t_beta3=5)
    with pytest.raises(flatopt.HyperparameterError, match="t_alpha=0 is invalid"):
        flatopt.AdEMAMix({"w": np.ones(2)}, t_alpha=0)
    with pytest.raises(flatopt.HyperparameterError, match="betas=.*is invalid"):
        flatopt.AdEMAMix({"w": np.ones(2)}, betas=(0.9, 0.999))
    assert math.isclose(flatopt.AdEMAMix({"w": np.ones(2)}).defaults["alpha"], 5.0)


def test_prodigy_goes_on_after_a_nan_gradient_as_prodigyopt_does(tmp_path):
    """Found by tests/test_state_machine.py: a NaN gradient left ``d_numerator`` NaN, which
    the schema then refused, so every later step (and save) raised HyperparameterError.
    prodigyopt keeps NaN there (``d`` stays: Python's max ignores the NaN) and steps on; so
    does flatopt now. A save then refuses the NaN second moments, as for every rule."""
    import warnings

    import prodigyopt
    import torch
    opt = flatopt.Prodigy({"w": np.ones(4), "v": np.ones(3)}, lr=1.0)
    theirs = [torch.ones(4, dtype=torch.float64, requires_grad=True),
              torch.ones(3, dtype=torch.float64, requires_grad=True)]
    reference = prodigyopt.Prodigy(theirs, lr=1.0)
    bad = np.full(4, 0.5)
    bad[0] = np.nan
    for gw in (np.full(4, 0.5), bad, np.full(4, 0.25)):
        gv = np.full(3, 0.2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step({"w": gw, "v": gv})
        theirs[0].grad, theirs[1].grad = torch.tensor(gw), torch.tensor(gv)
        reference.step()
    ours, ref = opt.param_groups[0], reference.param_groups[0]
    assert np.isnan(ours["d_numerator"]) and np.isnan(ref["d_numerator"])
    assert (ours["d"], ours["d_max"], ours["k"]) == (ref["d"], ref["d_max"], ref["k"])
    np.testing.assert_allclose(opt.params["v"], theirs[1].detach().numpy(), rtol=1e-12)
    with pytest.raises(flatopt.CheckpointError, match="NaN"):
        flatopt.save(tmp_path / "ck.h5", opt)
    assert not (tmp_path / "ck.h5").exists()
