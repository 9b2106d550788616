"""Crash safety: a saving process killed with SIGKILL at random moments, many times. The
checkpoint at the path always loads, intact and complete; half-written temporary files are
refused (or, if the kill came after the commit digest, are complete); the next save cleans
them up."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import flatopt
from checkpoint_kill_helper import build

HELPER = Path(__file__).with_name("checkpoint_kill_helper.py")
ROUNDS = 30


def check_consistent(opt) -> int:
    """All values equal one checkpoint number; return it."""
    values = {float(v) for buf in opt.buffers for v in (buf.params[0], buf.params[-1])}
    assert len(values) == 1, values
    i = values.pop()
    for buf in opt.buffers:
        assert np.all(buf.params == i)
        for name in ("exp_avg", "exp_avg_sq"):
            assert np.all(buf.state[name] == i)
        assert np.all(buf.columns["step"] == i)
    return int(i)


@contextlib.contextmanager
def kill_helper(path):
    """The helper process (``checkpoint_kill_helper.py``), ready and with checkpoint 1 saved;
    yields ``ask(command) -> its answer``."""
    helper = subprocess.Popen([sys.executable, str(HELPER), str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def ask(line: str) -> str:
        helper.stdin.write(line + "\n")
        helper.stdin.flush()
        return helper.stdout.readline().strip()

    try:
        assert helper.stdout.readline().strip() == "ready"
        assert ask("save 1") == "saved"
        yield ask
        ask("quit")
    finally:
        helper.kill()
        helper.wait()


def kill_a_saver(ask, path, command: str, delay: float) -> int:
    """Fork a saver (``command``: "fork I" or "forkbg I"), SIGKILL it after ``delay`` seconds,
    load the checkpoint (which must never fail) and return its consistent number."""
    pid = int(ask(command))
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    ask(f"reap {pid}")
    target = build()
    result = flatopt.load(path, target)  # never raises: the old or the new checkpoint
    number = check_consistent(target)
    assert result.metadata == {"i": number}
    return number


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork and SIGKILL")
def test_sigkill_during_save_never_loses_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ck.h5"
    with kill_helper(path) as ask:
        rng = random.Random(20261130)
        last = 1
        start = 10_000
        temp_seen = advanced = 0
        for round_ in range(ROUNDS):
            number = kill_a_saver(ask, path, f"fork {start}", rng.uniform(0.0, 0.15))
            assert number >= last
            advanced += number != last
            last = number
            for name in os.listdir(tmp_path):
                if name == "ck.h5":
                    continue
                assert name.startswith(".ck.h5.") and name.endswith(".tmp"), name
                temp_seen += 1
                other = build()
                try:
                    flatopt.load(tmp_path / name, other)
                except flatopt.CheckpointError:
                    continue  # an incomplete file is refused
                check_consistent(other)  # killed after the digest: a complete file
            start += 10_000
        # the kills landed both between saves and in the middle of them
        print(f"{ROUNDS} kills: checkpoint advanced {advanced} times, {temp_seen} temporary files")
        assert advanced >= 3 and temp_seen >= 3, (advanced, temp_seen)
        # stale temporary files of killed savers are removed by the next save
        assert ask(f"save {start}") == "saved"
        assert os.listdir(tmp_path) == ["ck.h5"]
