"""Where the CPU kernels use Numba's threads: a serial kernel never calls the parallel scheduler
(no launch, no wake-up of worker threads), and a parallel kernel has exactly one parallel region,
its ``prange`` loop (no allocation or final reduction compiled as a parallel loop of its own).
Checked in the LLVM IR of every threaded kernel a training loop compiles."""

from __future__ import annotations

import re

import numpy as np
import pytest
from numba import prange

import flatopt
from flatopt.kernels import amx, cpu
from flatopt.kernels.rules import muon
from flatopt.kernels import threads

from optimizers import INFO, NAMES, build, fit_params

SCHEDULER_CALL = re.compile(r"call [^\n]*@do_scheduling_(?:un)?signed")


def _run_everything(monkeypatch, parallel: bool) -> None:
    """A step with clipping of every registered optimizer (Adafactor with a matrix), an EMA
    update, a gradient scaling and the sharded norm's partial sums, all in float32."""
    if parallel:
        monkeypatch.setattr(threads, "PARALLEL_MIN_ELEMENTS", 0)
        monkeypatch.setattr(threads, "_policy", "always")
    shapes = {"w": (24, 40), "b": (40,)}
    for name in NAMES:
        params = fit_params(name, {k: np.ones(s, np.float32) for k, s in shapes.items()})
        opt = build(name, params)
        opt.step({k: np.full(v.shape, 0.5, np.float32) for k, v in params.items()},
                 max_grad_norm=1.0)
        flatopt.EMA(opt).update()
        flatopt.scale_gradients(opt, 0.5)
    # Muon's bfloat16 iteration: the AMX kernels where the CPU has them, the fallback's rounding
    muon_params = {"w": np.ones((40, 72), np.float32), "t": np.ones((72, 40), np.float32)}
    flatopt.Muon(muon_params, ns_dtype="bfloat16").step(
        {k: np.full(v.shape, 0.5, np.float32) for k, v in muon_params.items()})
    muon.newtonschulz_bfloat16(np.ones((40, 72), np.float32), (3.4445, -4.775, 2.0315), 2, 1e-7,
                               tiles=False)
    buf = opt.buffers[0]
    cpu.gradient_chunk_partials(
        buf.length, buf.grads, buf.present, buf.offsets, buf.sizes, buf.chunk_first, buf.chunk_size, 2.0,
        1, 0, buf.chunk_first.size)
    monkeypatch.undo()


def _scheduler_calls(threaded: threads.Threaded, way: str) -> dict[str, int]:
    """Per float32 signature used in this process: calls of Numba's parallel scheduler in the
    LLVM IR of ``way`` ("serial" or "parallel"). A kernel loaded from the disk cache has no IR:
    that one is compiled afresh."""
    used = getattr(threaded, way)
    fresh = None
    counts = {}
    for signature in used.signatures:
        if "float64" in str(signature) and "float32" not in str(signature):
            continue
        if used.stats.cache_hits.get(signature):
            fresh = fresh or getattr(threaded.uncached(), way)
            fresh.compile(signature)
            ir = fresh.inspect_llvm(signature)
        else:
            ir = used.inspect_llvm(signature)
        counts[str(signature)] = len(SCHEDULER_CALL.findall(ir))
    return counts


@pytest.fixture(scope="module")
def exercised():
    with pytest.MonkeyPatch.context() as monkeypatch:
        _run_everything(monkeypatch, parallel=False)
        _run_everything(monkeypatch, parallel=True)
    return list(threads.ALL)


@pytest.mark.slow  # the fixture compiles every rule's parallel kernels: the fast loop's
def test_every_threaded_kernel_of_a_training_loop_ran_both_ways(exercised):
    ran = {t.name for t in exercised if t.serial.signatures and t.parallel.signatures}
    assert {"cpu.reduce_gradients_sum_squares", "tools.lerp_into", "adafactor._square_sums",
            "adafactor._update_square_sums", "adafactor._apply",
            "cpu.gradient_chunk_partials_sum_squares", "muon._momentum", "muon._apply",
            "amx._round"} <= ran
    if amx.available():
        assert {"amx._pack", "amx._dot", "muon._start", "muon._combine", "muon._advance"} <= ran
    for name in NAMES:
        if not INFO[name].per_matrix_update:  # an element step kernel of its own
            rule = flatopt.registry.lookup(name).schema.rule
            assert any(t.startswith(f"step_{rule.name}_") for t in ran), rule.name
    assert any(t.startswith("reduce_lamb_") for t in ran)


