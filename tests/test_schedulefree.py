"""Schedule-free SGD, AdamW and RAdam against facebookresearch's ``schedulefree`` package (torch
CPU tensors, its single-tensor path): random configurations (groups, float32/float64, warm-up,
r, weight_lr_power, weight decay, RAdam's silent phase, missing gradients, lr changed mid-run,
train/eval switches mid-run); the modes; the group counters through state dicts, checkpoints
(either mode, exact resume) and torch state dicts; the CUDA backends (simulator) and errors."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import flatopt
from flatopt._layout import chunk_table
from optimizers import slow_beyond

torch = pytest.importorskip("torch")
schedulefree = pytest.importorskip("schedulefree")

REFERENCE = {"ScheduleFreeSGD": "SGDScheduleFree", "ScheduleFreeAdamW": "AdamWScheduleFree",
             "ScheduleFreeRAdam": "RAdamScheduleFree"}
NAMES = list(REFERENCE)
# random schedules leave some steps without any gradient (every group still counts them)
pytestmark = pytest.mark.filterwarnings("ignore:.*no gradient is marked present")
COUNTERS = ("k", "train_mode", "weight_sum", "lr_max", "scheduled_lr")
SHAPES = [(), (0,), (7,), (5, 3), (17, 33), (40_000,), (2, 3, 4)]
STEPS = 14
TOLERANCE = {np.float64: dict(rtol=1e-10, atol=1e-13), np.float32: dict(rtol=2e-5, atol=2e-6)}


def random_hyperparameters(name: str, rng: np.random.Generator) -> dict:
    """One group's settings, in the reference's terms (wider than the schema's examples)."""
    pick = lambda *values: values[int(rng.integers(len(values)))]  # noqa: E731
    hp = {"weight_decay": pick(0.0, 0.0, 0.01, 0.1), "r": pick(0.0, 0.0, 0.5, 2.0),
          "weight_lr_power": pick(2.0, 2.0, 0.0, 1.0, 3.0)}
    if name == "ScheduleFreeSGD":
        hp.update(lr=pick(1.0, 0.1, 0.02), momentum=pick(0.9, 0.5, 0.3, 0.99),
                  warmup_steps=pick(0, 0, 3, 20))
    else:
        hp.update(lr=pick(0.0025, 0.02, 0.1), eps=pick(1e-8, 1e-3),
                  betas=pick((0.9, 0.999), (0.95, 0.99), (0.5, 0.9), (0.3, 0.6), (0.9, 0.9)))
    if name == "ScheduleFreeAdamW":
        hp["warmup_steps"] = pick(0, 0, 3, 20)
    if name == "ScheduleFreeRAdam":
        hp["silent_sgd_phase"] = pick(True, False)
    return hp


def random_problem(name: str, dtype, seed: int):
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), int(dtype == np.float64)])
    groups, counter = [], 0
    for _ in range(int(rng.integers(1, 4))):
        params = {}
        for _ in range(int(rng.integers(1, 4))):
            shape = SHAPES[int(rng.integers(len(SHAPES)))]
            params[f"p{counter}"] = rng.standard_normal(shape).astype(dtype)
            counter += 1
        groups.append((params, random_hyperparameters(name, rng)))
    schedule = []
    for _ in range(STEPS):
        grads = {}
        for params, _ in groups:
            for path, array in params.items():
                r = rng.random()
                if r < 0.25:
                    continue  # missing
                grads[path] = (np.zeros_like(array) if r < 0.3
                               else rng.standard_normal(array.shape).astype(dtype))
        # a mode switch after some steps: (eval, compare x, train) or stay
        schedule.append((grads, rng.random() < 0.35))
    return groups, schedule


def build_pair(name: str, groups, **reference_options):
    opt = getattr(flatopt, name)([{"params": {k: v.copy() for k, v in params.items()}, **hp}
                                  for params, hp in groups])
    tensors = {path: torch.tensor(array.copy()) for params, _ in groups
               for path, array in params.items()}
    ref = getattr(schedulefree, REFERENCE[name])(
        [{"params": [tensors[path] for path in params], **hp} for params, hp in groups],
        **{"foreach": False, **reference_options})
    ref.train()  # the reference starts in eval mode; flatopt in train mode (a no-op there)
    return opt, ref, tensors


def set_grads(tensors, grads):
    for path, t in tensors.items():
        # a copy: the reference normalises p.grad in place
        t.grad = torch.from_numpy(grads[path].copy()) if path in grads else None


