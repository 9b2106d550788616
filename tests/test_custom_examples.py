"""The examples/ rules, written with the public API only (flatopt.define_optimizer), against
their oracles: pytorch-optimizer's AdaBelief, Adan and Lamb (float64 within 1e-10, float32
within 2e-5, several groups, missing gradients), and with everything a built-in rule gets:
exact resume in a fresh process, ZeRO-1 bit-identical at 2 and 3 ranks, the CUDA simulator.
Lamb is the example of per-tensor totals (reduce and per_tensor: its trust ratio), AdaGradNorm
of per-group totals and group state (reduce and per_group), SFSGD of mode passes (to_eval,
to_train) and state that starts at the parameter (from_param), BlocksAdamW of flatopt.blocks
(the built-in AdamW's bits, and through them torch's)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flatopt
import examples_plugin
from checkpoint_helpers import check_round_trip
from optimizers import FUSED_SHAPES
from test_custom import parallel_equals_serial
from test_checkpoint_resume import check_exact_resume

torch = pytest.importorskip("torch")
pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

SHAPES = {"enc.w": (5, 7), "enc.b": (7,), "head.w": (7, 3), "head.b": (3,)}
# per step: the paths without a gradient
NAMES = list(examples_plugin.MODULES)
ORACLES = ["AdaBelief", "Adan", "Lamb"]  # pytorch-optimizer's (AdaGradNorm: test_custom.py)
MISSING = [set(), {"enc.b"}, set(), {"head.w", "head.b"}, set(), {"enc.w"}, set(), set()]


def group_settings(name: str) -> list[dict]:
    """Two groups with different settings: flatopt's names, then the oracle's."""
    if name == "AdaBelief":
        return [dict(lr=3e-3, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-16),
                dict(lr=1e-2, beta1=0.8, beta2=0.99, weight_decay=0.0, eps=1e-12)]
    if name == "Lamb":
        return [dict(lr=3e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-6),
                dict(lr=1e-2, beta1=0.8, beta2=0.99, weight_decay=0.0, eps=1e-8)]
    return [dict(lr=3e-3, beta1=0.98, beta2=0.92, beta3=0.99, weight_decay=0.05, eps=1e-8),
            dict(lr=1e-2, beta1=0.9, beta2=0.9, beta3=0.999, weight_decay=0.0, eps=1e-6)]


def settings_of(name: str) -> dict:
    """A setting off its default (weight decay where the rule has it)."""
    hypers = examples_plugin.optimizer(name).schema.hyperparameters
    return {"weight_decay": 0.1} if "weight_decay" in hypers else {"lr": 0.5}


def oracle_settings(name: str, settings: dict) -> dict:
    out = {k: v for k, v in settings.items() if not k.startswith("beta")}
    out["betas"] = tuple(settings[k] for k in sorted(settings) if k.startswith("beta"))
    return out


@pytest.fixture
def examples():
    with examples_plugin.registered() as classes:
        yield dict(zip(examples_plugin.MODULES, classes))


@pytest.mark.parametrize("dtype, rtol, atol", [(np.float64, 1e-10, 1e-13),
                                               (np.float32, 2e-5, 2e-6)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("name", ORACLES)
def test_matches_pytorch_optimizer(examples, name, dtype, rtol, atol):
    rng = np.random.default_rng(7)
    values = {path: rng.standard_normal(shape).astype(dtype) for path, shape in SHAPES.items()}
    groups = group_settings(name)
    opt = examples[name]([{"params": {p: values[p].copy() for p in values if p.startswith(g)},
                           **s} for g, s in zip(("enc", "head"), groups)])
    tensors = {p: torch.tensor(v.copy(), requires_grad=True) for p, v in values.items()}
    oracle = getattr(pytorch_optimizer, name)(
        [{"params": [t for p, t in tensors.items() if p.startswith(g)],
          **oracle_settings(name, s)} for g, s in zip(("enc", "head"), groups)])
    for step, missing in enumerate(MISSING):
        grads = {p: rng.standard_normal(s).astype(dtype) for p, s in SHAPES.items()
                 if p not in missing}
        opt.step(grads)
        for path, tensor in tensors.items():
            tensor.grad = None if path in missing else torch.tensor(grads[path])
        oracle.step()
        for path, tensor in tensors.items():
            np.testing.assert_allclose(opt.params[path], tensor.detach().numpy(), rtol=rtol,
                                       atol=atol, err_msg=f"{name} {path} at step {step}")
    assert opt.state_of("enc.b").step == len(MISSING) - 1  # its own count
    assert opt.param_groups[0]["group_step"] == len(MISSING)  # the oracle's group["step"]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(dtype=st.sampled_from([np.float32, np.float64]),
       groups=st.lists(st.fixed_dictionaries({
           "lr": st.sampled_from([1e-3, 0.01, 0.3]),
           "beta1": st.sampled_from([0.0, 0.3, 0.5, 0.9]), "beta2": st.sampled_from([0.9, 0.999]), "eps": st.sampled_from([1e-8, 1e-3]),
           "weight_decay": st.sampled_from([0.0, 0.1])}), min_size=2, max_size=2),
       seed=st.integers(0, 2**16))
def test_the_blocks_example_gives_the_built_in_adamw_bits(dtype, groups, seed):
    """BlocksAdamW (examples/adamw_blocks.py: flatopt.blocks' lerp and fma, the public API
    only) and flatopt.AdamW give the same bits, for generated settings of two groups (a lerp
    from either end: beta1 below and above 0.5) and missing gradients."""
    rng = np.random.default_rng(seed)
    values = {path: rng.standard_normal(shape).astype(dtype) for path, shape in SHAPES.items()}

    def build(cls, to_settings):
        return cls([{"params": {p: values[p].copy() for p in values if p.startswith(g)},
                     **to_settings(s)} for g, s in zip(("enc", "head"), groups)])
    with examples_plugin.registered("BlocksAdamW") as (blocks_adamw,):
        mine = build(blocks_adamw, dict)
    built_in = build(flatopt.AdamW, lambda s: oracle_settings("AdamW", s))
    for missing in MISSING:
        grads = {p: rng.standard_normal(s).astype(dtype) for p, s in SHAPES.items()
                 if p not in missing}
        mine.step(grads)
        built_in.step(grads)
    for path in SHAPES:
        assert mine.params[path].tobytes() == built_in.params[path].tobytes(), path
        for slot in ("exp_avg", "exp_avg_sq"):
            assert getattr(mine.state_of(path), slot).tobytes() == \
                getattr(built_in.state_of(path), slot).tobytes(), (path, slot)


def test_the_blocks_example_is_torchs_fused_adamw_to_the_bit(examples):
    """Through the built-in's bits, torch's: its fused CPU AdamW on one thread (the
    conformance oracle: its single-tensor float32 sqrt is not correctly rounded), float32,
    shapes a multiple of its vector width (it rounds the remainder without fused
    multiply-adds), a lerp from the gradient's end (beta1 < 0.5)."""
    rng = np.random.default_rng(11)
    values = {f"p{j}": rng.standard_normal(shape).astype(np.float32)
              for j, shape in enumerate(FUSED_SHAPES)}
    opt = examples["BlocksAdamW"]({p: v.copy() for p, v in values.items()}, lr=0.01,
                                  beta1=0.3, weight_decay=0.1)
    tensors = {p: torch.tensor(v.copy(), requires_grad=True) for p, v in values.items()}
    oracle = torch.optim.AdamW(list(tensors.values()), lr=0.01, betas=(0.3, 0.999),
                               weight_decay=0.1, fused=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(5):
            grads = {p: rng.standard_normal(v.shape).astype(np.float32)
                     for p, v in values.items()}
            opt.step(grads)
            for path, tensor in tensors.items():
                tensor.grad = torch.tensor(grads[path])
            oracle.step()
    finally:
        torch.set_num_threads(threads)
    for path, tensor in tensors.items():
        assert opt.params[path].tobytes() == tensor.detach().numpy().tobytes(), path


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-6)],
                         ids=["float64", "float32"])