@pytest.mark.slow  # (parallel_chunk_walk in tests/test_kernels.py runs those of a few)
def test_serial_kernels_never_call_the_parallel_scheduler(exercised):
    checked = 0
    for threaded in exercised:
        for signature, calls in _scheduler_calls(threaded, "serial").items():
            assert calls == 0, f"{threaded.name} {signature}: {calls} parallel launches"
            checked += 1
    assert checked >= len(NAMES)  # every rule's step walk at least


@pytest.mark.slow
def test_parallel_kernels_launch_once(exercised):
    """np.zeros, .sum() and array expressions in a parallel=True kernel would each add a
    parallel region (a launch that waits for every worker thread)."""
    checked = 0
    for threaded in exercised:
        if not threaded.parallel.signatures:
            continue
        for signature, calls in _scheduler_calls(threaded, "parallel").items():
            assert calls == 1, f"{threaded.name} {signature}: {calls} parallel regions"
            checked += 1
    assert checked >= len(NAMES)


def test_the_check_sees_a_parallel_region_made_by_an_array_expression():
    """The IR check is not blind: a reduction written as .sum() in a parallel kernel counts as
    a second region."""
    def two_regions(x):
        total = np.empty(x.size)
        for i in prange(x.size):
            total[i] = x[i] * 2
        return np.zeros(x.size).sum() + total[0]

    kernel = threads.Threaded(two_regions, "test_threads.two_regions", cache=False)
    threads.ALL.remove(kernel)
    x = np.ones(10)
    assert kernel.parallel(x) == kernel.serial(x) == 2.0
    assert len(SCHEDULER_CALL.findall(kernel.parallel.inspect_llvm(
        kernel.parallel.signatures[0]))) >= 2
    assert not SCHEDULER_CALL.findall(kernel.serial.inspect_llvm(kernel.serial.signatures[0]))


# ---------------------------------------------------------------------------- the policy
def test_auto_runs_the_faster_way_and_tries_the_other_again(monkeypatch):
    monkeypatch.setattr(threads, "_policy", "auto")
    monkeypatch.setattr(threads, "USABLE_CORES", 2)
    monkeypatch.setattr(threads, "get_num_threads", lambda: 2)
    n = threads.PARALLEL_MIN_ELEMENTS
    durations = {"serial": 1.0, "parallel": 5.0}  # parallel slow: BLAS threads spinning
    kernel = threads.Threaded(lambda x: x, "test_threads.fake", cache=False)
    threads.ALL.remove(kernel)
    ran = []
    clock = [0.0]
    kernel.serial = lambda x: ran.append("serial") or clock.__setitem__(
        0, clock[0] + durations["serial"])
    kernel.parallel = lambda x: ran.append("parallel") or clock.__setitem__(
        0, clock[0] + durations["parallel"])
    monkeypatch.setattr(threads.time, "perf_counter", lambda: clock[0])
    for _ in range(3 * threads.RETRY_EVERY):
        kernel(n, None)
    settled = ran[8:]
    assert settled.count("parallel") == 3  # one retry per RETRY_EVERY calls
    durations.update(serial=5.0, parallel=1.0)  # the machine went quiet
    ran.clear()
    for _ in range(3 * threads.RETRY_EVERY):
        kernel(n, None)
    assert ran[-threads.RETRY_EVERY:].count("serial") == 1  # settled on parallel, one retry
    ran.clear()
    kernel(n - 1, None)  # below the threshold: serial, untimed
    assert ran == ["serial"] and n - 1 not in kernel.timings


