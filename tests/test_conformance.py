"""Conformance on random configurations: flatopt against torch.optim 2.13 and against the
independent NumPy reference (tests/reference.py).

Every optimizer and flag, several groups with different hyperparameters, missing and zero
gradients at random steps, 0-d, zero-size and multi-chunk tensors, float32 and float64, lr
changed mid-run. float64 must agree within 1e-12 relative over the whole run; float32 within
rtol 1e-5, atol 1e-6 per step (each step starts from the same state: teacher forcing).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import flatopt
from optimizers import (INFO, cases, fit_shape, random_settings, slow_beyond, torch_group,
                        torch_settings)
from optimizers import NAMES as KINDS
from reference import ReferenceOptimizer

DTYPES = [np.float32, np.float64]
SEEDS = slow_beyond(range(4))  # the fast loop runs seed 0
STEPS = 12
SHAPES = [(), (0,), (3, 0), (7,), (5, 3), (17, 33), (40_000,), (2, 3, 4)]


def random_problem(seed: int, kind: str, dtype, torch: bool = False):
    """``torch``: settings torch.optim runs too (see ``optimizers.torch_settings``)."""
    rng = np.random.default_rng([seed, zlib.crc32(kind.encode()), int(dtype == np.float64)])
    n_groups = int(rng.integers(1, 4))
    groups = []
    counter = 0
    for _ in range(n_groups):
        params = {}
        for _ in range(int(rng.integers(1, 5))):
            shape = fit_shape(kind, SHAPES[int(rng.integers(len(SHAPES)))])
            params[f"layer{counter}.w"] = rng.standard_normal(shape).astype(dtype)
            counter += 1
        settings = random_settings(kind, rng)
        groups.append((params, torch_settings(kind, settings) if torch else settings))
    schedule = []
    paths = [path for params, _ in groups for path in params]
    shapes = {path: arr.shape for params, _ in groups for path, arr in params.items()}
    for _ in range(STEPS):
        grads = {}
        for path in paths:
            r = rng.random()
            if r < 0.25:
                continue  # missing
            grads[path] = (np.zeros(shapes[path], dtype) if r < 0.35
                           else rng.standard_normal(shapes[path]).astype(dtype))
        schedule.append(grads)
    return groups, schedule


def make_flatopt(kind, groups):
    cls = flatopt.registry.lookup(kind)
    return cls([{"params": {k: v.copy() for k, v in params.items()}, **hp}
                for params, hp in groups])


def change_lr(groups_like, step):
    """lr of group 0 changes mid-run, applied to the live param_groups."""
    if step == STEPS // 2:
        groups_like[0]["lr"] *= 0.5


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_numpy_reference(kind, dtype, seed):
    groups, schedule = random_problem(seed, kind, dtype)
    opt = make_flatopt(kind, groups)
    ref = ReferenceOptimizer(kind, groups)
    rtol, atol = INFO[kind].tolerance[np.dtype(dtype)]
    for step, grads in enumerate(schedule):
        change_lr(opt.param_groups, step)
        change_lr([hp for _, hp in ref.groups], step)
        opt.step(grads)
        ref.step(grads)
        for path, expected in ref.params.items():
            np.testing.assert_allclose(opt.params[path], expected, rtol=rtol, atol=atol,
                                       err_msg=f"{kind} {path} step {step}")
            assert opt.params[path].dtype == dtype
        assert set(opt.state_dict()["state"]) == {p for p, s in ref.state.items() if s}



def _torch():
    return pytest.importorskip("torch")


def make_torch(kind, groups):
    """torch's optimizer over ``groups`` (a zero-size parameter left out where torch's class
    fails on one, which flatopt leaves alone: the NumPy reference test covers it)."""
    torch = _torch()
    tensors = {}
    torch_groups = []
    for params, hp in groups:
        ts = []
        for path, arr in params.items():
            if arr.size == 0 and INFO[kind].torch_refuses_empty:
                continue
            t = torch.tensor(arr.copy(), requires_grad=True)
            tensors[path] = t
            ts.append(t)
        torch_groups.append({"params": ts, **torch_group(kind, hp)})
    return getattr(torch.optim, INFO[kind].torch)(torch_groups), tensors


def force_torch_state(torch_opt, tensors, opt):
    """Teacher forcing: give torch flatopt's parameters and state, so the next step starts
    from the same point (float32 rounding differences then cannot accumulate)."""
    torch = _torch()
    with torch.no_grad():
        for path, t in tensors.items():
            t.copy_(torch.from_numpy(opt.params[path].copy()))
            ours = opt.state_of(path)
            if ours is None:
                continue
            theirs = torch_opt.state[t]
            for name, value in ours._asdict().items():
                if value is None or name == "step":
                    continue
                theirs[name].copy_(torch.from_numpy(np.array(value)))


def step_both(opt, torch_opt, tensors, grads, step):
    """One step of both on the same gradients (absent: missing), lr changed mid-run."""
    torch = _torch()
    change_lr(opt.param_groups, step)
    change_lr(torch_opt.param_groups, step)
    for path, t in tensors.items():
        t.grad = torch.from_numpy(grads[path].copy()) if path in grads else None
    torch_opt.step()
    opt.step(grads)


@pytest.fixture
def torch_default_dtype(dtype):
    """torch keeps per-parameter numbers in state (NAdam's mu_product, ASGD's eta and mu) as
    0-d tensors of its default dtype, float32 unless set; flatopt keeps them in float64. A
    float64 run compares against torch with float64 as its default dtype."""
    torch = _torch()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if dtype == np.float64 else torch.float32)
    yield
    torch.set_default_dtype(previous)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("kind", cases("test_matches_torch_optim"))
def test_matches_torch_optim(kind, dtype, seed, torch_default_dtype):
    groups, schedule = random_problem(seed, kind, dtype, torch=True)
    opt = make_flatopt(kind, groups)
    torch_opt, tensors = make_torch(kind, groups)
    # Eager state (Adagrad's): torch fills it from its constructor arguments, ignoring a
    # group's own initial_accumulator_value, which flatopt honours; both start from flatopt's
    # (tests/test_rules_extra.py checks the initial state against torch's where they agree).
    force_torch_state(torch_opt, tensors, opt)
    float32 = dtype == np.float32
    rtol, atol = INFO[kind].tolerance[np.dtype(dtype)]
    for step, grads in enumerate(schedule):
        step_both(opt, torch_opt, tensors, grads, step)
        for path, t in tensors.items():
            where = f"{kind} {path} step {step}"
            np.testing.assert_allclose(opt.params[path], t.detach().numpy(), rtol=rtol,
                                       atol=atol, err_msg=where)
            theirs = torch_opt.state.get(t, {})
            ours = opt.state_of(path)
            assert (ours is None) == (len(theirs) == 0), where
            if ours is None:
                continue
            for name, value in ours._asdict().items():
                if name == "step":
                    assert value == int(theirs["step"].item()), where
                elif value is not None:
                    # State that sums cancelling terms (RMSprop's momentum of g / avg) carries
                    # torch's FMA and sqrt roundings at the scale of its largest values.
                    expected = theirs[name].numpy()
                    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
                    np.testing.assert_allclose(value, expected, rtol=rtol, atol=atol * scale,
                                               err_msg=f"{where} {name}")
        if float32:
            force_torch_state(torch_opt, tensors, opt)


@pytest.mark.parametrize("beta1", [0.0, 0.3, 0.5])
@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_first_moment_follows_torchs_lerp_for_small_beta1(kind, beta1):
    """torch's lerp works from the gradient's end when 1 - beta1 >= 0.5: with beta1 = 0 the
    moment is exactly the gradient even after a huge one (m + 1*(g - m) would lose it)."""
    torch = _torch()
    opt = getattr(flatopt, kind)({"w": np.zeros(3, np.float32)}, lr=0.1, betas=(beta1, 0.99))
    t = torch.zeros(3, requires_grad=True)
    torch_opt = getattr(torch.optim, kind)([t], lr=0.1, betas=(beta1, 0.99))
    for value in (1e10, 1.0, 3.0):
        grad = np.full(3, value, np.float32)
        opt.step({"w": grad})
        t.grad = torch.from_numpy(grad.copy())
        torch_opt.step()
        np.testing.assert_array_equal(opt.state_of("w").exp_avg,
                                      torch_opt.state[t]["exp_avg"].numpy())
        np.testing.assert_allclose(opt.params["w"], t.detach().numpy(), rtol=1e-6)
    if beta1 == 0.0:
        np.testing.assert_array_equal(opt.state_of("w").exp_avg, 3.0)


# ---------------------------------------------------------------------------- bits
# Rules whose steps equal torch's bit for bit (float32 and float64, no teacher forcing): their
# facts' ``bit_exact`` (tests/optimizers.py) names the torch implementation that is the oracle,
# and the dtypes and shapes it holds for. SGD: torch's single-tensor path, every shape.
# Adam/AdamW: torch's fused CPU kernel, whose sqrt is correctly rounded; it computes the last
# (size mod vector width) elements of each chunk without fused multiply-adds, so sizes there
# are multiples of 16, and torch runs on one thread here (one chunk).
BIT_EXACT = [name for name in KINDS if INFO[name].bit_exact is not None]


def _bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("kind", BIT_EXACT)
def test_steps_equal_torchs_bit_for_bit(kind, dtype, seed, torch_default_dtype):
    torch = _torch()
    bits = INFO[kind].bit_exact
    torch_options, shapes = bits.torch_options, bits.shapes or SHAPES
    if np.dtype(dtype) not in bits.dtypes:
        pytest.skip(f"{kind} is bit-identical to torch in {[d.name for d in bits.dtypes]}"
                    f" only: {bits.why}")
    rng = np.random.default_rng([seed, zlib.crc32(kind.encode()), int(dtype == np.float64)])
    groups = []
    for number in range(2):
        params = {f"g{number}.p{i}": rng.standard_normal(shape).astype(dtype)
                  for i, shape in enumerate(shapes)}
        groups.append((params, torch_settings(kind, random_settings(kind, rng))))
    opt = make_flatopt(kind, groups)
    tensors = {path: torch.tensor(arr.copy(), requires_grad=True)
               for params, _ in groups for path, arr in params.items()}
    torch_opt = getattr(torch.optim, kind)(
        [{"params": [tensors[p] for p in params], **torch_group(kind, hp)}
         for params, hp in groups],
        **torch_options)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(STEPS):
            grads = {path: rng.standard_normal(t.shape).astype(dtype)
                     for path, t in tensors.items() if rng.random() < 0.8}
            step_both(opt, torch_opt, tensors, grads, step)
            for path, t in tensors.items():
                where = f"{kind} {path} step {step}"
                assert _bits(opt.params[path]) == _bits(t.detach().numpy()), where
                ours = opt.state_of(path)
                for name, value in ({} if ours is None else ours._asdict()).items():
                    if name != "step" and value is not None:
                        assert _bits(value) == _bits(torch_opt.state[t][name].numpy()), \
                            f"{where} {name}"
    finally:
        torch.set_num_threads(threads)
