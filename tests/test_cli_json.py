"""`flatopt ... --json` prints strict JSON: a NaN difference comes out as null, not NaN or 0."""

import json

import numpy as np

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