def assert_matches(opt, ref, tensors, dtype, where):
    for path, t in tensors.items():
        expected = t.detach().numpy()
        np.testing.assert_allclose(opt.params[path], expected, **TOLERANCE[dtype],
                                   err_msg=f"{where} {path}")
        assert opt.params[path].dtype == dtype
        ours, theirs = opt.state_of(path), ref.state[t]
        assert (ours is None) == (not theirs), f"{where} {path}"
        for key, value in ({} if ours is None else ours._asdict()).items():
            scale = max(1.0, float(np.max(np.abs(theirs[key].numpy()), initial=0.0)))
            np.testing.assert_allclose(value, theirs[key].numpy(), rtol=TOLERANCE[dtype]["rtol"],
                                       atol=TOLERANCE[dtype]["atol"] * scale,
                                       err_msg=f"{where} {path} {key}")
    for number, (group, theirs) in enumerate(zip(opt.param_groups, ref.param_groups)):
        for key in COUNTERS:
            assert group[key] == theirs[key], f"{where} group {number} {key}"


@pytest.mark.parametrize("seed", slow_beyond(range(6)))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", NAMES)
def test_matches_the_schedulefree_package(name, dtype, seed):
    groups, schedule = random_problem(name, dtype, seed)
    opt, ref, tensors = build_pair(name, groups)
    for step, (grads, switch) in enumerate(schedule):
        if step == STEPS // 2:  # a scheduler's change, read at the next step by both
            opt.param_groups[0]["lr"] *= 0.5
            ref.param_groups[0]["lr"] *= 0.5
        set_grads(tensors, grads)
        ref.step()
        opt.step(grads)
        assert_matches(opt, ref, tensors, dtype, f"{name} step {step}")
        if switch:
            ref.eval()
            opt.eval()
            assert_matches(opt, ref, tensors, dtype, f"{name} eval after step {step}")
            ref.train()
            opt.train()
            assert_matches(opt, ref, tensors, dtype, f"{name} train after step {step}")


@pytest.mark.parametrize("name", NAMES)
def test_foreach_path_agrees_too(name):
    """The reference's foreach path (its default) is the same arithmetic."""
    groups, schedule = random_problem(name, np.float64, 99)
    opt, ref, tensors = build_pair(name, groups, foreach=True)
    for step, (grads, _) in enumerate(schedule):
        set_grads(tensors, grads)
        ref.step()
        opt.step(grads)
        assert_matches(opt, ref, tensors, np.float64, f"{name} step {step}")


def test_signatures_and_defaults_follow_the_reference():
    import inspect
    for name, reference in REFERENCE.items():
        ours = inspect.signature(getattr(flatopt, name)).parameters
        theirs = inspect.signature(getattr(schedulefree, reference)).parameters
        assert [p for p in ours if p != "unknown"] == list(theirs), name
        for key, parameter in theirs.items():
            if key not in ("params", "foreach"):
                assert ours[key].default == parameter.default, (name, key)
        opt = getattr(flatopt, name)({"w": np.zeros(3)})
        ref = getattr(schedulefree, reference)([torch.zeros(3)])
        for key, value in ref.param_groups[0].items():
            if key in ("params", "foreach"):
                continue
            expected = True if key == "train_mode" else value  # see test_starts_in_train_mode
            assert opt.param_groups[0][key] == expected, (name, key)


@pytest.mark.parametrize("name", NAMES)
def test_starts_in_train_mode_and_refuses_steps_in_eval_mode(name):
    """The reference starts in eval mode and raises at a step before train(); flatopt starts in
    train mode (without state both modes are the same point, so train() at the start is a
    no-op in both), and a step in eval mode raises ModeError naming the group, changing
    nothing."""
    rng = np.random.default_rng(0)
    params = {"a": rng.standard_normal(5), "b": rng.standard_normal(3)}
    opt = getattr(flatopt, name)([{"params": {"a": params["a"]}, "label": "body"},
                                  {"params": {"b": params["b"]}}])
    opt.train()
    np.testing.assert_array_equal(opt.params["a"], params["a"])
    ref = getattr(schedulefree, REFERENCE[name])([torch.zeros(2, requires_grad=True)])
    ref.param_groups[0]["params"][0].grad = torch.ones(2)
    with pytest.raises(Exception, match="not in train mode"):
        ref.step()
    grads = {"a": rng.standard_normal(5), "b": rng.standard_normal(3)}
    opt.step(grads)
    opt.eval()
    before = (opt.state_dict(), {k: v.copy() for k, v in opt.params.items()})
    with pytest.raises(flatopt.ModeError, match=r"param group 0 \('body'\) is in eval mode"):
        opt.step(grads)
    after = opt.state_dict()
    assert after["param_groups"] == before[0]["param_groups"]
    for path in params:
        np.testing.assert_array_equal(opt.params[path], before[1][path])
        np.testing.assert_array_equal(after["state"][path]["z"], before[0]["state"][path]["z"])
    opt.eval()  # again: a no-op
    np.testing.assert_array_equal(opt.params["a"], before[1]["a"])
    opt.train()
    opt.step(grads)
    assert [g["k"] for g in opt.param_groups] == [2, 2]


