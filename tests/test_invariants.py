"""Checkpoints never replace a good file with a bad one, and state never lies: whatever save
writes load accepts (a property over random optimizers), what load refuses save refuses first,
threads are serialised, full disks fail cleanly, and hostile input (odd values, paths, labels,
files that lie) gets a typed error or the right behaviour."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import flatopt
from checkpoint_helpers import edit, make_opt, model_params, grouped, rehash, state_equal
from flatopt import cli
from flatopt.checkpoint import writer as writer_mod
from flatopt.checkpoint.format import MAX_JSON_DEPTH
from flatopt.checkpoint.writer import Snapshot
from optimizers import NAMES, fit_shape, random_settings, slow_beyond

PROPERTY_CASES = int(os.environ.get("FLATOPT_PROPERTY_CASES", "300"))
LABEL_CHARACTERS = "abc xyz_./-é€中\U0001f600\t\x1b\x07\"'\\"


# ----------------------------------------------------------------------------- property
def random_optimizer(rng: np.random.Generator):
    """A random registered optimizer: 1-4 groups with random settings and labels, both
    dtypes, 0-d, empty and high-dimensional parameters (up to NumPy's limit), random presence
    over a few steps; and the recipe to build it again from scratch."""
    name = NAMES[int(rng.integers(len(NAMES)))]
    groups = []
    counter = 0
    for number in range(int(rng.integers(1, 5))):
        params = {}
        for _ in range(int(rng.integers(0 if number else 1, 5))):
            kind = rng.random()
            if kind < 0.1:
                shape = ()
            elif kind < 0.2:
                shape = (int(rng.integers(0, 3)), 0)
            elif kind < 0.3:
                shape = (1,) * int(rng.integers(3, 65))  # up to NumPy's 64 dimensions
            else:
                shape = tuple(int(d) for d in rng.integers(1, 6, size=int(rng.integers(1, 4))))
            shape = fit_shape(name, shape)
            dtype = np.float32 if rng.random() < 0.6 else np.float64
            params[f"g{number}.p{counter}"] = rng.standard_normal(shape).astype(dtype)
            counter += 1
        group = {"params": params, **random_settings(name, rng)}
        if rng.random() < 0.6:
            length = int(rng.integers(0, 40))
            group["label"] = "".join(rng.choice(list(LABEL_CHARACTERS), size=length))
        if rng.random() < 0.3:
            group["initial_lr"] = float(rng.choice([0.0, 1e-3, 0.5]))
        groups.append(group)

    def build():
        return flatopt.registry.lookup(name)(
            [{**g, "params": {k: v.copy() for k, v in g["params"].items()}} for g in groups])

    opt = build()
    for step in range(int(rng.integers(0, 4))):
        grads = {path: rng.standard_normal(view.shape).astype(view.dtype)
                 for path, view in opt.params.items() if rng.random() < 0.7}
        opt.step(grads)
    return opt, build


ARRAY_DTYPES = ["?", "i1", "u2", ">i4", "<u8", "f2", ">f4", "f8"]


def random_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """0-3 extra arrays: any allowed dtype (either byte order), 0-d, empty, strided views,
    up to 60,000 elements, up to HDF5's 32 dimensions, names with any characters but NUL and
    '/'."""
    arrays = {}
    for number in range(int(rng.integers(0, 4))):
        shape = [(), (0,), (3, 0), (int(rng.integers(1, 60_000)),),
                 tuple(int(d) for d in rng.integers(1, 9, size=3)),
                 (1,) * int(rng.integers(4, 33))][int(rng.integers(6))]
        dtype = np.dtype(ARRAY_DTYPES[int(rng.integers(len(ARRAY_DTYPES)))])
        values = (rng.standard_normal(shape) * 100).astype(dtype)
        if values.ndim == 1 and values.size > 2:
            values = values[::2]  # a non-contiguous view
        name = f"{number}:" + "".join(rng.choice(list(LABEL_CHARACTERS.replace("/", "")),
                                                 size=int(rng.integers(0, 12))))
        arrays[name] = values
    return arrays


@pytest.mark.slow
def test_whatever_save_writes_load_accepts(tmp_path):
    rng = np.random.default_rng(8)
    path = tmp_path / "ck.h5"
    for case in range(PROPERTY_CASES):
        opt, build = random_optimizer(rng)
        size = int(rng.choice([0, 10, 5000, 200_000]))
        metadata = {"case": case, "blob": "x" * size, "nested": [1.5, None, {"k": True}]}
        arrays = random_arrays(rng)
        estimate = Snapshot(opt, metadata, None, arrays).estimate_bytes()
        flatopt.save(path, opt, metadata=metadata, arrays=arrays)
        assert path.stat().st_size <= estimate, f"case {case}: the space reservation is short"
        fresh = build()
        result = flatopt.load(path, fresh)
        assert state_equal(opt, fresh), f"case {case} ({opt.schema.name})"
        assert result.metadata == metadata
        assert sorted(result.arrays) == sorted(arrays)
        for name, array in arrays.items():
            assert result.arrays[name].dtype == array.dtype  # as given, byte order too
            np.testing.assert_array_equal(result.arrays[name], array)
        assert [dict(g) for g in fresh.param_groups] == [dict(g) for g in opt.param_groups]
        assert cli.verify_checkpoint(path)["ok"]


# ----------------------------------------------------------------------------- refused by save
@pytest.mark.parametrize("make, match", [
    (lambda: flatopt.SGD([{"params": {f"p{k}": np.zeros(1, np.float32)}}
                          for k in range(4100)]), "4100 param groups"),
    (lambda: flatopt.SGD({"w": np.zeros(1, np.float32)}), "metadata is 17,825,794 bytes"),
])
def test_save_refuses_what_load_would_refuse_before_touching_the_target(make, match, tmp_path):
    target = tmp_path / "ck.h5"
    target.write_bytes(b"previous checkpoint")
    metadata = "m" * (17 << 20)
    with pytest.raises(flatopt.CheckpointError, match=match):
        flatopt.save(target, make(), metadata=metadata)
    assert target.read_bytes() == b"previous checkpoint"
    assert os.listdir(tmp_path) == ["ck.h5"]


def nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value] if depth % 2 else {"k": value}
    return value


def on_a_deep_stack(function, frames: int):
    """``function()`` called ``frames`` Python frames deeper than here."""
    return function() if frames <= 0 else on_a_deep_stack(function, frames - 1)


@pytest.mark.parametrize("depth", [101, 991])
def test_metadata_nested_deeper_than_load_reads_is_refused_by_save(depth, tmp_path,
                                                                     monkeypatch):
    """The depth limit is one for save and load (json.loads recurses, so without
    a limit a deep text loads or not depending on the caller's stack)."""
    assert MAX_JSON_DEPTH == 100
    opt = make_opt("Adam")
    target = tmp_path / "ck.h5"
    flatopt.save(target, opt, metadata="previous")
    before = target.read_bytes()
    for background in (False, True):
        with pytest.raises(flatopt.CheckpointError, match="nested .*deep.*at most 100 levels"):
            flatopt.save(target, opt, metadata=nested(depth), background=background)
        assert target.read_bytes() == before and os.listdir(tmp_path) == ["ck.h5"]
    deepest = {"note": "a [string] { \\\" [", "deep": nested(MAX_JSON_DEPTH - 1)}
    flatopt.save(target, opt, metadata=deepest)
    limit = sys.getrecursionlimit()
    result = on_a_deep_stack(lambda: flatopt.load(target, make_opt("Adam", seed=2, steps=0)),
                             limit - 300)
    assert result.metadata == deepest
    # a file holding deeper metadata (written around save's check) is refused by load
    monkeypatch.setattr(writer_mod, "limits_problems", lambda *args: [])
    flatopt.save(target, opt, metadata=nested(MAX_JSON_DEPTH + 1))
    with pytest.raises(flatopt.CheckpointCorrupt, match="metadata is nested 101 deep"):
        on_a_deep_stack(lambda: flatopt.load(target, make_opt("Adam", seed=2, steps=0)),
                        limit - 300)


def test_save_refuses_state_that_load_would_call_a_lie(tmp_path):
    opt = flatopt.Adam({"w": np.zeros(3, np.float32)})
    opt.step({"w": np.array([1.0, np.nan, 2.0], np.float32)})  # a NaN reached the optimizer
    target = tmp_path / "ck.h5"
    flatopt.save(target, make_opt("Adam"))
    before = target.read_bytes()
    with pytest.raises(flatopt.CheckpointError, match="exp_avg_sq holds 1 negative, NaN"):
        flatopt.save(target, opt)
    assert target.read_bytes() == before


def test_group_values_set_mid_run_are_validated_before_save(tmp_path):
    opt = make_opt("Adam")
    for key, value in (("initial_lr", float("nan")), ("initial_lr", "abc"),
                       ("initial_lr", [1.0]), ("label", 5), ("lr", 2 ** 2000)):
        group = opt.param_groups[0]
        saved = group.get(key)
        group[key] = value
        with pytest.raises(flatopt.HyperparameterError, match=key):
            flatopt.save(tmp_path / "ck.h5", opt)
        with pytest.raises(flatopt.HyperparameterError, match=key):
            opt.step({})
        if saved is None:
            del group[key]
        else:
            group[key] = saved
    assert not (tmp_path / "ck.h5").exists()


def test_param_groups_cannot_be_removed_or_replaced(tmp_path):
    opt = make_opt("Adam", steps=1)
    before = opt.state_dict()
    popped = opt.param_groups.pop()
    with pytest.raises(flatopt.HyperparameterError, match="groups cannot be removed"):
        opt.step({path: np.ones_like(v) for path, v in opt.params.items()})
    with pytest.raises(flatopt.HyperparameterError, match="groups cannot be removed"):
        flatopt.save(tmp_path / "ck.h5", opt)
    opt.param_groups.append(popped)
    assert json.dumps(opt.state_dict(), default=repr) == json.dumps(before, default=repr)
    opt.param_groups.append({"params": ("x",), "lr": 0.1})
    with pytest.raises(flatopt.HyperparameterError, match="use add_param_group"):
        opt.step({})
    opt.param_groups.pop()
    opt.param_groups.reverse()
    with pytest.raises(flatopt.HyperparameterError, match="reordered"):
        opt.step({})


# ----------------------------------------------------------------------------- full disks
FULL_DISK_SCRIPT = r"""
import os, resource, signal, sys
import numpy as np
import flatopt
directory, limit, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
good = flatopt.SGD({"w": np.full(4, 7.0, np.float32)}, lr=0.1, momentum=0.9)
good.step({"w": np.ones(4, np.float32)})
path = os.path.join(directory, "ck.h5")
flatopt.save(path, good)
if scenario == "metadata":
    opt, metadata = good, {"blob": "x" * (2 << 20)}
elif scenario == "path":
    opt, metadata = flatopt.Adam({"p" * 20000: np.ones(1000, np.float32)}), None
elif scenario == "groups":
    opt, metadata = flatopt.SGD([{"params": {f"layer{k}.w": np.ones(3, np.float32)},
                                  "label": "g" * 200} for k in range(3000)]), None
else:
    opt, metadata = flatopt.AdamW({"a": np.ones((300, 300), np.float32),
                                   "b": np.ones(7, np.float64)}, amsgrad=True), {"k": "v" * 9000}
opt.step({p: np.ones_like(v) for p, v in opt.params.items()})
import tempfile
with tempfile.TemporaryDirectory() as elsewhere:  # compile the checks before the limit
    flatopt.save(os.path.join(elsewhere, "warm.h5"), opt)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    flatopt.save(path, opt, metadata=metadata)
    outcome = "saved"
except flatopt.CheckpointError as exc:
    assert "untouched" in str(exc) or "disk is full" in str(exc), exc
    outcome = "refused"
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
loaded = type(opt if outcome == "saved" else good)(
    {p: np.zeros_like(v) for p, v in (opt if outcome == "saved" else good).params.items()})
flatopt.load(path, loaded, hyperparameters="saved", regroup=True)
assert sorted(os.listdir(directory)) == ["ck.h5"], os.listdir(directory)
print(outcome)
"""


def run_full_disk(directory: Path, limit: int, scenario: str) -> str:
    done = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(directory), str(limit),
                           scenario], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (f"{scenario} at {limit} bytes: the process died or failed "
                                  f"(rc {done.returncode}): {done.stderr[-2000:]}")
    return done.stdout.strip()


@pytest.mark.parametrize("scenario, outcomes", slow_beyond([
    ("metadata", {"refused"}), ("path", {"saved", "refused"}), ("groups", {"refused"})]))
def test_a_full_disk_is_a_typed_error_and_keeps_the_old_checkpoint(scenario, outcomes,
                                                                  tmp_path):
    assert run_full_disk(tmp_path, 3 << 20, scenario) in outcomes


@pytest.mark.slow
def test_every_file_size_limit_ends_saved_or_refused_never_crashed(tmp_path):
    """Limits across the whole size of the file: a write that outgrew the space reserved
    would fail inside HDF5 (which then crashes on close); every case must end cleanly."""
    outcomes = {run_full_disk(tmp_path, limit, "model")
                for limit in np.linspace(20_000, 4_000_000, 12).astype(int)}
    assert outcomes == {"saved", "refused"}


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode:
        pytest.skip("cannot mount a tmpfs here (the file-size-limit tests cover the same path)")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.mark.parametrize("scenario, outcomes", slow_beyond([
    ("metadata", {"refused"}), ("path", {"saved", "refused"}), ("groups", {"refused"})]))
def test_a_full_small_tmpfs_is_a_typed_error(scenario, outcomes, small_tmpfs):
    assert run_full_disk(small_tmpfs, 1 << 40, scenario) in outcomes


# ----------------------------------------------------------------------------- threads
def test_saving_while_another_thread_steps_writes_sound_files(tmp_path):
    opt = flatopt.Adam({"w": np.zeros(300_000, np.float32), "b": np.zeros(10, np.float64)})
    grads = {"w": np.ones(300_000, np.float32), "b": np.ones(10)}
    stop = threading.Event()

    def train():
        while not stop.is_set():
            opt.step(grads)
    worker = threading.Thread(target=train)
    worker.start()
    try:
        for round_ in range(20):
            flatopt.save(tmp_path / "ck.h5", opt, metadata={"round": round_})
            assert cli.verify_checkpoint(tmp_path / "ck.h5")["ok"], round_
            loaded = flatopt.Adam({"w": np.zeros(300_000, np.float32),
                                   "b": np.zeros(10, np.float64)})
            flatopt.load(tmp_path / "ck.h5", loaded)
            steps = {loaded.state_of(p).step for p in ("w", "b")}
            assert len(steps) == 1, "a file mixed two steps"
    finally:
        stop.set()
        worker.join()


# ----------------------------------------------------------------------------- semantic lies
def adam_state_dict_with(**entry):
    opt = flatopt.Adam({"w": np.zeros(3, np.float32)})
    opt.step({"w": np.ones(3, np.float32)})
    sd = opt.state_dict()
    sd["state"]["w"].update(entry)
    return opt, sd


@pytest.mark.parametrize("entry, match", [
    (dict(exp_avg_sq=np.array([1.0, -1.0, 1.0], np.float32)), "negative, NaN"),
    (dict(exp_avg_sq=np.array([1.0, np.nan, 1.0], np.float32)), "negative, NaN"),
    (dict(step=0), r"step must be an integer in \[1, "),
    (dict(step=2 ** 63 - 1), r"step must be an integer"),
    (dict(step=2 ** 62), r"step must be an integer"),
    (dict(step=-5), r"step must be an integer"),
])
def test_state_dicts_that_lie_are_refused(entry, match):
    opt, sd = adam_state_dict_with(**entry)
    before = opt.state_dict()
    with pytest.raises(flatopt.StateDictError, match=match):
        opt.load_state_dict(sd)
    assert opt.state_of("w").step == before["state"]["w"]["step"]


def test_files_that_lie_are_refused(tmp_path):
    opt = make_opt("Adam", steps=2)
    flatopt.save(tmp_path / "ck.h5", opt)
    data = (tmp_path / "ck.h5").read_bytes()

    def negative_second_moment(f):
        ds = f["groups/1/float32/exp_avg_sq"]
        values = ds[...]
        values[0] = -1.0
        ds[...] = values
        rehash(ds)

    def state_for_a_stateless_parameter(f):
        steps = f["index/step"][...]
        row = int(np.flatnonzero(steps)[0])
        steps[row] = 0
        f["index/step"][...] = steps

    def huge_step(f):
        steps = f["index/step"][...]
        steps[0] = 2 ** 62
        f["index/step"][...] = steps
    for fn, match in ((negative_second_moment, "negative, NaN"),
                      (state_for_a_stateless_parameter, "has no state"),
                      (huge_step, "outside")):
        target = make_opt("Adam", seed=5, steps=1)
        with pytest.raises(flatopt.CheckpointCorrupt, match=match):
            flatopt.load(edit(data, fn), target)
        assert not cli.verify_checkpoint(io.BytesIO(edit(data, fn)))["ok"]


def test_load_state_dict_from_views_of_its_own_state_keeps_the_values():
    opt = flatopt.Adam({"w": np.zeros(3, np.float32)})
    for _ in range(3):
        opt.step({"w": np.array([1.0, 2.0, 3.0], np.float32)})
    expected = {k: np.array(v) for k, v in opt.state_of("w")._asdict().items()
                if v is not None}
    views = {k: v for k, v in opt.state_of("w")._asdict().items() if v is not None}
    sd = opt.state_dict()
    sd["state"]["w"] = views  # live views, not copies
    opt.load_state_dict(sd)
    for key, value in expected.items():
        np.testing.assert_array_equal(getattr(opt.state_of("w"), key), value)


def test_labels_are_validated_everywhere(tmp_path):
    opt = make_opt("SGD")
    sd = opt.state_dict()
    sd["param_groups"][0]["label"] = ["x"]
    with pytest.raises(flatopt.StateDictError, match="label must be a string"):
        opt.load_state_dict(sd)
    opt.param_groups[0]["label"] = 5
    with pytest.raises(flatopt.HyperparameterError, match="label must be a string"):
        flatopt.save(tmp_path / "ck.h5", opt)


def test_a_damaged_buffer_no_live_parameter_needs_still_fails_the_load(tmp_path):
    params = model_params(0)
    opt = flatopt.Adam(grouped(params), lr=0.01)
    flatopt.save(tmp_path / "ck.h5", opt)

    def flip(f):  # damage the float64 buffer of group 0, whose parameters the live one lacks
        ds = f["groups/0/float64/params"]
        values = ds[...]
        values[0] += 1.0
        ds[...] = values
    damaged = edit((tmp_path / "ck.h5").read_bytes(), flip, seal=False)
    float32_only = {k: v for k, v in params.items() if v.dtype == np.float32}
    live = flatopt.Adam(grouped(float32_only, allow_unused_rules=True), lr=0.01)
    with pytest.raises(flatopt.CheckpointCorrupt, match="checksum mismatch"):
        flatopt.load(damaged, live, strict=False)


# ----------------------------------------------------------------------------- typed errors
def test_huge_values_bad_paths_and_contents_given_as_paths_raise_typed_errors(tmp_path):
    with pytest.raises(flatopt.HyperparameterError, match="too large"):
        flatopt.SGD({"w": np.zeros(1)}, lr=2 ** 2000)
    opt = make_opt("SGD")
    os.chdir(tmp_path)
    flatopt.save(Path("c.h5"), opt)
    for bad in (5, None, "bad\x00name.h5", "\ud800.h5"):
        with pytest.raises(flatopt.CheckpointError):
            flatopt.save(bad, opt)
    with pytest.raises(flatopt.ParamError, match="NUL"):
        flatopt.SGD({"a\x00": np.zeros(1)})
    with pytest.raises(flatopt.ParamError, match="surrogate"):
        flatopt.SGD({"a\ud800": np.zeros(1)})
    for lookup in (lambda: opt.params[5], lambda: opt.grads[5], lambda: opt.state_of(5),
                   lambda: opt.params["nope"], lambda: opt.state_of("nope")):
        with pytest.raises(flatopt.UnknownPathError, match="no parameter"):
            lookup()
    assert opt.params.get(5) is None and 5 not in opt.grads  # they still behave as mappings
    with pytest.raises(flatopt.GradientError, match="list of paths"):
        opt.grads.mark_present(5)


def test_a_bytes_path_is_refused_by_save_and_named_by_load(tmp_path):
    """Load reads bytes as a checkpoint's contents, so save refuses a bytes path
    (before touching anything, in the background too) and load says what bytes are."""
    opt = make_opt("SGD")
    target = os.fsencode(tmp_path / "ck.h5")
    for path in (target, bytearray(target), memoryview(target)):
        for background in (False, True):
            with pytest.raises(flatopt.CheckpointError, match="bytes path .* str"):
                flatopt.save(path, opt, background=background)
    assert os.listdir(tmp_path) == []
    flatopt.save(os.fsdecode(target), opt)
    with pytest.raises(flatopt.CheckpointCorrupt, match="not an HDF5 file.*pass its path"):
        flatopt.load(target, make_opt("SGD", seed=3, steps=0))


def test_betas_as_mappings_or_sets_and_other_odd_inputs_are_refused(tmp_path):
    with pytest.raises(flatopt.HyperparameterError, match="betas"):
        flatopt.Adam({"w": np.zeros(1)}, betas={"a": 0.9, "b": 0.99})
    with pytest.raises(flatopt.HyperparameterError, match="betas"):
        flatopt.Adam({"w": np.zeros(1)}, betas={0.9, 0.99})
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "ck.h5", opt)
    with open(tmp_path / "ck.h5", "r") as text_mode:
        with pytest.raises(flatopt.CheckpointError, match="text mode") as info:
            flatopt.load(text_mode, make_opt("Adam", seed=2, steps=0))
        assert not isinstance(info.value, flatopt.CheckpointCorrupt)
    data = (tmp_path / "ck.h5").read_bytes()
    extra_attrs = {
        "buffer dataset": lambda f: f["groups/1/float32/params"].attrs.__setitem__("x", 1),
        "index group": lambda f: f["index"].attrs.__setitem__("x", 1),
        "index column": lambda f: f["index/path"].attrs.__setitem__("x", 1),
    }
    for what, fn in extra_attrs.items():
        with pytest.raises(flatopt.CheckpointCorrupt, match="unexpected attributes"):
            flatopt.load(edit(data, fn), make_opt("Adam", seed=2, steps=0))
    sd = opt.state_dict()
    for version in (True, -7, 0, 2, 1.0):
        with pytest.raises(flatopt.StateDictError, match="version"):
            opt.load_state_dict({**sd, "version": version})
    masked = np.ma.masked_array(np.ones(3), mask=[0, 1, 0])
    sgd = flatopt.SGD({"w": np.zeros(3)}, lr=1.0)
    with pytest.raises(flatopt.GradientError, match="masked array"):
        sgd.step({"w": masked})
    with pytest.raises(flatopt.GradientError, match="masked array"):
        sgd.grads["w"] = masked


def test_a_gradient_given_as_a_view_of_another_gradient_is_read_before_writing():
    opt = flatopt.SGD({"a": np.zeros(3), "b": np.zeros(3)}, lr=1.0)
    opt.grads["b"] = np.full(3, 1.0)
    opt.step({"b": np.full(3, 5.0), "a": opt.grads["b"]})  # "a" gets the old b gradient
    np.testing.assert_array_equal(opt.params["a"], -1.0)
    np.testing.assert_array_equal(opt.params["b"], -5.0)