@pytest.mark.parametrize("policy, expected", [("never", "serial"), ("always", "parallel")])
def test_never_and_always_are_what_they_say(monkeypatch, policy, expected):
    monkeypatch.setattr(threads, "USABLE_CORES", 2)
    monkeypatch.setattr(threads, "get_num_threads", lambda: 2)
    previous = threads.set_policy(policy)
    try:
        kernel = threads.Threaded(lambda x: x, "test_threads.fake", cache=False)
        threads.ALL.remove(kernel)
        ran = []
        kernel.serial = lambda x: ran.append("serial")
        kernel.parallel = lambda x: ran.append("parallel")
        for _ in range(10):
            kernel(1 << 30, None)
        assert ran == [expected] * 10
    finally:
        threads.set_policy(previous)
    with pytest.raises(ValueError, match="'auto', 'always', 'never'"):
        threads.set_policy("sometimes")


def test_the_policy_comes_from_the_environment_and_bad_values_are_named():
    import subprocess
    import sys
    code = "import flatopt; print(flatopt.kernels.threads.get_policy())"
    env = {**__import__("os").environ, "FLATOPT_PARALLEL": "never"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "never", out.stderr
    env["FLATOPT_PARALLEL"] = "maybe"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "EnvironmentVariableError" in out.stderr
    assert "FLATOPT_PARALLEL='maybe'" in out.stderr and "auto, always, never" in out.stderr


BAD_POLICY_STEP = """
import numpy as np, flatopt
opt = flatopt.SGD({"w": np.ones(300000, np.float32), "b": np.ones(3, np.float32)}, lr=0.1,
                  momentum=0.9)
ema = flatopt.EMA(opt)
grads = {"w": np.ones(300000, np.float32), "b": np.ones(3, np.float32)}
calls = [lambda: opt.step(grads), lambda: opt.step(grads, max_grad_norm=1.0), ema.update,
         lambda: flatopt.scale_gradients(opt, 0.5)]
for call in calls:
    try:
        call()
    except flatopt.EnvironmentVariableError as exc:
        assert "FLATOPT_PARALLEL='maybe'" in str(exc) and "auto, always, never" in str(exc)
    else:
        raise AssertionError("no error")
assert opt.state_of("w") is None and (opt.params["w"] == 1).all()  # nothing changed
assert (ema.params["w"] == 1).all() and not opt.grads.is_present("w")
flatopt.set_parallel_policy("never")  # an explicit choice replaces the variable's
opt.step(grads)
assert opt.state_of("w").momentum_buffer[0] == 1 and flatopt.get_parallel_policy() == "never"
print("ok")
"""


def test_a_bad_policy_in_the_environment_fails_the_step_not_the_import():
    """An unknown FLATOPT_PARALLEL made ``import flatopt`` raise, so nothing (not even
    ``flatopt inspect``) ran: the typed error comes from the first step, before it changes
    anything; tools that do not step work (tests/test_cli.py)."""
    import subprocess
    import sys
    env = {**__import__("os").environ, "FLATOPT_PARALLEL": "maybe"}
    out = subprocess.run([sys.executable, "-c", BAD_POLICY_STEP], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_usable_cores_take_a_containers_cpu_quota(tmp_path):
    quota = tmp_path / "cpu.max"
    quota.write_text("100000 100000\n")
    assert threads._usable_cores(str(quota)) == 1
    quota.write_text("max 100000\n")
    assert threads._usable_cores(str(quota)) == threads._usable_cores(str(tmp_path / "none"))
    quota.write_text("50000 100000\n")  # half a core: still one
    assert threads._usable_cores(str(quota)) == 1


def test_a_parallel_call_runs_on_at_most_the_usable_cores_and_restores_the_count(monkeypatch):
    counts = [8]
    seen = []
    monkeypatch.setattr(threads, "get_num_threads", lambda: counts[-1])
    monkeypatch.setattr(threads, "set_num_threads", lambda n: counts.append(n))
    monkeypatch.setattr(threads, "USABLE_CORES", 2)
    monkeypatch.setattr(threads, "_policy", "always")
    kernel = threads.Threaded(lambda x: x, "test_threads.fake", cache=False)
    threads.ALL.remove(kernel)
    kernel.parallel = lambda x: seen.append(counts[-1])
    kernel(1 << 30, None)
    assert seen == [2] and counts[-1] == 8  # lowered for the call, then put back