def test_a_group_added_later_steps_and_switches_with_the_rest():
    """Counters are per group: an added group starts at k = 0 (its own warm-up) in train
    mode; a group without gradients counts the steps too."""
    opt = flatopt.ScheduleFreeAdamW({"a": np.ones(4)}, warmup_steps=4)
    opt.step({"a": np.ones(4)})
    opt.add_param_group({"params": {"b": np.ones(2)}})
    opt.step({"a": np.ones(4)})  # b has no gradient: its group counts the step anyway
    assert [g["k"] for g in opt.param_groups] == [2, 1]
    assert opt.state_of("b") is None
    opt.eval()
    np.testing.assert_array_equal(opt.params["b"], np.ones(2))  # no state: x = y = z
    assert [g["train_mode"] for g in opt.param_groups] == [False, False]


def test_an_averaging_weight_that_overflows_is_refused_before_anything_changes():
    opt = flatopt.ScheduleFreeSGD([{"params": {"a": np.ones(3)}},
                                   {"params": {"b": np.ones(3)}, "r": 2000.0}])
    opt.step({"a": np.ones(3), "b": np.ones(3)})  # 1**2000 is fine; 2**2000 overflows
    before = snapshot(opt)
    with pytest.raises(flatopt.HyperparameterError, match=r"param group 1: .* lower r"):
        opt.step({"a": np.ones(3), "b": np.ones(3)})
    assert snapshot(opt) == before


def test_a_skipped_step_advances_no_counter():
    opt = flatopt.ScheduleFreeSGD({"a": np.ones(3)})
    opt.step({"a": np.ones(3)})
    groups = [dict(g) for g in opt.param_groups]
    result = opt.step({"a": np.array([1.0, np.nan, 0.0])}, skip_nonfinite=True)
    assert result.skipped and opt.param_groups == groups


@pytest.mark.parametrize("name, values, message", [
    ("ScheduleFreeSGD", {"momentum": 1.0}, "momentum=1.0 is invalid: must be between 0 and 1"),
    ("ScheduleFreeSGD", {"momentum": 0.0}, "momentum=0.0 is invalid"),
    ("ScheduleFreeAdamW", {"betas": (0.0, 0.9)}, "beta1 must be in \\(0, 1\\)"),
    ("ScheduleFreeAdamW", {"warmup_steps": 2.5}, "warmup_steps=2.5 is invalid: must be an int"),
    ("ScheduleFreeAdamW", {"warmup_steps": -1}, "warmup_steps=-1 is invalid"),
    ("ScheduleFreeRAdam", {"weight_lr_power": -1.0}, "weight_lr_power=-1.0 is invalid"),
    ("ScheduleFreeRAdam", {"r": float("inf")}, "r=inf is invalid: must be finite"),
    ("ScheduleFreeRAdam", {"silent_sgd_phase": 1}, "silent_sgd_phase=1 is invalid"),
    ("ScheduleFreeSGD", {"k": -1}, "k=-1 is invalid"),
    ("ScheduleFreeSGD", {"train_mode": "yes"}, "train_mode='yes' is invalid"),
])
def test_bad_values_are_typed_errors_naming_the_group(name, values, message):
    cls = getattr(flatopt, name)
    with pytest.raises(flatopt.HyperparameterError, match=message):
        cls([{"params": {"w": np.zeros(2)}}, {"params": {"v": np.zeros(2)}, **values}])
    with pytest.raises(flatopt.HyperparameterError, match="param group 1"):
        cls([{"params": {"w": np.zeros(2)}}, {"params": {"v": np.zeros(2)}, **values}])
    opt = cls({"w": np.zeros(2)})
    opt.param_groups[0].update(values)
    with pytest.raises(flatopt.HyperparameterError, match="param group 0"):
        opt.step({"w": np.ones(2)})


