"""The `flatopt` command (flatopt.cli): inspect, verify and diff, as text and as strict JSON
(a NaN difference comes out as null, not NaN or 0), `inspect --tensors`, extra arrays, a
checkpoint of several optimizers, the installed entry point, a closed output pipe, and hostile
names and arguments printed escaped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flatopt
from flatopt import cli
from flatopt.checkpoint import run
from checkpoint_helpers import data_extent as chunk_offset
from checkpoint_helpers import make_opt, model_params, step_with_grads
from test_checkpoint_run import advance, build, save


# --------------------------------------------------------------------------- --json
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


# --------------------------------------------------------------------------- a closed output pipe
@pytest.mark.parametrize("command", [["verify", "a.h5"], ["diff", "a.h5", "b.h5"],
                                     ["verify", "--json", "a.h5"], ["inspect", "a.h5"]])
def test_a_closed_output_pipe_exits_1_quietly(command, tmp_path):
    """`flatopt verify ... | head -1` must not report success it could not print;
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


# ----------------------------------------------------------------------- inspect, verify and diff
def test_cli_inspect_verify_diff(tmp_path, capsys):
    opt = make_opt("Adam", steps=3)
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    flatopt.save(a, opt, metadata={"epoch": 1})
    steps = [opt.state_of(p).step if opt.state_of(p) else 0 for p in opt.params]
    step_with_grads(opt, 0, 1, start=3)
    opt.param_groups[1]["lr"] = 0.005
    flatopt.save(b, opt, metadata={"epoch": 2})

    assert cli.main(["inspect", str(a)]) == 0
    out = capsys.readouterr().out
    assert "Adam" in out and "format" in out and "version 2" in out and "'no_decay'" in out
    assert "lr=0.02" in out and "step counts" in out
    assert cli.main(["inspect", "--json", str(a)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["optimizer"] == "Adam" and info["parameters"] == 7
    assert info["format_version"] == 2 and info["groups"][1]["hyperparameters"]["lr"] == 0.01
    assert (info["step_min"], info["step_max"]) == (min(steps), max(steps))
    assert info["elements"] == sum(v.size for v in model_params().values())

    assert cli.main(["verify", str(a)]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli.main(["diff", str(a), str(a)]) == 0
    assert "identical" in capsys.readouterr().out
    assert cli.main(["diff", "--json", str(a), str(b)]) == 1
    result = json.loads(capsys.readouterr().out)
    assert {"group": 1, "field": "lr", "a": 0.01, "b": 0.005} in result["groups"]
    changed = {(p["path"], p["field"]) for p in result["params"]}
    stepped = [p for p, before in zip(opt.params, steps)
               if opt.state_of(p) and opt.state_of(p).step == before + 1 and opt.params[p].size]
    assert stepped
    for path in stepped:
        assert (path, "params") in changed and (path, "step") in changed

    damaged = bytearray(a.read_bytes())
    start, size = chunk_offset(bytes(damaged), "/groups/1/float32/exp_avg_sq")
    damaged[start + 3] ^= 1
    bad = tmp_path / "bad.h5"
    bad.write_bytes(bytes(damaged))
    assert cli.main(["verify", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "NOT SOUND" in out and "/groups/1/float32/exp_avg_sq" in out
    assert cli.main(["verify", "--json", str(bad)]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
    assert cli.main(["inspect", str(tmp_path / "nope.h5")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_entry_point_on_a_demo_checkpoint(tmp_path):
    path = tmp_path / "demo.h5"
    run = subprocess.run([sys.executable, "-m", "flatopt.demo", "--steps", "3", "--hidden", "16",
                          "--checkpoint", str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    exe = Path(sys.executable).parent / "flatopt"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "flatopt.cli"]
    run = subprocess.run(command + ["inspect", "--json", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout)
    assert info["optimizer"] == "AdamW" and info["step_max"] == 3
    assert [g["label"] for g in info["groups"]] == ["no_decay", "decay"]
    run = subprocess.run(command + ["verify", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "OK" in run.stdout


# --------------------------------------------------------------------------- inspect --tensors
def test_cli_inspect_tensors_text_and_json(tmp_path, capsys):
    opt = make_opt("Adam")
    opt.param_groups[0]["label"] = "no\x1b[2Jdecay"
    flatopt.save(tmp_path / "ck.h5", opt, arrays={"ema\x1b]0;x\x07": np.zeros((2, 3)),
                                                  "count": np.int64(4)})
    assert cli.main(["inspect", "--tensors", str(tmp_path / "ck.h5")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    lines = out.splitlines()
    header = next(k for k, line in enumerate(lines) if line.split()[:5] ==
                  ["path", "shape", "dtype", "group", "step"])
    rows = lines[header + 1:header + 1 + len(opt.index)]
    for line, info in zip(rows, sorted(opt.index, key=lambda i: i.id)):
        step = opt.buffers[info.buffer].columns["step"][info.slot]
        shape = "(" + ", ".join(map(str, info.shape)) + ("," if len(info.shape) == 1 else "")
        assert line.split()[0] == info.path and line.split()[-1] == str(step)
        assert f" {shape}) " in line and f" {info.dtype.name} " in line
        assert f" {info.group} '" in line
    assert "(4, 3)" in out and "()" in out and "(0, 2)" in out
    assert "ema\\x1b]0;x\\x07" in out and "count" in out and "int64" in out
    assert "'no\\x1b[2Jdecay'" in out

    assert cli.main(["inspect", "--tensors", "--json", str(tmp_path / "ck.h5")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["columns"] == ["step"]
    assert [t["path"] for t in info["tensors"]] == [i.path for i in opt.index]
    enc = next(t for t in info["tensors"] if t["path"] == "enc.weight")
    assert enc["shape"] == [4, 3] and enc["dtype"] == "float32" and enc["label"] == "decay"
    assert enc["step"] == opt.state_of("enc.weight").step
    assert info["arrays"] == [{"name": "ema\x1b]0;x\x07", "shape": [2, 3], "dtype": "float64",
                               "bytes": 48},
                              {"name": "count", "shape": [], "dtype": "int64", "bytes": 8}]
    # without --tensors: no tensor rows, arrays still listed
    assert cli.main(["inspect", "--json", str(tmp_path / "ck.h5")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "tensors" not in info and len(info["arrays"]) == 2


def test_cli_inspect_tensors_of_sgd_lists_its_column(tmp_path, capsys):
    opt = make_opt("SGD")
    flatopt.save(tmp_path / "ck.h5", opt)
    assert cli.main(["inspect", "--tensors", str(tmp_path / "ck.h5")]) == 0
    out = capsys.readouterr().out
    assert "momentum_initialized" in out
    assert cli.main(["inspect", "--tensors", "--json", str(tmp_path / "ck.h5")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["columns"] == ["momentum_initialized"]
    assert all(t["momentum_initialized"] in (0, 1) for t in info["tensors"])


# ------------------------------------------------------------------ extra arrays and shaped slots
def test_cli_diff_reports_extra_arrays(tmp_path, capsys):
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "a.h5", opt, arrays={"ema": np.zeros(4), "gone": np.ones(2),
                                                 "kind": np.zeros(2, np.int32)})
    flatopt.save(tmp_path / "b.h5", opt, arrays={"ema": np.array([0.0, 1.0, 0.0, 2.0]),
                                                 "new": np.ones(2), "kind": np.zeros(2)})
    assert cli.main(["diff", "--json", str(tmp_path / "a.h5"), str(tmp_path / "b.h5")]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["params"] == [] and report["header"] == []
    by_name = {item["array"]: item for item in report["arrays"]}
    assert by_name["ema"]["elements_differing"] == 2 and by_name["ema"]["max_abs_diff"] == 2.0
    assert (by_name["gone"]["a"], by_name["gone"]["b"]) == (True, False)
    assert (by_name["new"]["a"], by_name["new"]["b"]) == (False, True)
    assert by_name["kind"]["a"] == ["<i4", [2]] and by_name["kind"]["b"] == ["<f8", [2]]
    assert cli.main(["diff", str(tmp_path / "a.h5"), str(tmp_path / "b.h5")]) == 1
    assert "array 'ema': values differ in 2 elements (max abs diff 2)" in capsys.readouterr().out
    flatopt.save(tmp_path / "c.h5", opt, arrays={"ema": np.zeros(4), "gone": np.ones(2),
                                                 "kind": np.zeros(2, np.int32)})
    assert cli.main(["diff", str(tmp_path / "a.h5"), str(tmp_path / "c.h5")]) == 0


def test_cli_diff_reads_shaped_slots_by_their_own_layout(tmp_path):
    """Adafactor's row_var is packed by its own layout (one entry per matrix
    row), not at the parameters' offsets: diff finds a change there and names its owner."""
    rng = np.random.default_rng(0)
    params = {"a": rng.standard_normal((6, 5)).astype(np.float32),
              "b": rng.standard_normal((4, 3)).astype(np.float32),
              "c": rng.standard_normal(7).astype(np.float32)}
    opt = flatopt.Adafactor(params, lr=0.01)
    opt.step({path: rng.standard_normal(v.shape).astype(np.float32) for path, v in params.items()})
    flatopt.save(tmp_path / "a.h5", opt)
    buf = opt.buffers[0]
    number = buf.paths.index("b")
    buf.state_view("row_var", number)[-1] *= 2  # b's last row, past a's offsets in params
    flatopt.save(tmp_path / "b.h5", opt)
    found = flatopt.checkpoint.diff_checkpoints(tmp_path / "a.h5", tmp_path / "b.h5")
    assert not found["identical"]
    assert [(d["path"], d["field"], d["elements_differing"]) for d in found["params"]] == \
        [("b", "row_var", 1)]


def test_cli_diff_of_arrays_counts_nan_against_nan_as_equal_and_bools_by_count(tmp_path, capsys):
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "a.h5", opt, arrays={"f": np.array([np.nan, 1.0, 2.0]),
                                                 "mask": np.array([True, False])})
    flatopt.save(tmp_path / "b.h5", opt, arrays={"f": np.array([np.nan, 1.0, 2.5]),
                                                 "mask": np.array([True, True])})
    assert cli.main(["diff", "--json", str(tmp_path / "a.h5"), str(tmp_path / "b.h5")]) == 1
    by_name = {item["array"]: item for item in json.loads(capsys.readouterr().out)["arrays"]}
    assert by_name["f"]["elements_differing"] == 1 and by_name["f"]["max_abs_diff"] == 0.5
    assert by_name["mask"]["elements_differing"] == 1 and "max_abs_diff" not in by_name["mask"]


def test_cli_verify_names_extra_arrays_and_inspect_marks_a_cut_text(tmp_path, capsys):
    opt = make_opt("Adam")
    state = 12345678901234567890123456789012345678  # a 38-digit RNG state, cut mid-number
    flatopt.save(tmp_path / "ck.h5", opt, arrays={"ema:head.weight": np.zeros(3)},
                 metadata={"note": "x" * 180, "rng": str(state)})
    assert cli.main(["verify", str(tmp_path / "ck.h5")]) == 0
    out = capsys.readouterr().out
    assert "array 'ema:head.weight'" in out and "/arrays/0" not in out
    assert cli.main(["inspect", str(tmp_path / "ck.h5")]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if "metadata" in l)
    assert "more characters; --json prints all of it" in line
    assert cli.main(["inspect", "--json", str(tmp_path / "ck.h5")]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"]["rng"] == str(state)


# -------------------------------------------------------------------- hostile names and arguments
def test_diff_and_inspect_print_paths_and_labels_escaped(tmp_path, capsys):
    hostile = "evil\x1b]0;owned\x07\x1b[2J"
    a = flatopt.SGD([{"params": {hostile: np.zeros(2, np.float32)}, "label": hostile}])
    b = flatopt.SGD([{"params": {"other": np.zeros(2, np.float32)}, "label": "plain"}])
    flatopt.save(tmp_path / "a.h5", a, metadata={"note": hostile})
    flatopt.save(tmp_path / "b.h5", b)
    for argv in (["diff", str(tmp_path / "a.h5"), str(tmp_path / "b.h5")],
                 ["inspect", str(tmp_path / "a.h5")], ["verify", str(tmp_path / "a.h5")]):
        cli.main(argv)
        out = capsys.readouterr()
        assert "\x1b" not in out.out + out.err and "\x07" not in out.out + out.err, argv
    cli.main(["diff", str(tmp_path / "a.h5"), str(tmp_path / "b.h5")])
    assert "evil\\x1b]0;owned\\x07\\x1b[2J" in capsys.readouterr().out
    cli.main(["diff", "--json", str(tmp_path / "a.h5"), str(tmp_path / "b.h5")])
    assert json.loads(capsys.readouterr().out)["only_in_a"] == [hostile]  # --json unchanged


def test_argparse_errors_print_hostile_arguments_escaped(capsys):
    """argparse's error quotes the command line; a file name's escape sequences
    must not reach the terminal raw."""
    hostile = "evil\x1b]0;PWNED\x07\x1b[2J.h5"
    for argv in (["verify", "good.h5", hostile], ["inspect", "--tensors", "x", hostile],
                 [hostile], ["diff", "a.h5", "b.h5", "--" + hostile]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "\x1b" not in err and "\x07" not in err, argv
        assert "evil\\x1b]0;PWNED\\x07\\x1b[2J.h5" in err, err


# ------------------------------------------------------------- a checkpoint of several optimizers
def test_the_cli_shows_each_member(tmp_path, capsys):
    kit = build()
    a = save(kit, tmp_path / "a")
    advance(kit, 4, 1)
    b = save(kit, tmp_path / "b")
    assert cli.main(["verify", a]) == 0
    assert capsys.readouterr().out.count("== optimizer") == 2
    assert cli.main(["inspect", "--json", a]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert list(shown["members"]) == ["muon", "adamw"]
    assert shown["members"]["adamw"]["optimizer"] == "AdamW"
    assert cli.main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "== optimizer 'muon'" in out and "differs" in out
    assert cli.main(["diff", a, a]) == 0
    [member] = [e["file"] for e in run.read_run(a)["members"] if e["name"] == "muon"]
    os.remove(os.path.join(a, member))
    assert cli.main(["verify", a]) == 1
    assert "NOT SOUND" in capsys.readouterr().out


# --------------------------------------------------------------------------- the environment
def test_a_bad_parallel_policy_does_not_stop_the_cli_or_checkpoint_reading(tmp_path):
    """An unknown FLATOPT_PARALLEL made ``import flatopt`` raise; the error now waits for a
    step (tests/test_threads.py), so inspect, verify and reading a checkpoint work."""
    opt = make_opt("Adam", seed=1)
    path = flatopt.save(tmp_path / "ck.h5", opt)
    env = {**os.environ, "FLATOPT_PARALLEL": "sometimes"}
    for command in (["inspect", path], ["verify", path], ["inspect", "--tensors", path]):
        out = subprocess.run([sys.executable, "-m", "flatopt", *command], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout, (command, out.stderr[-2000:])
    code = ("import sys, flatopt; data = flatopt.read(sys.argv[1], state=True); "
            "print(len(data.params), data.info['optimizer'])")
    out = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == [str(len(opt.index)), "Adam"], \
        out.stderr[-2000:]
