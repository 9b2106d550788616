"""Background saves (save(..., background=True) -> SaveHandle): the file holds the state at the
call while training goes on; saves of one optimizer commit in order; failures reach wait() and
exception() and leave the previous checkpoint; a SIGKILL mid-write never loses the previous
checkpoint; the interpreter waits for a pending save at exit and says so."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import flatopt
from checkpoint_helpers import make_opt, state_equal
from test_checkpoint_crash import kill_a_saver, kill_helper

ROOT = Path(__file__).resolve().parents[1]


def big_adam(n: int = 1 << 22, seed: int = 0) -> flatopt.Adam:
    """Large enough (3 x 16 MB) that a background save is still writing when save() returns."""
    rng = np.random.default_rng(seed)
    opt = flatopt.Adam({"w": rng.standard_normal(n).astype(np.float32),
                        "b": rng.standard_normal(7).astype(np.float64)}, lr=1e-3)
    step(opt, seed)
    return opt


def step(opt, seed: int) -> None:
    rng = np.random.default_rng(seed)
    opt.step({path: rng.standard_normal(view.shape).astype(view.dtype)
              for path, view in opt.params.items()})


def frozen(opt) -> tuple:
    """What a checkpoint of ``opt`` holds, copied: parameters and the state dict."""
    return ({path: view.copy() for path, view in opt.params.items()}, opt.state_dict())


def same_state(a: tuple, b: tuple) -> bool:
    (pa, sa), (pb, sb) = a, b
    if list(pa) != list(pb) or sorted(sa["state"]) != sorted(sb["state"]):
        return False
    if any(pa[k].tobytes() != pb[k].tobytes() for k in pa):
        return False
    for path, entry in sa["state"].items():
        other = sb["state"][path]
        for key, value in entry.items():
            if (value.tobytes() != other[key].tobytes() if isinstance(value, np.ndarray)
                    else value != other[key]):
                return False
    return True


def loaded(path, like=None) -> flatopt.Optimizer:
    other = big_adam(seed=99) if like is None else like
    flatopt.load(path, other)
    return other


def test_the_file_holds_the_state_at_the_call_while_training_goes_on(tmp_path):
    opt = big_adam()
    at_call = frozen(opt)
    handle = flatopt.save(tmp_path / "ck.h5", opt, metadata={"step": 1}, background=True)
    assert isinstance(handle, flatopt.checkpoint.writer.SaveHandle)
    for k in range(3):  # training goes on while the file is written
        step(opt, 10 + k)
    assert handle.wait(timeout=60) == str(tmp_path / "ck.h5")
    assert handle.done() and handle.exception() is None
    assert 0 < handle.copy_seconds <= handle.snapshot_seconds
    other = big_adam(seed=99)
    assert flatopt.load(tmp_path / "ck.h5", other).metadata == {"step": 1}
    assert same_state(frozen(other), at_call)
    assert not same_state(frozen(opt), at_call)


def test_two_saves_back_to_back_commit_in_order(tmp_path):
    opt = big_adam()
    first = flatopt.save(tmp_path / "ck.h5", opt, metadata={"i": 1}, background=True)
    step(opt, 5)
    second_state = frozen(opt)
    second = flatopt.save(tmp_path / "ck.h5", opt, metadata={"i": 2}, background=True)
    assert first.done()  # the second waited for the first before it took its snapshot
    step(opt, 6)
    assert second.wait(timeout=60) == first.wait()
    other = big_adam(seed=99)
    assert flatopt.load(tmp_path / "ck.h5", other).metadata == {"i": 2}
    assert same_state(frozen(other), second_state)
    # a plain save waits for a running background save: the plain one is the last word
    third = flatopt.save(tmp_path / "ck.h5", opt, metadata={"i": 3}, background=True)
    flatopt.save(tmp_path / "ck.h5", opt, metadata={"i": 4})
    assert third.done()
    assert flatopt.load(tmp_path / "ck.h5", other).metadata == {"i": 4}
    assert state_equal(opt, other)
    assert sorted(os.listdir(tmp_path)) == ["ck.h5"]


def test_the_snapshot_memory_is_reused(tmp_path):
    opt = big_adam()
    flatopt.save(tmp_path / "a.h5", opt, background=True).wait()
    saver = flatopt.checkpoint.writer._Saver.of(opt, create=False)
    before = {key: value.ctypes.data for key, value in saver.memory.items()}
    step(opt, 3)
    flatopt.save(tmp_path / "b.h5", opt, background=True).wait()
    assert {key: value.ctypes.data for key, value in saver.memory.items()} == before
    assert state_equal(loaded(tmp_path / "b.h5"), opt)


def test_a_failing_background_save_reaches_wait_and_keeps_the_previous_file(tmp_path):
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "ck.h5", opt, metadata="good")
    before = (tmp_path / "ck.h5").read_bytes()
    # a NaN second moment (a NaN gradient reached the optimizer): the checks that a plain save
    # makes before writing run on the background thread, on the snapshot
    opt.buffers[1].state["exp_avg_sq"][2] = np.nan
    handle = flatopt.save(tmp_path / "ck.h5", opt, metadata="bad", background=True)
    error = handle.exception(timeout=60)
    assert isinstance(error, flatopt.CheckpointError)
    assert "exp_avg_sq" in str(error) and "nothing was written" in str(error)
    with pytest.raises(flatopt.CheckpointError, match="exp_avg_sq"):
        handle.wait()
    assert handle.done() and "failed" in repr(handle)
    assert (tmp_path / "ck.h5").read_bytes() == before
    assert os.listdir(tmp_path) == ["ck.h5"]


def test_an_unseen_background_failure_is_reported_by_the_next_save(tmp_path):
    opt = make_opt("Adam")
    opt.buffers[1].state["exp_avg_sq"][2] = -1.0
    handle = flatopt.save(tmp_path / "ck.h5", opt, background=True)
    while not handle.done():
        time.sleep(0.01)
    opt.buffers[1].state["exp_avg_sq"][2] = 1.0
    with pytest.warns(RuntimeWarning, match="earlier background save .* failed"):
        flatopt.save(tmp_path / "ck.h5", opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once
        flatopt.save(tmp_path / "ck.h5", opt, background=True).wait()
    assert state_equal(loaded(tmp_path / "ck.h5", make_opt("Adam", seed=99, steps=0)), opt)


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=str(ROOT / "tests"), **kwargs)


def test_a_file_size_limit_fails_the_background_save_at_wait(tmp_path):
    """An I/O error on the background thread (here EFBIG from RLIMIT_FSIZE) reaches wait() and
    exception() as a CheckpointError; the previous checkpoint and the directory are as before."""
    code = f"""
        import os, resource, signal
        import flatopt
        from test_checkpoint_background import big_adam
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        opt = big_adam(1 << 20)
        flatopt.save({str(tmp_path / 'ck.h5')!r}, opt, metadata="previous")
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
        handle = flatopt.save({str(tmp_path / 'ck.h5')!r}, opt, metadata="new", background=True)
        error = handle.exception(timeout=120)
        print("TYPE", type(error).__name__)
        print("MESSAGE", error)
        try:
            handle.wait()
        except flatopt.CheckpointError:
            print("WAIT RAISED")
        print("FILES", sorted(os.listdir({str(tmp_path)!r})))
    """
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "TYPE CheckpointError" in out and "WAIT RAISED" in out, out
    assert "disk is full or a file size limit" in out and "untouched" in out
    assert "FILES ['ck.h5']" in out
    assert flatopt.load(tmp_path / "ck.h5", big_adam(1 << 20, seed=9)).metadata == "previous"


def test_the_interpreter_waits_for_a_pending_save_at_exit_and_says_so(tmp_path):
    code = f"""
        import flatopt
        from test_checkpoint_background import big_adam
        opt = big_adam()
        flatopt.save({str(tmp_path / 'ck.h5')!r}, opt, metadata="at exit", background=True)
        print("EXITING", flush=True)
    """
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "EXITING"
    assert "flatopt: waiting for the background save of" in proc.stderr
    assert f"background save of {tmp_path / 'ck.h5'} committed" in proc.stderr
    other = big_adam(seed=99)
    assert flatopt.load(tmp_path / "ck.h5", other).metadata == "at exit"
    assert state_equal(other, big_adam())


def test_at_exit_a_failed_background_save_is_reported(tmp_path):
    code = f"""
        import numpy as np, flatopt
        from test_checkpoint_background import big_adam
        opt = big_adam()
        opt.buffers[0].state["exp_avg_sq"][-1] = np.inf
        flatopt.save({str(tmp_path / 'ck.h5')!r}, opt, background=True)
    """
    proc = run_python(code)
    assert "FAILED" in proc.stderr and "exp_avg_sq" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "ck.h5").exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_background_save_never_waits_for_it(tmp_path):
    """The save's thread stays in the parent (which commits it); the child's
    handle says so instead of waiting forever, and neither its next save nor its exit waits."""
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    code = f"""
        import os, signal, sys, threading
        import flatopt
        from flatopt.checkpoint import writer
        from test_checkpoint_background import big_adam
        entered, release = threading.Event(), threading.Event()
        real = writer.files.replace_atomically

        def held(final, write):  # the parent's save is running until released
            if final == {a!r}:
                entered.set()
                release.wait()
            real(final, write)

        writer.files.replace_atomically = held
        opt = big_adam(1 << 16)
        flatopt.save({b!r}, opt)  # Numba compiles the value checks now: a fork while the
        # save's thread compiles would leave Numba's compiler lock held in the child
        handle = flatopt.save({a!r}, opt, background=True)
        entered.wait()
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # a hang ends the child with SIGALRM
            try:
                handle.wait(timeout=10)
                print("CHILD wait returned", flush=True)
            except flatopt.CheckpointError as exc:
                print("CHILD told", "parent" in str(exc), flush=True)
            except TimeoutError:
                print("CHILD wait timed out", flush=True)
            flatopt.save({b!r}, opt)
            print("CHILD saved", flush=True)
            sys.exit(0)
        release.set()
        print("PARENT committed", handle.wait() == {a!r}, flush=True)
        print("CHILD exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    """
    proc = run_python(code)
    assert sorted(proc.stdout.split()) == sorted(
        "CHILD told True CHILD saved PARENT committed True CHILD exit 0".split()), \
        (proc.stdout, proc.stderr[-3000:])
    for path in (a, b):
        assert state_equal(loaded(path, big_adam(1 << 16, seed=9)), big_adam(1 << 16))


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork and SIGKILL")
def test_sigkill_during_background_saves_never_loses_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ck.h5"
    with kill_helper(path) as ask:
        rng = random.Random(20261201)
        last, advanced, start = 1, 0, 10_000
        for _ in range(8):
            number = kill_a_saver(ask, path, f"forkbg {start}", rng.uniform(0.0, 0.3))
            assert number >= last
            advanced += number != last
            last = number
            start += 10_000
        assert advanced >= 2, advanced
        assert ask(f"save {start}") == "saved"  # the next save removes the killed one's temps
        assert os.listdir(tmp_path) == ["ck.h5"]