# ----------------------------------------------------------------------------- resuming
def run(opt, start: int, stop: int, switch_at=()):
    rng_of = lambda t: np.random.default_rng(500 + t)  # noqa: E731
    for t in range(start, stop):
        rng = rng_of(t)
        grads = {path: rng.standard_normal(view.shape).astype(view.dtype)
                 for path, view in opt.params.items() if (t + len(path)) % 4}
        opt.step(grads)
        if t in switch_at:
            opt.eval()
            opt.train()


def build(name: str):
    rng = np.random.default_rng(3)
    params = {"w1": rng.standard_normal((6, 5)).astype(np.float32),
              "b1": rng.standard_normal(5).astype(np.float32),
              "w2": rng.standard_normal((5, 2)), "late": rng.standard_normal(4)}
    return getattr(flatopt, name)(
        [{"params": {k: params[k] for k in ("w1", "b1")}, "weight_decay": 0.01},
         {"params": {k: params[k] for k in ("w2", "late")}, "r": 1.0, "lr": 0.05}],
        **({} if name == "ScheduleFreeRAdam" else {"warmup_steps": 3}))


def snapshot(opt) -> dict:
    out = {f"{n}:{k}": repr(g[k]) for n, g in enumerate(opt.param_groups) for k in COUNTERS}
    for path in opt.params:
        out[path] = opt.params[path].tobytes()
        state = opt.state_of(path)
        for key, value in ({} if state is None else state._asdict()).items():
            out[f"{path}.{key}"] = np.asarray(value).tobytes()
    return out


SPLIT, TOTAL = 5, 10


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_resumes_exactly_in_either_mode(tmp_path, name, mode):
    """Save at step SPLIT (after eval() for "eval", as the reference recommends), load into a
    fresh optimizer with no option (the counters are not reported as differences), continue:
    bit-identical to the uninterrupted run, mode included."""
    full = build(name)
    run(full, 0, SPLIT, switch_at=(2,))
    if mode == "eval":
        full.eval()
    flatopt.save(tmp_path / "ck.h5", full)
    saved = snapshot(full)
    resumed = build(name)
    assert resumed.param_groups[0]["train_mode"]
    result = flatopt.load(tmp_path / "ck.h5", resumed)
    assert not [d for d in result.differences if d.kind != "id"]
    assert snapshot(resumed) == saved
    assert [g["train_mode"] for g in resumed.param_groups] == [mode == "train"] * 2
    for opt in (full, resumed):
        opt.train()
        run(opt, SPLIT, TOTAL, switch_at=(7,))
        opt.eval()
    assert snapshot(resumed) == snapshot(full)
    assert full.param_groups[0]["k"] == TOTAL


@pytest.mark.parametrize("options", [{"hyperparameters": "live"},
                                     {"hyperparameters": "saved", "strict": False}])
def test_checkpoint_counters_load_whatever_the_hyperparameter_option(tmp_path, options):
    """The counters are state: "live" keeps the live lr but still takes the saved k,
    weight_sum and mode."""
    full = build("ScheduleFreeAdamW")
    run(full, 0, SPLIT)
    full.eval()
    flatopt.save(tmp_path / "ck.h5", full)
    resumed = build("ScheduleFreeAdamW")
    resumed.param_groups[0]["lr"] = 0.5
    flatopt.load(tmp_path / "ck.h5", resumed, **options)
    for key in COUNTERS:
        assert [g[key] for g in resumed.param_groups] == [g[key] for g in full.param_groups]
    assert resumed.param_groups[0]["lr"] == (0.5 if options["hyperparameters"] == "live"
                                             else full.param_groups[0]["lr"])


@pytest.mark.parametrize("hyperparameters", ["saved", "live"])
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_resumes_exactly_in_either_mode(name, hyperparameters):
    """state_dict holds the counters and the mode in its groups (as the reference's does);
    load_state_dict restores them with either option (they are state), the parameters coming
    separately as a model's weights do."""
    for mode in ("train", "eval"):
        full = build(name)
        run(full, 0, SPLIT)
        if mode == "eval":
            full.eval()
        state = full.state_dict()
        assert state["param_groups"][1]["k"] == SPLIT
        assert state["param_groups"][0]["train_mode"] == (mode == "train")
        resumed = build(name)
        for path, value in full.params.items():
            resumed.params[path][...] = value
        if hyperparameters == "live":
            resumed.param_groups[1]["lr"] = full.param_groups[1]["lr"]
        resumed.load_state_dict(state, hyperparameters=hyperparameters)
        assert snapshot(resumed) == snapshot(full)
        for opt in (full, resumed):
            opt.train()
            run(opt, SPLIT, TOTAL)
        assert snapshot(resumed) == snapshot(full), mode


