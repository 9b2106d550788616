"""Checkpoint extras: extra arrays (save(arrays=) -> LoadResult.arrays), flatopt.read without an
optimizer, version-1 files (written by flatopt 0.1.0) still read, ranges and fragment tables
(the `flatopt` command over extra arrays: tests/test_cli.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import flatopt
from flatopt import cli
from flatopt.checkpoint import writer as writer_mod
from checkpoint_helpers import data_extent, make_opt, same_snapshot, snapshot, state_equal
from optimizers import INFO

DATA = Path(__file__).with_name("data")


def extra_arrays() -> dict:
    rng = np.random.default_rng(5)
    wide = rng.standard_normal((4, 6))
    return {
        "float16": rng.standard_normal(7).astype(np.float16),
        "float32 matrix": rng.standard_normal((5, 3)).astype(np.float32),
        "float64 big-endian": rng.standard_normal(9).astype(">f8"),
        "bool": np.array([True, False, True]),
        "int8": np.array([-128, 0, 127], np.int8),
        "uint16": np.array([0, 65535], np.uint16),
        "int32 big-endian": np.arange(-3, 3, dtype=">i4"),
        "int64": np.array([-(2 ** 63), 2 ** 63 - 1], np.int64),
        "uint64": np.array([2 ** 64 - 1], np.uint64),
        "0-d": np.array(2.5),
        "empty": np.zeros((3, 0), np.float32),
        "non-contiguous": wide[:, ::2],
        "fortran": np.asfortranarray(rng.standard_normal((3, 4))),
        "ünïcødé 名前 ✓": np.arange(4, dtype=np.uint8),
        "running_mean\n\t": rng.standard_normal(2).astype(np.float32),
        "32 dimensions": np.arange(2, dtype=np.int16).reshape((1,) * 31 + (2,)),  # HDF5's most
    }


def check_arrays(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        value = np.asarray(value)
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        assert np.array_equal(got[name], value), name
        assert got[name].flags.c_contiguous and got[name].flags.writeable, name
        assert not np.shares_memory(got[name], value), name


@pytest.mark.parametrize("background", [False, True])
def test_extra_arrays_round_trip(tmp_path, background):
    opt = make_opt("Adam")
    arrays = extra_arrays()
    arrays["a list"] = [1.5, 2.5]   # converted with np.asarray, as documented
    result = flatopt.save(tmp_path / "ck.h5", opt, arrays=arrays, background=background)
    if background:
        result.wait()
    other = make_opt("Adam", seed=99, steps=0)
    loaded = flatopt.load(tmp_path / "ck.h5", other)
    assert state_equal(opt, other)
    check_arrays(loaded.arrays, {**arrays, "a list": np.array([1.5, 2.5])})
    check_arrays(flatopt.read(tmp_path / "ck.h5").arrays,
                 {**arrays, "a list": np.array([1.5, 2.5])})


def test_a_background_save_snapshots_the_arrays_too(tmp_path):
    opt = make_opt("Adam")
    ema = np.arange(1 << 16, dtype=np.float32)
    handle = flatopt.save(tmp_path / "ck.h5", opt, arrays={"ema": ema}, background=True)
    ema[...] = -1  # changed right after save() returned: the file holds the values at the call
    handle.wait()
    assert np.array_equal(flatopt.read(tmp_path / "ck.h5").arrays["ema"],
                          np.arange(1 << 16, dtype=np.float32))


REFUSED = [
    ({"complex": np.zeros(2, np.complex64)}, "complex"),
    ({"object": np.array([1, "a"], dtype=object)}, "object"),
    ({"string": np.array(["ab"])}, "string"),
    ({"structured": np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")])}, "structured"),
    ({"datetime": np.array(["2026-01-01"], dtype="datetime64[D]")}, "datetime"),
    ({"float128": np.zeros(2, np.longdouble)}, "float"),
    ({"": np.zeros(2)}, "empty"),
    ({"ema/enc.weight": np.zeros(2)}, "'/'"),
    ({"a\x00b": np.zeros(2)}, "NUL"),
    ({"a\udc80": np.zeros(2)}, "surrogate"),
    ({3: np.zeros(2)}, "names are strings"),
    ({"x" * (70 << 10): np.zeros(2)}, "name of"),
    ({"set": {1, 2}}, "not a NumPy array"),
    ({f"a{k}": np.zeros(1) for k in range(4097)}, "at most 4096"),
    ({"deep": np.zeros((1,) * 33)}, "'deep' has 33 dimensions"),  # HDF5's limit
]


@pytest.mark.parametrize("arrays, match", REFUSED, ids=[m for _, m in REFUSED])
@pytest.mark.parametrize("background", [False, True])
def test_refused_arrays_raise_before_the_target_is_touched(tmp_path, arrays, match, background):
    first = next(iter(arrays.values()))
    if isinstance(first, np.ndarray) and first.dtype == np.longdouble == np.float64:
        pytest.skip("long double is float64 here")
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "ck.h5", opt, metadata="previous")
    before = (tmp_path / "ck.h5").read_bytes()
    with pytest.raises(flatopt.CheckpointError, match=match) as info:
        flatopt.save(tmp_path / "ck.h5", opt, arrays=arrays, background=background)
    assert "nothing was written" in str(info.value) or "must be a dict" in str(info.value)
    assert (tmp_path / "ck.h5").read_bytes() == before
    assert os.listdir(tmp_path) == ["ck.h5"]


def test_arrays_must_be_a_dict(tmp_path):
    with pytest.raises(flatopt.CheckpointError, match="arrays must be a dict"):
        flatopt.save(tmp_path / "ck.h5", make_opt("SGD"), arrays=[np.zeros(2)])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("arrays, match", [
    ({"complex": np.zeros(2, np.complex64)}, "not a bool, integer or float dtype"),
    ({"": np.zeros(2)}, "empty"),
    ({"a//b": np.zeros(2)}, "empty"),
    ({"x" * (70 << 10): np.zeros(2)}, "name too long"),
])
def test_what_save_refuses_load_refuses(tmp_path, monkeypatch, arrays, match):
    """Save's checks are load's: written without them, the same arrays make the file
    refused as damaged (so a file save accepts is one load accepts, and no more)."""
    monkeypatch.setattr(writer_mod, "checked_arrays", lambda arrays, own: dict(arrays))
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "ck.h5", opt, arrays=arrays)
    other = make_opt("Adam", seed=99, steps=0)
    before = snapshot(other)
    with pytest.raises(flatopt.CheckpointCorrupt, match=match) as info:
        flatopt.load(tmp_path / "ck.h5", other)
    assert info.value.buffer == "/arrays/0"
    assert same_snapshot(before, snapshot(other))
    with pytest.raises(flatopt.CheckpointCorrupt, match=match):
        flatopt.read(tmp_path / "ck.h5")


def test_a_damaged_array_fails_the_load_and_leaves_the_optimizer_untouched(tmp_path):
    opt = make_opt("Adam")
    arrays = {"small": np.arange(5.0), "ema": np.arange(3 << 20, dtype=np.float32)}
    flatopt.save(tmp_path / "ck.h5", opt, arrays=arrays)
    data = (tmp_path / "ck.h5").read_bytes()
    start, size = data_extent(data, "/arrays/1")
    assert size == arrays["ema"].nbytes
    for position in (start, start + size // 2, start + size - 1):
        damaged = bytearray(data)
        damaged[position] ^= 0x01
        (tmp_path / "bad.h5").write_bytes(bytes(damaged))
        other = make_opt("Adam", seed=99, steps=2)
        before = snapshot(other)
        with pytest.raises(flatopt.CheckpointCorrupt, match="checksum mismatch") as info:
            flatopt.load(tmp_path / "bad.h5", other)
        assert info.value.buffer == "/arrays/1" and "bad.h5" in str(info.value)
        assert same_snapshot(before, snapshot(other))
        with pytest.raises(flatopt.CheckpointCorrupt, match="checksum mismatch"):
            flatopt.read(tmp_path / "bad.h5")
        flatopt.read(tmp_path / "bad.h5", arrays=False)  # the arrays were not asked for
        report = flatopt.checkpoint.verify_checkpoint(tmp_path / "bad.h5")
        assert not report["ok"]
        assert [e["ok"] for e in report["buffers"] if "array" in e] == [True, False]
        assert cli.main(["verify", str(tmp_path / "bad.h5")]) == 1


# --------------------------------------------------------------------------- read
class _Scheduler:
    def state_dict(self):
        return {"last_epoch": 4, "base_lrs": [0.02, 0.01]}


@pytest.mark.parametrize("kind", ["Adam", "SGD"])
def test_read_returns_the_checkpoint_without_an_optimizer(tmp_path, kind):
    opt = make_opt(kind, **INFO[kind].every_slot)
    flatopt.save(tmp_path / "ck.h5", opt, metadata={"epoch": 3}, scheduler=_Scheduler(),
                 arrays={"ema": np.ones(3)})
    for source in (tmp_path / "ck.h5", (tmp_path / "ck.h5").read_bytes()):
        data = flatopt.read(source, state=True)
        assert isinstance(data, flatopt.CheckpointData)
        assert data.optimizer == kind and data.metadata == {"epoch": 3}
        assert data.scheduler_state == _Scheduler().state_dict()
        assert list(data.arrays) == ["ema"] and data.info["format_version"] == 2
        assert list(data.params) == list(opt.params)
        for path, value in opt.params.items():
            assert data.params[path].dtype == value.dtype
            assert data.params[path].shape == value.shape
            assert data.params[path].tobytes() == value.tobytes()
        live = opt.state_dict()
        assert sorted(data.state) == sorted(live["state"])
        for path, entry in live["state"].items():
            assert sorted(data.state[path]) == sorted(entry)
            for key, value in entry.items():
                got = data.state[path][key]
                assert (got.tobytes() == value.tobytes() if isinstance(value, np.ndarray)
                        else got == value), (path, key)
        assert [g["label"] for g in data.groups] == [g["label"] for g in opt.param_groups]
        assert [g["paths"] for g in data.groups] == [g["params"] for g in live["param_groups"]]
        for saved, group in zip(data.groups, opt.param_groups):
            for key, value in saved["hyperparameters"].items():
                assert group[key] == value, key
    assert flatopt.read(tmp_path / "ck.h5").state is None


def test_read_verifies_what_it_returns_and_only_reads_what_is_asked(tmp_path):
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "ck.h5", opt)
    data = (tmp_path / "ck.h5").read_bytes()
    for name, needs_state in (("/groups/1/float32/exp_avg", True),
                              ("/groups/1/float32/params", False)):
        start, size = data_extent(data, name)
        damaged = bytearray(data)
        damaged[start + size // 2] ^= 0x40
        with pytest.raises(flatopt.CheckpointCorrupt, match="checksum mismatch") as info:
            flatopt.read(bytes(damaged), state=True)
        assert info.value.buffer == name
        if needs_state:  # a state buffer nobody asked for is not read
            assert flatopt.read(bytes(damaged)).params.keys() == opt.params.keys()
        else:
            with pytest.raises(flatopt.CheckpointCorrupt):
                flatopt.read(bytes(damaged))


def test_read_applies_the_state_value_checks(tmp_path, monkeypatch):
    opt = make_opt("Adam")
    opt.buffers[1].state["exp_avg_sq"][0] = -1.0  # no honest save writes this
    monkeypatch.setattr(writer_mod.Snapshot, "value_problems", lambda self: [])
    flatopt.save(tmp_path / "ck.h5", opt)
    with pytest.raises(flatopt.CheckpointCorrupt, match="exp_avg_sq"):
        flatopt.read(tmp_path / "ck.h5", state=True)
    flatopt.read(tmp_path / "ck.h5")  # parameters alone are sound


def test_read_refuses_what_load_refuses(tmp_path):
    (tmp_path / "x.h5").write_bytes(b"not a checkpoint at all")
    with pytest.raises(flatopt.CheckpointCorrupt, match="x.h5"):
        flatopt.read(tmp_path / "x.h5")
    with pytest.raises(flatopt.CheckpointError, match="does not exist"):
        flatopt.read(tmp_path / "missing.h5")


# --------------------------------------------------------------------------- version 1
@pytest.mark.parametrize("kind, name, hyper", [("Adam", "v1-adam.h5", {"amsgrad": True}),
                                               ("SGD", "v1-sgd.h5", {})])
def test_version_1_fixture_files_still_load(kind, name, hyper, tmp_path):
    """Files written by flatopt 0.1.0 (fletcher32 chunks, CRC-32) load, read and verify."""
    path = DATA / name
    other = make_opt(kind, seed=99, steps=0, **hyper)
    result = flatopt.load(path, other)
    # the run that wrote the file, recomputed: the same values (not bits: the rule bodies
    # have rounded as torch's kernels since, with fused multiply-adds)
    again = make_opt(kind, **hyper)
    for p in other.params:
        np.testing.assert_allclose(other.params[p], again.params[p], rtol=1e-6, atol=1e-7)
        assert getattr(other.state_of(p), "step", 0) == getattr(again.state_of(p), "step", 0)
    assert result.info["format_version"] == 1 and result.arrays == {}
    assert result.metadata == {"epoch": 3, "note": "written by flatopt 0.1.0, format version 1"}
    data = flatopt.read(path, state=True)
    assert all(data.params[p].tobytes() == other.params[p].tobytes() for p in other.params)
    assert all(data.state[p][name].tobytes() == value.tobytes()
               for p in other.params for name, value in other.state_of(p)._asdict().items()
               if isinstance(value, np.ndarray))
    assert flatopt.checkpoint.verify_checkpoint(path)["ok"]
    # a flipped byte in a version-1 buffer is still caught (fletcher32 / CRC-32)
    raw = path.read_bytes()
    start, size = data_extent(raw, "/groups/1/float32/params")
    damaged = bytearray(raw)
    damaged[start + 4] ^= 0x08
    before = snapshot(other)
    with pytest.raises(flatopt.CheckpointCorrupt, match="fletcher32|CRC") as info:
        flatopt.load(bytes(damaged), other)
    assert info.value.buffer == "/groups/1/float32/params"
    assert same_snapshot(before, snapshot(other))
    # and a new save of it is version 2
    flatopt.save(tmp_path / "again.h5", other)
    assert flatopt.read(tmp_path / "again.h5").info["format_version"] == 2


# --------------------------------------------------------------------- ranges and fragment tables
def test_read_range_equals_the_whole_read_around_block_edges(tmp_path):
    """Contents.read_range reads the blocks wholly inside a range straight into place and
    the cut ones through a block buffer: every range around the block edges of a 3-block
    buffer gives the bytes a whole read gives (float32 and float64)."""
    from flatopt.checkpoint import open_checkpoint
    from flatopt.checkpoint.format import BLOCK_BYTES
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float64):
        item = np.dtype(dtype).itemsize
        n = 3 * BLOCK_BYTES // item - 77
        opt = flatopt.SGD({"w": rng.standard_normal(n).astype(dtype)}, lr=0.1)
        path = flatopt.save(tmp_path / f"{np.dtype(dtype).name}.h5", opt)
        per_block = BLOCK_BYTES // item
        edges = [0, 1, per_block - 1, per_block, per_block + 1, 2 * per_block - 3,
                 2 * per_block, 2 * per_block + 5, n - 1, n]
        with open_checkpoint(path) as ck:
            key = next(iter(ck.buffers))
            whole = ck.read(key, "params")
            for start in edges:
                for stop in edges:
                    if stop >= start:
                        got = ck.read_range(key, "params", start, stop)
                        assert np.array_equal(got, whole[start:stop]), (dtype, start, stop)


def test_fragment_tables_tile_their_slot_with_one_fragment_per_rank():
    """The one check of a sharded checkpoint's fragment table (made by the save before it
    commits and by every reader)."""
    from flatopt.checkpoint.manifest import fragment_problems
    digest = "xxh3:" + "0" * 16
    assert fragment_problems([[0, 0, 16, digest], [1, 16, 32, digest]], 32, 2) == []
    assert fragment_problems([], 0, 2) == []
    bad = {"a rank twice": ([[0, 0, 16, digest], [0, 16, 32, digest]], 32, 2),
           "a gap": ([[0, 0, 16, digest], [1, 17, 32, digest]], 32, 2),
           "a rank out of range": ([[0, 0, 16, digest], [2, 16, 32, digest]], 32, 2),
           "too short": ([[0, 0, 16, digest]], 32, 2),
           "an empty fragment": ([[0, 0, 0, digest], [1, 0, 32, digest]], 32, 2),
           "a bad digest": ([[0, 0, 32, "crc32:0"]], 32, 1)}
    for what, arguments in bad.items():
        assert fragment_problems(*arguments), what
