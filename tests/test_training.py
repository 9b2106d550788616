"""The training-loop tools: clipping (alone and inside the step), non-finite skipping, loss
scaling, EMA, gradient accumulation, torch's implementation switches, and the silent traps
that became errors or warnings."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flatopt

SHAPES = {"a": (40, 3), "b": (7,), "c": (), "d": (0,), "e": (300_000,)}


def grads_for(seed, dtype=np.float32, missing=("c",), scale=1.0):
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(s) * scale).astype(dtype) for k, s in SHAPES.items()
            if k not in missing}


def make(cls=flatopt.SGD, dtype=np.float32, **kw):
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}
    return cls(params, **{"lr": 0.1, **kw})


# ----------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clip_grad_norm_matches_torch(norm_type, dtype):
    torch = pytest.importorskip("torch")
    opt = make(dtype=dtype)
    grads = grads_for(1, dtype)
    for path, g in grads.items():
        opt.grads[path] = g
    tensors = []
    for path in SHAPES:
        t = torch.zeros(SHAPES[path], dtype=getattr(torch, np.dtype(dtype).name))
        t.grad = torch.from_numpy(grads[path].copy()) if path in grads else None
        if t.numel() or not np.isinf(norm_type):  # torch cannot take the inf norm of size 0
            tensors.append(t)
    theirs = float(torch.nn.utils.clip_grad_norm_(tensors, 0.5, norm_type=norm_type))
    ours = flatopt.clip_grad_norm(opt, 0.5, norm_type=norm_type)
    # flatopt sums in float64 (torch in the gradient's dtype): it is exact to 1e-12; torch's
    # float32 sums of |g|**3 over 300K values drift by ~1e-5
    values = np.concatenate([g.ravel().astype(np.float64) for g in grads.values()])
    exact = np.max(np.abs(values)) if np.isinf(norm_type) else \
        (np.abs(values) ** norm_type).sum() ** (1 / norm_type)
    assert ours == pytest.approx(exact, rel=1e-10)
    rtol = 1e-4 if dtype == np.float32 else 1e-12
    assert ours == pytest.approx(theirs, rel=rtol)
    for path, t in zip([p for p in SHAPES if SHAPES[p] != (0,) or not np.isinf(norm_type)],
                       tensors):
        if t.grad is not None:
            np.testing.assert_allclose(opt.grads[path], t.grad.numpy(), rtol=rtol, atol=0)
    assert not opt.grads.is_present("c")


def test_clipping_inside_the_step_equals_clipping_then_stepping():
    fused, separate = make(flatopt.Adam), make(flatopt.Adam)
    for seed in range(3):
        grads = grads_for(seed, scale=10.0)
        result = fused.step(grads, max_grad_norm=1.0)
        for path, g in grads.items():
            separate.grads[path] = g
        separate.grads.mark_missing([p for p in SHAPES if p not in grads])
        norm = flatopt.clip_grad_norm(separate, 1.0)
        separate.step()
        assert result.grad_norm == norm and not result.skipped and result.nonfinite is False
        for path in SHAPES:
            assert fused.params[path].tobytes() == separate.params[path].tobytes(), path
            assert fused.grads[path].tobytes() == separate.grads[path].tobytes(), path


def test_the_norm_does_not_depend_on_the_thread_count():
    import numba
    opt = make()
    for path, g in grads_for(2).items():
        opt.grads[path] = g
    norms = []
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        norms.append(flatopt.clip_grad_norm(opt, 1e9))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert len(set(norms)) == 1


def test_nonfinite_gradients_skip_the_step_or_raise_and_change_nothing():
    opt = make(flatopt.Adam)
    opt.step(grads_for(0))
    before = opt.state_dict()
    params = {p: v.copy() for p, v in opt.params.items()}
    bad = grads_for(1)
    bad["a"][3, 1] = np.nan
    result = opt.step(bad, skip_nonfinite=True)
    assert result.skipped and result.nonfinite
    for path in SHAPES:
        assert opt.params[path].tobytes() == params[path].tobytes()
    assert opt.state_dict()["state"]["a"]["step"] == before["state"]["a"]["step"]
    bad["b"][0] = np.inf
    with pytest.raises(flatopt.GradientError, match="NaN or infinite"):
        opt.step(bad, error_if_nonfinite=True)
    with pytest.raises(flatopt.GradientError, match="non-finite"):
        flatopt.clip_grad_norm(opt, 1.0, error_if_nonfinite=True)
    np.testing.assert_array_equal(opt.grads["a"], bad["a"])  # untouched
    assert opt.step(grads_for(2), skip_nonfinite=True) == flatopt.StepResult(False, None, False)


@pytest.mark.parametrize("options", [dict(max_grad_norm=1.0),
                                     dict(max_grad_norm=1e9, grad_scale=4.0)],
                         ids=["clipped", "scaled"])
@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_a_nonfinite_gradient_in_a_step_that_goes_ahead_warns_once(options, value):
    """torch's semantics (the step goes ahead, NaN spreads) with a warning the first time,
    where the step counts non-finite values anyway (clipping's pass): a NaN gradient turned
    every parameter into NaN, said only by ``StepResult.nonfinite``."""
    opt = make(flatopt.Adam)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.step(grads_for(0), **options).nonfinite is False  # checked, and clean
    bad = grads_for(1)
    bad["e"][7] = value
    with pytest.warns(flatopt.NonFiniteGradientWarning, match="skip_nonfinite=True") as caught:
        result = opt.step(bad, **options)
    assert len(caught) == 1 and caught[0].filename == __file__  # the caller's line
    assert result.nonfinite and not result.skipped and not np.isfinite(opt.params["e"][7])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.step(bad, **options).nonfinite  # said once per optimizer
    skipped = make(flatopt.Adam)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert skipped.step(bad, skip_nonfinite=True, **options).skipped  # never warns


def test_a_step_without_options_reads_the_gradients_no_extra_time():
    """The warning costs nothing: a plain step makes no pass over the gradients to look for
    NaN (that pass costs 16-28% of a 16M-element AdamW step here), so it neither checks nor
    warns; clipping, skip_nonfinite and error_if_nonfinite are the ways to be told."""
    opt = make(flatopt.Adam)
    bad = grads_for(1)
    bad["e"][7] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.step(bad) == flatopt.StepResult(False, None, None)


def test_error_if_nonfinite_speaks_of_clipping_only_when_clipping():
    opt = make()
    bad = grads_for(1)
    bad["b"][0] = np.inf
    with pytest.raises(flatopt.GradientError) as caught:
        opt.step(bad, error_if_nonfinite=True)
    assert "clip" not in str(caught.value) and "error_if_nonfinite" in str(caught.value)
    with pytest.raises(flatopt.GradientError, match="norm cannot be clipped"):
        opt.step(bad, error_if_nonfinite=True, max_grad_norm=1.0)


def test_bad_step_options_are_refused_before_anything_changes():
    opt = make()
    for options, match in ((dict(max_grad_norm=-1), "max_grad_norm"),
                           (dict(grad_scale=0.0), "grad_scale"),
                           (dict(max_grad_norm=1.0, norm_type=0), "norm_type"),
                           (dict(max_grad_norm=True), "max_grad_norm")):
        with pytest.raises(flatopt.HyperparameterError, match=match):
            opt.step(grads_for(0), **options)
    assert opt.state_dict()["state"] == {}


# ----------------------------------------------------------------------------- loss scaling
def test_grad_scaler_follows_torchs_scaler():
    torch = pytest.importorskip("torch")
    opt = make(flatopt.SGD, momentum=0.9)
    t_params = {p: torch.tensor(opt.params[p].copy(), requires_grad=True) for p in SHAPES}
    t_opt = torch.optim.SGD(list(t_params.values()), lr=0.1, momentum=0.9)
    ours = flatopt.GradScaler(init_scale=2.0 ** 10, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    for step in range(12):
        grads = grads_for(step, scale=ours.get_scale())
        if step in (2, 7):
            grads["b"][1] = np.inf  # an overflow: the step is skipped, the scale backs off
        for path, t in t_params.items():
            t.grad = torch.from_numpy(grads[path].copy()) if path in grads else None
        theirs.scale(torch.tensor(1.0))  # torch's scaler initialises its scale here
        theirs.step(t_opt)
        theirs.update()
        result = ours.step(opt, grads)
        ours.update()
        assert result.skipped == (step in (2, 7))
        assert ours.get_scale() == theirs.get_scale(), step
        for path, t in t_params.items():
            # torch's float32 SGD rounds through FMAs: parameters drift by ulps, not more
            np.testing.assert_allclose(opt.params[path], t.detach().numpy(), rtol=1e-5,
                                       atol=1e-6, err_msg=f"{path} step {step}")
    state = ours.state_dict()
    assert {k: float(v) for k, v in state.items()} == \
        {k: float(v) for k, v in theirs.state_dict().items()}
    restored = flatopt.GradScaler()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    with pytest.raises(flatopt.StateDictError):
        restored.load_state_dict({"scale": 1.0})


def test_grad_scaler_factors_must_be_finite():
    """growth_factor=inf would make the scale inf after growth_interval
    clean steps (and every step after it skipped); refused, in load_state_dict too."""
    for bad in (float("inf"), np.float64("inf"), float("nan")):
        with pytest.raises(flatopt.HyperparameterError, match="growth_factor"):
            flatopt.GradScaler(growth_factor=bad)
    scaler = flatopt.GradScaler()
    with pytest.raises(flatopt.HyperparameterError, match="growth_factor"):
        scaler.load_state_dict({**scaler.state_dict(), "growth_factor": float("inf")})
    assert scaler.state_dict()["growth_factor"] == 2.0


# ----------------------------------------------------------------------------- EMA
@pytest.mark.parametrize("decay", [0.9, 0.3])
def test_ema_matches_torchs_averaged_model(decay):
    torch = pytest.importorskip("torch")
    from torch.optim import swa_utils
    opt = make(flatopt.Adam)
    module = torch.nn.Module()
    for k, path in enumerate(SHAPES):
        module.register_parameter(f"p{k}", torch.nn.Parameter(torch.from_numpy(
            opt.params[path].copy())))
    averaged = swa_utils.AveragedModel(module, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(decay))
    averaged.update_parameters(module)  # torch's first update copies
    ema = flatopt.EMA(opt, decay=decay)
    for step in range(5):
        opt.step(grads_for(step))
        ema.update()
        with torch.no_grad():
            for k, path in enumerate(SHAPES):
                getattr(module, f"p{k}").copy_(torch.from_numpy(opt.params[path].copy()))
        averaged.update_parameters(module)
    for k, path in enumerate(SHAPES):  # torch's lerp kernel uses an FMA: one ulp apart
        np.testing.assert_allclose(ema.params[path],
                                   getattr(averaged.module, f"p{k}").detach().numpy(),
                                   rtol=1e-6, atol=1e-7)


def test_ema_swaps_in_for_evaluation_and_round_trips():
    opt = make(flatopt.Adam)
    ema = flatopt.EMA(opt, decay=0.5, warmup=True)
    for step in range(3):
        opt.step(grads_for(step))
        ema.update()
    live = {p: v.copy() for p, v in opt.params.items()}
    with ema.swapped():
        for path in SHAPES:
            np.testing.assert_array_equal(opt.params[path], ema.params[path])
    for path in SHAPES:
        np.testing.assert_array_equal(opt.params[path], live[path])
    other = flatopt.EMA(make(flatopt.Adam))
    other.load_state_dict(ema.state_dict())
    for path in SHAPES:
        np.testing.assert_array_equal(other.params[path], ema.params[path])
    assert other.num_updates == 3 and other.current_decay() == ema.current_decay()
    assert ema.current_decay() == min(0.5, 4 / 13)
    with pytest.raises(flatopt.StateDictError, match="'a'"):
        other.load_state_dict({**ema.state_dict(), "averages": {"a": np.zeros(2)}})


def test_ema_warmup_is_a_real_bool_in_the_constructor_and_the_state_dict():
    """The string "false" would turn warm-up on; None, "x" and {} are no settings."""
    opt = make(flatopt.Adam)
    for bad in ("false", "x", None, {}, 1, 0.0):
        with pytest.raises(flatopt.HyperparameterError, match="warmup"):
            flatopt.EMA(opt, warmup=bad)
    assert flatopt.EMA(opt, warmup=np.bool_(True)).warmup is True
    ema = flatopt.EMA(opt, warmup=True)
    before = ema.state_dict()
    for bad in (None, "x", {}, "false", 1):
        with pytest.raises(flatopt.StateDictError, match="warmup"):
            ema.load_state_dict({**before, "warmup": bad, "num_updates": 5})
        assert ema.warmup is True and ema.num_updates == 0  # nothing changed


# ----------------------------------------------------------------------------- accumulation
def test_accumulated_micro_batches_step_on_their_mean():
    accumulated, direct = make(flatopt.Adam), make(flatopt.Adam)
    batches = [grads_for(s, missing=("c", "b") if s == 1 else ("c",)) for s in range(3)]
    for grads in batches:
        accumulated.grads.add(grads)
    assert not accumulated.grads.is_present("c") and accumulated.grads.is_present("b")
    accumulated.step(grad_scale=3)
    mean = {}
    for path in ("a", "b", "d", "e"):
        total = batches[0][path].copy()
        for grads in batches[1:]:
            if path in grads:
                total += grads[path]
        mean[path] = total * np.float32(1 / 3)
    direct.step(mean)
    for path in SHAPES:
        np.testing.assert_array_equal(accumulated.params[path], direct.params[path])
    with pytest.raises(flatopt.GradientError, match="shape"):
        accumulated.grads.add({"a": np.zeros(3, np.float32)})


# ----------------------------------------------------------------------------- porting, traps
def test_torchs_implementation_switches_are_accepted_or_refused_clearly():
    params = {"w": np.zeros(2, np.float32)}
    flatopt.Adam(params, foreach=True, fused=False)
    flatopt.SGD(params, foreach=None, fused=True)
    with pytest.raises(flatopt.HyperparameterError, match="capturable=True has no meaning"):
        flatopt.Adam(params, capturable=True)
    with pytest.raises(flatopt.HyperparameterError, match="differentiable=True has no meaning"):
        flatopt.SGD(params, differentiable=True)
    with pytest.raises(flatopt.HyperparameterError, match="fused must be"):
        flatopt.Adam(params, fused="yes")


def test_a_pattern_that_matches_nothing_is_named():
    params = {"enc.bias": np.zeros(1), "enc.weight": np.zeros(1)}
    with pytest.raises(flatopt.GroupAssignmentError,
                       match=re.escape("pattern '*.norm*' matches no parameter")):
        flatopt.group_by_pattern(params, [{"match": ["*.bias", "*.norm*"]}], rest={})
    flatopt.group_by_pattern(params, [{"match": ["*.bias", "*.norm*"]}], rest={},
                             allow_unused_rules=True)


def test_a_step_with_no_gradient_present_warns_once():
    opt = make()
    opt.grads["a"][...] = 1.0  # written in place, but never marked present
    with pytest.warns(UserWarning, match="mark_present"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # said once per optimizer


def test_the_demo_trains_with_its_tools_and_handles_edge_values(capsys):
    from flatopt import demo
    assert demo.main(["--steps", "1", "--hidden", "8", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "one step only" in out and "nan" not in out
    with pytest.raises(SystemExit):
        demo.main(["--steps", "0"])
    assert "must be at least 1" in capsys.readouterr().err
    assert demo.main(["--steps", "40", "--hidden", "16", "--batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "EMA weights" in out and "|g|" in out


# ----------------------------------------------------------------------------- exact resume
def test_a_loop_with_every_tool_resumes_bit_identically_in_a_fresh_process(tmp_path):
    """Scheduler, accumulation, loss scaling with skipped overflow steps, clipping in the
    step and an EMA saved as extra arrays: save at step 6, resume in another process, and
    every parameter, moment, average, lr and the scale equal the uninterrupted run's bits."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import training_resume_script as script

    path = Path(script.__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    for mode in ("first", "resume"):
        done = subprocess.run([sys.executable, str(path), mode, str(tmp_path)],
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    tools = script.build()
    skipped = script.train(tools, 0, script.TOTAL)
    assert [t for t, s in enumerate(skipped) if s] == list(script.OVERFLOW_STEPS)
    expected = script.dump(tools)
    with np.load(tmp_path / "resumed.npz") as resumed:
        resumed = dict(resumed)
    assert sorted(resumed) == sorted(expected)
    for key, value in expected.items():
        assert value.tobytes() == resumed[key].tobytes(), f"{key} differs"
    assert int(expected["ema_updates"]) == script.TOTAL - len(script.OVERFLOW_STEPS)
    # the averages lag the weights, and the saved ones mattered: a fresh EMA would differ
    fresh = script.build()
    script.train(fresh, 0, script.SPLIT)
    fresh[3].__init__(fresh[0], decay=0.9, warmup=True)
    script.train(fresh, script.SPLIT, script.TOTAL)
    assert script.dump(fresh)["enc.weight/ema"].tobytes() != expected["enc.weight/ema"].tobytes()


@settings(max_examples=15, deadline=None)
@given(key=st.sampled_from(["num_updates", "growth_interval", "_growth_tracker"]),
       value=st.one_of(st.integers(2 ** 63, 2 ** 80), st.integers(-2 ** 70, -1),
                       st.just(True)))
def test_counts_a_file_cannot_hold_are_refused(key, value):
    """An EMA's updates and a GradScaler's counters: at most 2**63 - 1 (what a checkpoint's
    int64 arrays hold: what loads also saves), refused before anything changes."""
    opt = make()
    if key == "num_updates":
        tool = flatopt.EMA(opt, decay=0.9)
        tool.update()
    else:
        tool = flatopt.GradScaler()
    bad = tool.state_dict()
    bad[key] = value
    before = tool.state_dict()
    with pytest.raises((flatopt.StateDictError, flatopt.HyperparameterError), match=key):
        tool.load_state_dict(bad)
    after = tool.state_dict()
    assert {k: v for k, v in after.items() if k != "averages"} == \
        {k: v for k, v in before.items() if k != "averages"}


def test_a_growth_tracker_at_its_interval_is_refused():
    """The clean steps since the scale changed restart when they reach growth_interval: a
    state with them there (or past) is no scaler's, and would never grow the scale again."""
    scaler = flatopt.GradScaler(growth_interval=3)
    state = {**scaler.state_dict(), "_growth_tracker": 3}
    with pytest.raises(flatopt.StateDictError, match="_growth_tracker"):
        scaler.load_state_dict(state)
    scaler.load_state_dict({**state, "_growth_tracker": 2})