def test_live_state_dict_load_needs_the_saved_grouping():
    opt = build("ScheduleFreeSGD")
    state = opt.state_dict()
    state["param_groups"][0]["params"] = ["w1"]
    with pytest.raises(flatopt.StateDictError, match="its per-group state .k, train_mode"):
        opt.load_state_dict(state, hyperparameters="live")


@pytest.mark.parametrize("name", NAMES)
def test_continues_a_run_of_the_reference_from_its_state_dict(name):
    """load_torch_state_dict takes the reference's state dict (its counters and mode in its
    param_groups, z and exp_avg_sq per parameter), in eval mode too."""
    groups, schedule = random_problem(name, np.float64, 5)
    opt, ref, tensors = build_pair(name, groups)
    for grads, _ in schedule[:4]:
        set_grads(tensors, grads)
        ref.step()
    ref.eval()
    paths = list(tensors)
    fresh = getattr(flatopt, name)([{"params": {p: tensors[p].numpy().copy() for p in params},
                                     **hp} for params, hp in groups])
    fresh.load_torch_state_dict(ref.state_dict(), paths)
    assert not fresh.param_groups[0]["train_mode"]
    fresh.train()
    ref.train()
    for step, (grads, _) in enumerate(schedule[4:]):
        set_grads(tensors, grads)
        ref.step()
        fresh.step(grads)
        assert_matches(fresh, ref, tensors, np.float64, f"{name} step {step}")


# ----------------------------------------------------------------------------- CUDA
def use_small_chunks(opt, size=64):
    for buf in opt.buffers:
        buf.chunk_size = size
        buf.chunk_first = chunk_table(buf.offsets, buf.sizes, buf.length, size)
        if opt._device is not None:
            opt._device.refresh_layout(buf)


@pytest.mark.parametrize("where", slow_beyond(["device", "backend"]))
@pytest.mark.parametrize("name", slow_beyond(NAMES))
def test_cuda_train_and_eval_match_the_cpu(name, where):
    """The switch kernel through the CUDA walk: on host buffers (the backend, as
    tests/test_cuda_kernels.py runs rules) and on device buffers (``device="cuda"``), under
    Numba's simulator here (or on a GPU with NUMBA_ENABLE_CUDASIM=0)."""
    pytest.importorskip("numba_cuda")
    cpu = build(name)
    cuda = build(name) if where == "backend" else getattr(flatopt, name)(
        [{**{k: v for k, v in g.items() if k != "params"},
          "params": {p: cpu.params[p].copy() for p in g["params"]}}
         for g in cpu.param_groups], device="cuda")
    if where == "backend":
        cuda._set_backend("cuda")
    use_small_chunks(cuda)
    for opt in (cpu, cuda):
        run(opt, 0, 4, switch_at=(1, 2))
        opt.eval()
    cuda.state_dict()  # the host mirror refreshed
    for path in cpu.params:
        got = cuda.params[path]
        got = got if isinstance(got, np.ndarray) else got.copy_to_host()
        np.testing.assert_allclose(got, cpu.params[path], rtol=2e-5, atol=1e-6, err_msg=path)
    assert [g["train_mode"] for g in cuda.param_groups] == [False, False]


def test_the_switch_kernel_stays_in_float32():
    """train()/eval() on a float32 buffer: the switch kernel's arithmetic is float32 (its
    weight arrives rounded to the dtype, as torch's lerp rounds it)."""
    from flatopt.kernels import cpu
    from flatopt.kernels.rules.schedulefree import SWITCH
    opt = flatopt.ScheduleFreeSGD({"w": np.ones(100, np.float32)})
    opt.step({"w": np.ones(100, np.float32)})
    opt.eval()
    (walk,) = cpu.compile_rule(SWITCH).step_kernels.values()  # (SWITCH has no variants)
    used, kernel = walk.serial, walk.uncached().serial
    for signature in used.signatures:
        kernel.compile(signature)
    (ir,) = [text for sig, text in kernel.inspect_llvm().items()
             if sig[1].dtype.name == "float32"]
    functions = ir.split("\ndefine ")
    code = "\n".join(line for f in functions[1:] if "7cpython" not in f.split("(")[0]
                     for line in f.splitlines() if not line.startswith("declare"))
    assert "llvm.fma.f32" in code and "fpext" not in code and "double" not in code