def test_the_schedule_free_example_is_the_built_in_rule(examples, dtype, rtol):
    """SFSGD (z starting at the parameter, opt.eval() / opt.train() as mode passes) against
    flatopt.ScheduleFreeSGD (itself checked against the schedulefree package): two groups,
    missing gradients, an eval and train in the middle, a step in eval mode refused."""
    rng = np.random.default_rng(4)
    values = {path: rng.standard_normal(shape).astype(dtype) for path, shape in SHAPES.items()}
    groups = [dict(lr=0.3, momentum=0.9), dict(lr=0.05, momentum=0.5)]

    def build(cls):
        return cls([{"params": {p: values[p].copy() for p in values if p.startswith(g)}, **s}
                    for g, s in zip(("enc", "head"), groups)])
    mine, built_in = build(examples["SFSGD"]), build(flatopt.ScheduleFreeSGD)
    for step, missing in enumerate(MISSING):
        grads = {p: rng.standard_normal(s).astype(dtype) for p, s in SHAPES.items()
                 if p not in missing}
        mine.step(grads)
        built_in.step(grads)
        if step == 3:
            mine.eval()
            built_in.eval()
            for path in SHAPES:  # x, the average
                np.testing.assert_allclose(mine.params[path], built_in.params[path],
                                           rtol=rtol, atol=rtol)
            with pytest.raises(flatopt.ModeError):
                mine.step(grads)
            mine.train()
            built_in.train()
    for path in SHAPES:
        np.testing.assert_allclose(mine.params[path], built_in.params[path], rtol=rtol,
                                   atol=rtol, err_msg=path)


