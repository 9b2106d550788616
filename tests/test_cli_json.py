"""`flatopt ... --json` prints strict JSON: a NaN difference comes out as null, not NaN or 0."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import flatopt
from flatopt import cli


def test_diff_json_is_strict_json_even_with_nan(tmp_path, capsys):
    opt = flatopt.SGD({"w": np.ones(3)}, lr=0.1)
    flatopt.save(tmp_path / "a.h5", opt)
    opt.params["w"][0] = np.nan
    flatopt.save(tmp_path / "b.h5", opt)
    assert cli.main(["diff", "--json", str(tmp_path / "a.h5"), str(tmp_path / "b.h5")]) == 1
    out = capsys.readouterr().out
    report = json.loads(out, parse_constant=lambda name: pytest_fail(name))
    assert report["identical"] is False and "NaN" not in out
    (difference,) = report["params"]
    # NaN against 1.0 is an unbounded difference, not 0.0: null in strict JSON
    assert difference["elements_differing"] == 1 and difference["max_abs_diff"] is None


def pytest_fail(name):
    raise AssertionError(f"non-standard JSON constant {name} in --json output")


@pytest.mark.parametrize("command", [["verify", "a.h5"], ["diff", "a.h5", "b.h5"],
                                     ["verify", "--json", "a.h5"], ["inspect", "a.h5"]])
def test_a_closed_output_pipe_exits_1_quietly(command, tmp_path):
    """Issue 23 #7: `flatopt verify ... | head -1` must not report success it could not print;
    exit 1 as Python's documentation recommends (SIGPIPE handling), with no traceback."""
    flatopt.save(tmp_path / "a.h5", flatopt.SGD({"w": np.ones(3)}, lr=0.1))
    flatopt.save(tmp_path / "b.h5", flatopt.SGD({"w": np.ones(3)}, lr=0.1))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        run = subprocess.run([sys.executable, "-m", "flatopt.cli", *command], cwd=tmp_path,
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert run.returncode == 1 and run.stderr == "", (run.returncode, run.stderr)
