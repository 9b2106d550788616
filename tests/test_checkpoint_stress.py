"""Several processes saving and loading the same run directory and the same single file for
a fixed time, one of them killed now and then in the middle of whatever it does: no load ever
fails on a sound directory, what loads is always one whole save, the last committed save is
always loadable, and no temporary file survives the next successful save.

The fast loop runs it for a few seconds; ``slow`` for a minute; FLATOPT_STRESS_SECONDS sets
another duration (and FLATOPT_STRESS_WORKERS the number of processes)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

import flatopt
from flatopt.checkpoint import files, run, verify_checkpoint

from checkpoint_stress_worker import build, digest, step

WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_stress_worker.py")


def _stress(tmp_path, seconds: float, workers: int) -> None:
    run_dir, file = str(tmp_path / "run"), str(tmp_path / "one.h5")
    warm = build(0)   # compile the kernels once, into the cache the workers share
    step(warm, __import__("numpy").random.default_rng(0))
    flatopt.save(run_dir, warm, metadata={"digest": digest(warm), "seed": 0})
    flatopt.save(file, warm["sgd"], metadata={"digest": digest({"sgd": warm["sgd"]})})
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))

    def start(seed, duration):
        return subprocess.Popen([sys.executable, WORKER, run_dir, file, str(duration),
                                 str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
    survivors = [start(seed, seconds) for seed in range(1, workers)]
    rng = random.Random(0)
    killed = 0
    deadline = time.monotonic() + seconds
    seed = 100
    while time.monotonic() < deadline:   # one worker, killed at random moments
        victim = start(seed, seconds)
        time.sleep(rng.uniform(2.0, 4.0))
        victim.send_signal(signal.SIGKILL)
        victim.communicate()
        killed += 1
        seed += 1
    totals = {}
    for proc in survivors:
        out, err = proc.communicate(timeout=seconds + 300)
        assert proc.returncode == 0, err[-4000:]
        for key, value in json.loads(out.strip().splitlines()[-1]).items():
            totals[key] = totals.get(key, 0) + value
    assert totals["run_loads"] > 0 and totals["file_loads"] > 0, totals
    # the last committed save loads, and is one whole save
    fresh = build(7)
    result = flatopt.load(run_dir, fresh)
    assert digest(fresh) == result["sgd"].metadata["digest"]
    assert run.verify_run(run_dir)["ok"] and verify_checkpoint(file)["ok"]
    # the next successful save leaves no temporary file, and only its own members
    flatopt.save(run_dir, fresh, metadata={"digest": digest(fresh), "seed": 7})
    flatopt.save(file, fresh["sgd"], metadata={"digest": digest({"sgd": fresh["sgd"]})})
    committed = {m["file"] for m in run.read_run(run_dir)["members"]}
    assert set(os.listdir(run_dir)) == committed | {run.RUN_FILE, run.LOCK_FILE}
    assert not [e for e in os.listdir(tmp_path) if files.TEMPORARY.fullmatch(e)]
    print(f"stress: {workers} processes, {seconds} s, {killed} killed, {totals}")


def test_processes_saving_and_loading_one_run_and_one_file(tmp_path):
    _stress(tmp_path, float(os.environ.get("FLATOPT_STRESS_SECONDS", 6)),
            int(os.environ.get("FLATOPT_STRESS_WORKERS", 3)))


@pytest.mark.slow
def test_processes_saving_and_loading_for_a_minute(tmp_path):
    _stress(tmp_path, 60.0, 4)