@pytest.mark.parametrize("name", NAMES)
def test_the_examples_parallel_walk_gives_the_serial_bits(examples, name, monkeypatch):
    parallel_equals_serial(examples[name], monkeypatch, **settings_of(name))


@pytest.mark.parametrize("name", NAMES)
def test_examples_round_trip_through_checkpoints(examples, name, tmp_path):
    check_round_trip(name, tmp_path)


@pytest.mark.slow
def test_examples_resume_exactly_in_a_fresh_process(examples, tmp_path):
    check_exact_resume(tmp_path, NAMES, plugins=["examples_register"])


@pytest.mark.parametrize("name", NAMES)
def test_examples_in_the_cuda_simulator_match_the_cpu(examples, name):
    pytest.importorskip("numba_cuda")
    rng = np.random.default_rng(3)
    p = rng.standard_normal((3, 50)).astype(np.float32)
    cpu = examples[name]({"w": p.copy()}, **settings_of(name))
    gpu = examples[name]({"w": p.copy()}, **settings_of(name), device="cuda")
    for _ in range(3):
        g = rng.standard_normal((3, 50)).astype(np.float32)
        cpu.step({"w": g})
        gpu.step({"w": g})
    host = gpu.params["w"]
    host = host if isinstance(host, np.ndarray) else host.copy_to_host()
    np.testing.assert_allclose(host, cpu.params["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_examples_under_zero1_are_bit_identical_to_one_process(size):
    test_mpi = pytest.importorskip("test_mpi")
    if test_mpi._skip_reason() is not None:
        pytest.skip(test_mpi._skip_reason())
    ok = test_mpi.checks_by_rank(test_mpi.run_job(
        size, "--plugin", "examples_register", "identity", "--only", *NAMES), size)
    for name in NAMES:
        assert ok.get(f"identity {name} at {size} ranks") == set(range(size)), name


@pytest.mark.mpi
@pytest.mark.slow
def test_the_schedule_free_examples_modes_under_zero1(tmp_path):
    """opt.eval() / opt.train() of SFSGD sharded over 2 ranks (each rank its range, then the
    gather), and a sharded save in eval mode loaded and stepped on: one process's bits."""
    test_mpi = pytest.importorskip("test_mpi")
    if test_mpi._skip_reason() is not None:
        pytest.skip(test_mpi._skip_reason())
    ok = test_mpi.checks_by_rank(test_mpi.run_job(
        2, "--plugin", "examples_register", "schedulefree", "--dir", str(tmp_path), "--only",
        "SFSGD"), 2)
    assert ok.get("schedule-free SFSGD at 2 ranks") == {0, 1}


def test_the_schedule_free_examples_modes_in_the_cuda_simulator(examples):
    pytest.importorskip("numba_cuda")
    rng = np.random.default_rng(5)
    p = rng.standard_normal((3, 50)).astype(np.float32)
    cpu = examples["SFSGD"]({"w": p.copy()}, lr=0.3)
    gpu = examples["SFSGD"]({"w": p.copy()}, lr=0.3, device="cuda")
    for step in range(3):
        g = rng.standard_normal((3, 50)).astype(np.float32)
        for opt in (cpu, gpu):
            opt.step({"w": g})
            if step == 1:
                opt.eval()
                opt.train()
    for opt in (cpu, gpu):
        opt.eval()
    host = gpu.params["w"]
    host = host if isinstance(host, np.ndarray) else host.copy_to_host()
    np.testing.assert_allclose(host, cpu.params["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.cuda_compile
def test_the_examples_cuda_kernels_compile_for_sm80_and_sm90(examples):
    """What the CUDA compile tests check for the built-in rules (no spills, registers within
    the launch bounds, no float64 in a float32 kernel), for every kernel of the examples'
    own that the enumeration finds (every dtype, storage layout, exact or not). The compile
    workers get each rule by importing its module (``Rule.origin``)."""
    from bench import cuda_launches, cuda_static
    problem = cuda_static.compiler_problem()
    if problem:
        pytest.skip(f"no CUDA compiler here: {problem}")
    keys = [cls.schema.rule.key for cls in examples.values()]
    found = [f for f in cuda_launches.enumerate_launches(list(examples)).values()
             if any(key in f.launch.kernel for key in keys)]
    assert {f.family for f in found} >= {"step", "step, float64", "coded step", "prepare",
                                         "reduce", "coded reduce", "finalize"}  # (Lamb's)
    results = cuda_static.compile_all(found)
    assert len(results) == len(found) * len(cuda_static.TARGETS)
    wrong = [p for result in results for p in cuda_static.problems(result)]
    assert wrong == [], "\n".join(wrong)
