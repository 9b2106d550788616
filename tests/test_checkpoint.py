"""Checkpoints: round trips, the mismatch report, opt-in relaxations, integrity, hostile files,
crash-safe saving and edge cases (the `flatopt` command: tests/test_cli.py)."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flatopt
from flatopt import cli
from flatopt.checkpoint import manifest
from flatopt.checkpoint import writer as writer_mod
from flatopt.checkpoint.h5write import set_text
from flatopt.checkpoint.writer import Snapshot
from flatopt.schema import MAX_STEP
from checkpoint_helpers import (add_buffer, check_round_trip, data_extent, edit, grouped,
                                make_opt, model_params, same_snapshot, snapshot, state_equal,
                                step_with_grads)
from optimizers import INFO, cases


def fresh_like(kind="Adam", seed=99, **hyper):
    """An optimizer with the same structure as make_opt(kind) but other values and no state."""
    opt = make_opt(kind, seed=seed, steps=0, **hyper)
    return opt


def stepped_other(kind="Adam", **hyper):
    """Same structure, different values and state (so a no-op load is visible)."""
    return make_opt(kind, seed=7, steps=2, **hyper)


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("kind", cases("test_round_trip_is_exact",
                                       slow_beyond_representatives=4))
def test_round_trip_is_exact(kind, tmp_path):
    check_round_trip(kind, tmp_path, **INFO[kind].every_slot)


def test_state_follows_path_when_construction_order_differs(tmp_path):
    opt = make_opt("Adam", steps=4)
    flatopt.save(tmp_path / "ck.h5", opt)
    params = model_params(3)
    reordered = dict(reversed(list(params.items())))  # ids now differ from the saved ones
    other = make_opt("Adam", steps=0, params=reordered)
    result = flatopt.load(tmp_path / "ck.h5", other)
    for path in opt.params:
        assert np.array_equal(opt.params[path], other.params[path])
        a, b = opt.state_of(path), other.state_of(path)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.step == b.step and np.array_equal(a.exp_avg, b.exp_avg)
    # mix.weight and dec.weight have the same shape: loaded by path, never swapped
    assert not np.array_equal(other.params["mix.weight"], opt.params["dec.weight"])
    assert {d.kind for d in result.differences} == {"id"}  # the cross-check is reported


def test_save_load_save_is_identical(tmp_path):
    opt = make_opt("AdamW", steps=3, amsgrad=True)
    flatopt.save(tmp_path / "a.h5", opt, metadata={"k": [1, 2.5, "x", None]})
    other = fresh_like("AdamW", amsgrad=True)
    result = flatopt.load(tmp_path / "a.h5", other)
    flatopt.save(tmp_path / "b.h5", other, metadata=result.metadata)
    digests = []
    for name in ("a.h5", "b.h5"):
        with h5py.File(tmp_path / name, "r") as f:
            digests.append(f.attrs["digest"])
    assert digests[0] == digests[1]  # covers index, hyperparameters and every buffer CRC
    assert cli.diff_checkpoints(tmp_path / "a.h5", tmp_path / "b.h5")["identical"]


def test_metadata_and_scheduler_round_trip(tmp_path):
    class Scheduler:
        def __init__(self):
            self.state = {"last_epoch": 0, "base_lrs": [0.0]}

        def state_dict(self):
            return dict(self.state)

        def load_state_dict(self, state):
            self.state = dict(state)

    sched = Scheduler()
    sched.state = {"last_epoch": 12, "base_lrs": [0.01, 0.02]}
    meta = {"epoch": 3, "nested": {"a": [1, 2, {"b": True}]}, "np": np.float32(0.5),
            "unicode": "Ünïcødé"}
    opt = make_opt("SGD")
    flatopt.save(tmp_path / "ck.h5", opt, scheduler=sched, metadata=meta)
    other, target = fresh_like("SGD"), Scheduler()
    result = flatopt.load(tmp_path / "ck.h5", other, scheduler=target)
    assert target.state == sched.state
    assert result.scheduler_state == sched.state
    assert result.metadata == {**meta, "np": 0.5}


def test_non_json_metadata_is_refused_before_writing(tmp_path):
    opt = make_opt("Adam")
    with pytest.raises(flatopt.CheckpointError, match="JSON"):
        flatopt.save(tmp_path / "ck.h5", opt, metadata={"array": np.zeros(3)})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("metadata", [{1: "a"}, {"a": [{2.5: 1}]}, [{None: 1}], {True: 0},
                                      ({"epoch": 3}, {-1: 1})])
def test_metadata_with_keys_json_would_change_is_refused(metadata, tmp_path):
    """JSON turns the key 1 into "1", so the metadata would not come back as
    saved: save refuses non-string keys, naming one, before touching anything."""
    opt = make_opt("Adam")
    with pytest.raises(flatopt.CheckpointError, match="not strings"):
        flatopt.save(tmp_path / "ck.h5", opt, metadata=metadata)
    assert os.listdir(tmp_path) == []

    class Scheduler:
        def state_dict(self):
            return {"milestones": {5: 1}}

    with pytest.raises(flatopt.CheckpointError, match="scheduler.*not strings"):
        flatopt.save(tmp_path / "ck.h5", opt, scheduler=Scheduler())
    assert os.listdir(tmp_path) == []


def test_boolean_options_must_be_booleans(tmp_path):
    """strict="yes" or regroup=1 would be taken as True (a partial load
    nobody asked for); every boolean option of save, load, read and inspect is True or False,
    checked before any file is touched."""
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "ck.h5", opt)
    target = stepped_other()
    before = snapshot(target)
    for bad in ("yes", "false", 1, 0, None, np.float64(1.0)):
        for call in (lambda: flatopt.load(tmp_path / "ck.h5", target, strict=bad),
                     lambda: flatopt.load(tmp_path / "ck.h5", target, regroup=bad),
                     lambda: flatopt.save(tmp_path / "new.h5", opt, background=bad),
                     lambda: flatopt.read(tmp_path / "ck.h5", state=bad),
                     lambda: flatopt.read(tmp_path / "ck.h5", arrays=bad),
                     lambda: flatopt.checkpoint.inspect_checkpoint(tmp_path / "ck.h5",
                                                                   tensors=bad)):
            with pytest.raises(flatopt.CheckpointOptionError, match="must be True or False"):
                call()
    assert same_snapshot(before, snapshot(target)) and os.listdir(tmp_path) == ["ck.h5"]
    flatopt.load(tmp_path / "ck.h5", target, strict=np.bool_(False), regroup=False)
    assert state_equal(opt, target)


def test_load_from_bytes_and_file_objects(tmp_path):
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "ck.h5", opt)
    data = (tmp_path / "ck.h5").read_bytes()
    for source in (data, io.BytesIO(data), open(tmp_path / "ck.h5", "rb")):
        other = fresh_like()
        flatopt.load(source, other)
        assert state_equal(opt, other)


# --------------------------------------------------------------------------- mismatches
def test_every_difference_is_reported_at_once(tmp_path):
    opt = make_opt("Adam", steps=2)
    flatopt.save(tmp_path / "ck.h5", opt)
    params = model_params(1)
    del params["enc.bias"]                                           # missing in live
    params["new.weight"] = np.zeros(2, np.float32)                   # unexpected... in live
    params["dec.weight"] = np.zeros((3, 4), np.float32)              # shape change
    params["dec.bias"] = params["dec.bias"].astype(np.float32)       # dtype change
    rules = [{"match": ["*.bias", "norm.*", "empty", "mix.*"], "weight_decay": 0.0,
              "lr": 0.02, "label": "no_decay"}]                      # mix.weight moves group
    live = flatopt.Adam(grouped(params, rules), lr=0.03, amsgrad=True)
    before = snapshot(live)
    with pytest.raises(flatopt.CheckpointMismatch) as info:
        flatopt.load(tmp_path / "ck.h5", live)
    exc = info.value
    assert same_snapshot(before, snapshot(live))
    kinds = {(d.kind, d.where.split(" ")[-1] if d.kind in ("hyperparameter", "flag")
              else d.where) for d in exc.differences}
    assert ("missing", "new.weight") in kinds
    assert ("unexpected", "enc.bias") in kinds
    assert ("shape", "dec.weight") in kinds
    assert ("dtype", "dec.bias") in kinds
    assert ("group", "mix.weight") in kinds
    assert ("hyperparameter", "lr") in kinds
    assert ("flag", "amsgrad") in kinds
    message = str(exc)
    assert "saved (3, 3), live (3, 4)" in message
    assert "saved 'float64', live 'float32'" in message
    assert "lr: saved 0.01, live 0.03" in message
    assert "amsgrad: saved False, live True" in message
    assert "strict=False" in message and "regroup=True" in message
    assert "ck.h5" in message
    report = exc.report()
    json.dumps(report)  # the structured report is plain data
    assert {"kind", "where", "saved", "live", "relaxed_by"} <= set(report[0])


def test_wrong_optimizer_kind_is_not_relaxable(tmp_path):
    flatopt.save(tmp_path / "ck.h5", make_opt("SGD"))
    live = make_opt("Adam", steps=1)
    before = snapshot(live)
    for options in ({}, {"strict": False, "hyperparameters": "live", "regroup": True}):
        with pytest.raises(flatopt.CheckpointMismatch, match="optimizer .*saved 'SGD', live "
                                                             "'Adam'"):
            flatopt.load(tmp_path / "ck.h5", live, **options)
    assert same_snapshot(before, snapshot(live))


def test_newer_format_version_is_refused_naming_both(tmp_path):
    flatopt.save(tmp_path / "ck.h5", make_opt())
    data = edit((tmp_path / "ck.h5").read_bytes(),
                lambda f: f.attrs.__setitem__("format_version", 7))
    live = fresh_like()
    with pytest.raises(flatopt.CheckpointMismatch, match=r"format version 7.*up to 5"):
        flatopt.load(data, live)


def test_partial_loading(tmp_path):
    opt = make_opt("Adam", steps=3)
    flatopt.save(tmp_path / "ck.h5", opt)
    params = model_params(5)
    del params["enc.bias"]
    params["extra.weight"] = np.ones((2, 2), np.float32)
    live = make_opt("Adam", steps=1, params=params)
    before_extra = live.params["extra.weight"].copy()
    with pytest.raises(flatopt.CheckpointMismatch, match="missing"):
        flatopt.load(tmp_path / "ck.h5", live)
    result = flatopt.load(tmp_path / "ck.h5", live, strict=False)
    assert result.fresh == ["extra.weight"] and result.unused == ["enc.bias"]
    assert live.state_of("extra.weight") is None                     # fresh state
    assert np.array_equal(live.params["extra.weight"], before_extra)  # value kept
    for path in result.loaded:
        assert np.array_equal(live.params[path], opt.params[path])
    assert {d.kind for d in result.differences} >= {"missing", "unexpected"}


def test_partial_does_not_accept_shape_changes(tmp_path):
    flatopt.save(tmp_path / "ck.h5", make_opt("Adam"))
    params = model_params(5)
    params["enc.weight"] = np.zeros((5, 3), np.float32)
    live = make_opt("Adam", steps=1, params=params)
    before = snapshot(live)
    with pytest.raises(flatopt.CheckpointMismatch, match="shape") as info:
        flatopt.load(tmp_path / "ck.h5", live, strict=False, hyperparameters="live",
                     regroup=True)
    assert [d.kind for d in info.value.differences if d.kind != "id"] == ["shape"]
    assert same_snapshot(before, snapshot(live))


def renamed_params(seed):
    params = model_params(seed)
    return {("encoder." + p[4:] if p.startswith("enc.") else p): v for p, v in params.items()}


def test_rename_map_and_function(tmp_path):
    opt = make_opt("AdamW", steps=3)
    flatopt.save(tmp_path / "ck.h5", opt)
    live = make_opt("AdamW", steps=0, params=renamed_params(4))
    with pytest.raises(flatopt.CheckpointMismatch) as info:
        flatopt.load(tmp_path / "ck.h5", live)
    assert {d.kind for d in info.value.differences} == {"missing", "unexpected"}
    flatopt.load(tmp_path / "ck.h5", live,
                 rename={"enc.weight": "encoder.weight", "enc.bias": "encoder.bias"})
    assert np.array_equal(live.params["encoder.weight"], opt.params["enc.weight"])
    assert live.state_of("encoder.bias").step == opt.state_of("enc.bias").step
    live2 = make_opt("AdamW", steps=0, params=renamed_params(4))
    flatopt.load(tmp_path / "ck.h5", live2, rename=lambda p: re.sub(r"^enc\.", "encoder.", p))
    assert state_equal(live, live2)


def test_rename_problems_are_reported(tmp_path):
    flatopt.save(tmp_path / "ck.h5", make_opt("Adam"))
    live = fresh_like()
    before = snapshot(live)
    with pytest.raises(flatopt.CheckpointMismatch) as info:
        flatopt.load(tmp_path / "ck.h5", live,
                     rename={"mix.weight": "dec.weight", "nope": "x"})
    notes = [d.note for d in info.value.differences if d.kind == "rename"]
    assert any("same path" in n for n in notes) and any("matches no saved" in n for n in notes)
    assert same_snapshot(before, snapshot(live))


def test_hyperparameter_choice(tmp_path):
    opt = make_opt("Adam", steps=2)
    flatopt.save(tmp_path / "ck.h5", opt)
    live = make_opt("Adam", steps=0, lr=0.5, betas=(0.8, 0.9))
    with pytest.raises(flatopt.CheckpointMismatch, match="betas"):
        flatopt.load(tmp_path / "ck.h5", live)
    flatopt.load(tmp_path / "ck.h5", live, hyperparameters="live")
    assert live.param_groups[1]["lr"] == 0.5 and live.param_groups[1]["betas"] == (0.8, 0.9)
    flatopt.load(tmp_path / "ck.h5", live, hyperparameters="saved")
    assert live.param_groups[1]["lr"] == 0.01 and live.param_groups[1]["betas"] == (0.9, 0.999)
    assert live.param_groups[0]["lr"] == 0.02


def test_regrouped_optimizer_loads_state_by_path(tmp_path):
    opt = make_opt("Adam", steps=4)
    flatopt.save(tmp_path / "ck.h5", opt)
    one_group = flatopt.Adam(model_params(8), lr=0.01)
    before = snapshot(one_group)
    with pytest.raises(flatopt.CheckpointMismatch) as info:
        flatopt.load(tmp_path / "ck.h5", one_group)
    assert {"group", "groups"} <= {d.kind for d in info.value.differences}
    # saved groups disagree on lr, so their hyperparameters cannot both win
    with pytest.raises(flatopt.CheckpointMismatch, match="disagree"):
        flatopt.load(tmp_path / "ck.h5", one_group, regroup=True, hyperparameters="saved")
    assert same_snapshot(before, snapshot(one_group))
    flatopt.load(tmp_path / "ck.h5", one_group, regroup=True, hyperparameters="live")
    assert state_equal(opt, one_group)
    # and it keeps training from there
    step_with_grads(one_group, 3, 1)


def test_amsgrad_turned_on_at_load(tmp_path):
    opt = make_opt("Adam", steps=3)
    flatopt.save(tmp_path / "ck.h5", opt)
    live = make_opt("Adam", steps=2, amsgrad=True)
    with pytest.raises(flatopt.CheckpointMismatch, match="amsgrad: saved False, live True"):
        flatopt.load(tmp_path / "ck.h5", live)
    flatopt.load(tmp_path / "ck.h5", live, hyperparameters="live")
    for buf in live.buffers:
        assert not buf.state["max_exp_avg_sq"].any()  # the running max starts from zero
    assert live.state_of("enc.weight").step == opt.state_of("enc.weight").step
    step_with_grads(live, 5, 1)


def test_scheduler_requested_but_absent(tmp_path):
    flatopt.save(tmp_path / "ck.h5", make_opt("SGD"))

    class Sched:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            raise AssertionError("not called")

    with pytest.raises(flatopt.CheckpointMismatch, match="scheduler"):
        flatopt.load(tmp_path / "ck.h5", fresh_like("SGD"), scheduler=Sched())


# --------------------------------------------------------------------------- integrity
@pytest.fixture
def saved(tmp_path):
    opt = make_opt("Adam", steps=3)
    flatopt.save(tmp_path / "ck.h5", opt)
    return opt, (tmp_path / "ck.h5").read_bytes()


def expect_corrupt(data, match=None):
    live = stepped_other()
    before = snapshot(live)
    with pytest.raises(flatopt.CheckpointCorrupt, match=match) as info:
        flatopt.load(data, live)
    assert same_snapshot(before, snapshot(live))
    return info.value


chunk_offset = data_extent


def test_flipped_byte_in_data_names_the_buffer(saved):
    _, data = saved
    name = "/groups/1/float32/exp_avg"
    start, size = chunk_offset(data, name)
    for position in (start, start + size // 2, start + size - 5):
        damaged = bytearray(data)
        damaged[position] ^= 0x10
        exc = expect_corrupt(bytes(damaged), match="checksum mismatch")
        assert exc.buffer == name and name in str(exc)


def test_a_rewrite_through_hdf5_fails_the_block_checksums(saved):
    _, data = saved
    name = "/groups/0/float64/params"

    def overwrite(f):  # a rewrite through HDF5 leaves our block checksums as they were
        values = f[name][...]
        values[0] += 1.0
        f[name][...] = values
    exc = expect_corrupt(edit(data, overwrite, seal=False), match="checksum mismatch")
    assert exc.buffer == name


@pytest.mark.parametrize("fraction", [0.0001, 0.01, 0.3, 0.5, 0.9, 0.9999])
def test_truncated_files_are_refused(saved, fraction):
    _, data = saved
    expect_corrupt(data[:max(1, int(len(data) * fraction))])


def test_not_a_checkpoint(tmp_path):
    expect_corrupt(b"")
    expect_corrupt(np.random.default_rng(0).bytes(4096), match="not an HDF5 file")
    with h5py.File(tmp_path / "other.h5", "w", libver="latest") as f:
        f["x"] = np.arange(3.0)
    expect_corrupt((tmp_path / "other.h5").read_bytes(), match="not a flatopt checkpoint")
    with h5py.File(tmp_path / "other.h5", "w") as f:  # HDF5's default: superblock version 0
        f["x"] = np.arange(3.0)
    expect_corrupt((tmp_path / "other.h5").read_bytes(), match="superblock version 0")
    with pytest.raises(flatopt.CheckpointError, match="does not exist"):
        flatopt.load(tmp_path / "missing.h5", fresh_like())
    # a directory is read as a sharded checkpoint: this one has no manifest
    with pytest.raises(flatopt.CheckpointError, match="has no manifest.h5"):
        flatopt.load(tmp_path, fresh_like())


def test_incomplete_save_is_refused(tmp_path):
    opt = make_opt("Adam")
    target = tmp_path / "partial.h5"
    Snapshot(opt, None, None).write(str(target), stop_before_digest=True)
    expect_corrupt(target.read_bytes(), match="did not finish")


def test_edited_attributes_and_index_fail_the_digest(saved):
    _, data = saved
    edits = [
        lambda f: set_text(f["groups/0"], "hyperparameters", '{"lr": 1.0}'),
        lambda f: set_text(f, "flatopt_version", "9.9"),
        lambda f: f["metadata"].__setitem__((), b'{"evil": 1}'),
        lambda f: f["index/step"].__setitem__(0, 99),
        lambda f: f["index/path"].__setitem__(0, b"dec.weight"),
    ]
    for fn in edits:
        expect_corrupt(edit(data, fn, seal=False), match="digest")


def resealed_cases(data):
    """Consistent-looking files (digest recomputed) whose contents are impossible."""
    def set_column(name, row, value):
        def fn(f):
            column = f["index"][name][...]
            column[row] = value
            del f["index"][name]
            f["index"].create_dataset(name, data=column)
        return fn

    def set_shape(row, shape):
        def fn(f):
            column = f["index/shape"][...]
            column[row] = -1
            column[row, :len(shape)] = shape
            f["index/shape"][...] = column
            ndim = f["index/ndim"][...]
            ndim[row] = len(shape)
            f["index/ndim"][...] = ndim
        return fn

    return {
        "size 2**62": (set_column("size", 0, 2 ** 62), "size"),
        "shape and size 2**62": (lambda f: (set_shape(0, [2 ** 62])(f),
                                            set_column("size", 0, 2 ** 62)(f)), "outside"),
        "negative offset": (set_column("offset", 1, -16), "outside"),
        "overlap": (set_column("offset", 2, 0), "overlap"),
        "gap": (set_column("offset", 1, 1), "aligned packing"),
        "duplicate id": (set_column("id", 1, 0), "duplicated"),
        "negative step": (set_column("step", 2, -1), "outside"),
        "group out of range": (set_column("group", 0, 9), "no float"),
        "negative dimension": (set_shape(0, [-4, -3]), "negative"),
        "bad hyperparameter": (lambda f: set_text(
            f["groups/0"], "hyperparameters", json.dumps({"lr": -1})), "lr"),
        "variable-length string": (lambda f: f.attrs.__setitem__("optimizer", "Adam"),
                                   "fixed-length"),
        "ndim disagrees": (set_column("ndim", 4, 1), "ndim"),
        "length 2**62": (lambda f: f["groups/0/float32"].attrs.__setitem__("length", 2 ** 62),
                         "disagrees"),
        "state without buffers": (lambda f: f["groups/0/float32"].__delitem__("exp_avg"),
                                  "missing"),
        "pickle attribute": (lambda f: f.attrs.__setitem__(
            "payload", np.void(b"\x80\x04\x95cos\nsystem\n")), "unexpected root attributes"),
    }


@pytest.mark.parametrize("edit_newer, what", [
    (lambda f: set_text(f, "optimizer", "Sophia"), "optimizer 'Sophia'"),
    (lambda f: f.attrs.__setitem__("schema_version", 7), "schema version 7"),
    (lambda f: add_buffer(f["groups/0/float32"], "exp_avg_cubed", np.zeros(
        f["groups/0/float32"].attrs["length"], np.float32)), "slots ['exp_avg_cubed']"),
    (lambda f: f["index"].create_dataset("momentum", data=np.zeros(
        f["index/id"].shape[0], np.int64)), "columns ['momentum']"),
])
def test_a_sound_file_from_a_newer_flatopt_is_called_newer_not_damaged(saved, edit_newer,
                                                                       what):
    _, data = saved
    live = fresh_like()
    with pytest.raises(flatopt.CheckpointMismatch, match="upgrade flatopt") as info:
        flatopt.load(edit(data, edit_newer), live)
    assert what in str(info.value)
    assert info.value.differences[0].kind == "format"


def test_impossible_contents_are_refused_before_allocating(saved):
    _, data = saved
    for name, (fn, match) in resealed_cases(data).items():
        expect_corrupt(edit(data, fn), match=match)


def replace_dataset(f, name, **kwargs):
    attrs = dict(f[name].attrs)
    del f[name]
    ds = f.create_dataset(name, **kwargs)
    for k, v in attrs.items():
        ds.attrs[k] = v
    return ds


def hostile_cases(data, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(1 << 12, dtype=np.float32).tobytes())
    name = "/groups/1/float32/params"
    with h5py.File(io.BytesIO(data), "r") as f:
        length = f[name].shape[0]

    def external(f):
        replace_dataset(f, name, shape=(length,), dtype="<f4",
                        external=[(str(secret), 0, length * 4)])

    def virtual(f):
        layout = h5py.VirtualLayout(shape=(length,), dtype="<f4")
        layout[:] = h5py.VirtualSource(str(tmp_path / "missing.h5"), "x", shape=(length,))
        attrs = dict(f[name].attrs)
        del f[name]
        ds = f.create_virtual_dataset(name, layout, fillvalue=0)
        for k, v in attrs.items():
            ds.attrs[k] = v

    def unknown_filter(f):
        attrs = dict(f[name].attrs)
        del f[name]
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((min(length, 64),))
        dcpl.set_filter(32013, h5py.h5z.FLAG_OPTIONAL)
        h5py.h5d.create(f.id, name.encode(), h5py.h5t.IEEE_F32LE,
                        h5py.h5s.create_simple((length,)), dcpl=dcpl)
        for k, v in attrs.items():
            f[name].attrs[k] = v

    def soft(f):
        del f[name]
        f[name] = h5py.SoftLink("/groups/1/float32/exp_avg")

    def external_link(f):
        del f[name]
        f[name] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/x")

    def many_attributes(f):
        for k in range(3000):
            f["groups/0"].attrs[f"a{k}"] = k

    def deep(f):
        g = f["groups/0/float32"]
        for k in range(200):
            g = g.create_group("params_" if k == 0 else "x")

    def huge(f):
        replace_dataset(f, name, shape=(2 ** 62,), dtype="<f4", chunks=(1 << 16,))
        f["groups/1/float32"].attrs["length"] = 2 ** 62

    return {
        "external storage": (external, "external storage"),
        "virtual dataset": (virtual, "virtual"),
        "unknown filter": (unknown_filter, "filter 32013"),
        "soft link": (soft, "soft link"),
        "external link": (external_link, "external link"),
        "object dtype": (lambda f: replace_dataset(f, name, shape=(length,),
                                                   dtype=h5py.string_dtype()), "dtype"),
        "compound dtype": (lambda f: replace_dataset(
            f, name, shape=(length,), dtype=np.dtype([("a", "<f4")])), "dtype"),
        "integer dtype": (lambda f: replace_dataset(f, name, shape=(length,), dtype="<i4"),
                          "dtype"),
        "big-endian": (lambda f: replace_dataset(f, name, shape=(length,), dtype=">f4"),
                       "dtype"),
        "2-D buffer": (lambda f: replace_dataset(f, name, shape=(length, 1), dtype="<f4"),
                       "shape"),
        "2**62 elements": (huge, "more than the file|disagrees"),
        "thousands of attributes": (many_attributes, "attributes"),
        "deep nesting": (deep, "not a Adam buffer|should be a dataset"),
    }


def test_hostile_files_are_refused(saved, tmp_path):
    _, data = saved
    for label, (fn, match) in hostile_cases(data, tmp_path).items():
        exc = expect_corrupt(edit(data, fn), match=match)
        assert "ck" in str(exc) or "in-memory" in str(exc), label


def earliest_copy(data: bytes) -> bytes:
    """The same objects and attributes in a container of superblock version 0 (HDF5's
    default libver: metadata without checksums, B-tree nodes a damaged file can loop)."""
    out = io.BytesIO()
    with h5py.File(io.BytesIO(data), "r") as src, h5py.File(out, "w", libver="earliest") as dst:
        for key in src.attrs:
            dst.attrs.create(key, data=src.attrs[key], dtype=src.attrs.get_id(key).dtype)
        for name in src:
            src.copy(src[name], dst, name)
    return out.getvalue()


def test_containers_without_metadata_checksums_are_refused_before_hdf5_reads_them(saved,
                                                                                   tmp_path):
    """A superblock v0 file with a self-referencing B-tree node crashed HDF5;
    flatopt writes superblock v3 (checksummed metadata) and reads no other version."""
    _, data = saved
    assert data[8] == 3
    old = earliest_copy(data)
    assert old[8] == 0
    mutated = {version: data[:8] + bytes([version]) + data[9:] for version in (0, 1, 4)}
    (tmp_path / "v0.h5").write_bytes(old)
    for source, version in ((old, 0), (io.BytesIO(old), 0), (tmp_path / "v0.h5", 0),
                            *((value, version) for version, value in mutated.items())):
        expect_corrupt(source, match=f"superblock version {version}.*no checksums|"
                                     f"superblock version {version}.*reads versions 2 and 3")
    assert not cli.verify_checkpoint(tmp_path / "v0.h5")["ok"]
    with pytest.raises(flatopt.CheckpointCorrupt, match="superblock version 0"):
        cli.inspect_checkpoint(tmp_path / "v0.h5")


# --------------------------------------------------------------------------- saving safely
def test_disk_full_keeps_the_previous_checkpoint(tmp_path):
    small = make_opt("Adam", steps=1)
    flatopt.save(tmp_path / "ck.h5", small)
    original = (tmp_path / "ck.h5").read_bytes()
    big = flatopt.Adam({"w": np.ones(1 << 20, np.float32)})
    step_with_grads(big, 0, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # writes past 1 MiB fail
    try:
        with pytest.raises(flatopt.CheckpointError, match="could not save") as info:
            flatopt.save(tmp_path / "ck.h5", big)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert "untouched" in str(info.value)
    assert os.listdir(tmp_path) == ["ck.h5"]
    assert (tmp_path / "ck.h5").read_bytes() == original
    other = fresh_like()
    flatopt.load(tmp_path / "ck.h5", other)
    assert state_equal(small, other)


def test_enospc_mid_write_removes_the_temporary_file(tmp_path, monkeypatch):
    opt = make_opt("SGD")
    flatopt.save(tmp_path / "ck.h5", opt)
    original = (tmp_path / "ck.h5").read_bytes()
    real = writer_mod.write_buffer
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(writer_mod, "write_buffer", failing)
    with pytest.raises(flatopt.CheckpointError, match="disk is full"):
        flatopt.save(tmp_path / "ck.h5", make_opt("SGD", seed=3))
    assert os.listdir(tmp_path) == ["ck.h5"]
    assert (tmp_path / "ck.h5").read_bytes() == original


def test_stale_temporary_files_are_cleaned_and_ignored(tmp_path):
    opt = make_opt("Adam")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".ck.h5.{dead}.abc123de.tmp"
    stale.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    unrelated = tmp_path / ".other.h5.1.x.tmp"
    unrelated.write_bytes(b"")
    os.chmod(tmp_path, 0o755)
    flatopt.save(tmp_path / "ck.h5", opt)
    assert sorted(os.listdir(tmp_path)) == sorted(["ck.h5", unrelated.name])
    os.chmod(tmp_path / "ck.h5", 0o640)
    flatopt.save(tmp_path / "ck.h5", opt)
    assert (os.stat(tmp_path / "ck.h5").st_mode & 0o777) == 0o640  # mode kept on replace


def test_clean_up_removes_only_names_flatopt_generated(tmp_path):
    """The clean-up of a plain and of a sharded save matches ASCII names in
    full (no trailing newline, no Unicode digits, no newline inside) and removes no symlink."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    user_files = [f".ck.h5.{dead}.abcdefgh.tmp\n", f".ck.h5.{dead}.abc.tmp",
                  ".ck.h5.\u0661\u0662\u0663.abcdefgh.tmp", f".ck.h5.{dead}.abc\nefgh.tmp",
                  f".ck.h5.0{dead}.abcdefgh.tmp", "0123456789abcdef.rank0-of-2.h5\n",
                  "0123456789abcdef.rank\u0660-of-\u0662.h5", "0123456789abcdef.rank2-of-2.h5",
                  "0123456789abcdef.rank01-of-2.h5",
                  ".0123456789abcdef.rank0-of-2.h5.\u0661\u0662.abcdefgh.tmp"]
    for name in user_files:
        (tmp_path / name).write_bytes(b"user data")
    link = tmp_path / f".ck.h5.{dead}.abcdefgh.tmp"
    link.symlink_to(outside)
    part_link = tmp_path / "0123456789abcdef.rank1-of-2.h5"
    part_link.symlink_to(outside)
    stale_part = tmp_path / "0123456789abcdef.rank0-of-2.h5"
    stale_part.write_bytes(b"an old save's part")
    stale_part_temp = tmp_path / f".{stale_part.name}.{dead}.abcdefgh.tmp"
    stale_part_temp.write_bytes(b"a killed save's part")
    flatopt.save(tmp_path / "ck.h5", make_opt("Adam"))
    manifest.remove_other_saves(str(tmp_path), "fedcba9876543210")
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["ck.h5", "outside", link.name, part_link.name, *user_files])
    assert outside.read_bytes() == b"keep"


def test_save_errors(tmp_path):
    opt = make_opt("Adam")
    with pytest.raises(flatopt.CheckpointError, match="does not exist"):
        flatopt.save(tmp_path / "no" / "ck.h5", opt)
    with pytest.raises(flatopt.CheckpointError, match="directory"):
        flatopt.save(tmp_path, opt)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(flatopt.HyperparameterError):
        flatopt.save(tmp_path / "ck.h5", opt)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------- edge shapes, names, open files
def test_edge_shapes_unicode_paths_and_empty_groups(tmp_path):
    def build(seed):
        rng = np.random.default_rng(seed)
        return flatopt.AdamW([
            {"params": {"zero.only": np.zeros((0, 5), np.float32)}, "label": "zero-size only"},
            {"params": {}, "label": "empty", "lr": 0.5},
            {"params": {"émbed.wéight/ünïcode": rng.standard_normal((2, 3)),
                        "s": np.array(2.0), "p" * 300: rng.standard_normal(70)}},
        ], lr=0.01)
    opt = build(0)
    step_with_grads(opt, 0, 3)
    flatopt.save(tmp_path / "ck.h5", opt)
    other = build(1)
    flatopt.load(tmp_path / "ck.h5", other)
    assert state_equal(opt, other)
    info = cli.inspect_checkpoint(tmp_path / "ck.h5")
    assert [g["parameters"] for g in info["groups"]] == [1, 0, 3]
    assert cli.verify_checkpoint(tmp_path / "ck.h5")["ok"]


def test_paths_and_labels_a_file_cannot_hold_are_refused_at_construction():
    # one validation: what a checkpoint cannot store never enters an optimizer
    with pytest.raises(flatopt.ParamError, match=re.escape(r"'a\x00b' contains a NUL")):
        flatopt.SGD({"a\x00b": np.zeros(2, np.float32)})
    with pytest.raises(flatopt.ParamError, match="lone surrogate"):
        flatopt.SGD({"a\udc80": np.zeros(2, np.float32)})
    with pytest.raises(flatopt.HyperparameterError, match="label"):
        flatopt.SGD([{"params": {"a": np.zeros(2, np.float32)}, "label": "x\x00"}])


def test_a_file_never_closed_by_a_killed_writer_is_refused(tmp_path):
    path = tmp_path / "crashed.h5"
    code = ("import os, signal, h5py, numpy as np\n"
            f"f = h5py.File({str(path)!r}, 'w', libver=('v110', 'latest'))\n"
            "f.create_dataset('x', data=np.arange(1000.0))\n"
            "f.flush()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    subprocess.run([sys.executable, "-c", code], timeout=120)
    exc = expect_corrupt(str(path), match="never closed|h5clear")
    assert exc.path == str(path)


@pytest.mark.skipif(os.environ.get("HDF5_USE_FILE_LOCKING", "").upper() == "FALSE",
                    reason="HDF5 file locking is turned off")
def test_a_file_locked_by_a_writer_is_a_clean_error(tmp_path):
    path = tmp_path / "ck.h5"
    flatopt.save(path, make_opt("SGD"))
    code = ("import sys, time, h5py\n"
            f"f = h5py.File({str(path)!r}, 'a')\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        live = fresh_like("SGD")
        before = snapshot(live)
        with pytest.raises(flatopt.CheckpointError, match="locked"):
            flatopt.load(path, live)
        assert same_snapshot(before, snapshot(live))
    finally:
        holder.communicate("\n", timeout=60)


def test_a_scheduler_restores_the_values_it_owns_and_nothing_else(tmp_path):
    def build(weight_decay=0.05):
        opt = flatopt.AdamW({"w": np.ones(3, np.float32)}, lr=1e-3, weight_decay=weight_decay)
        return opt, flatopt.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    opt, sched = build()
    for _ in range(4):
        opt.step({"w": np.ones(3, np.float32)})
        sched.step()
    flatopt.save(tmp_path / "ck.h5", opt, scheduler=sched)
    resumed, resumed_sched = build()
    flatopt.load(tmp_path / "ck.h5", resumed, scheduler=resumed_sched)  # no option needed
    assert resumed.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert resumed_sched.get_last_lr() == sched.get_last_lr()
    with pytest.raises(flatopt.CheckpointMismatch, match="pass scheduler= to restore"):
        flatopt.load(tmp_path / "ck.h5", build()[0])
    changed, changed_sched = build(weight_decay=0.1)  # a real change is still reported
    with pytest.raises(flatopt.CheckpointMismatch, match="weight_decay") as info:
        flatopt.load(tmp_path / "ck.h5", changed, scheduler=changed_sched)
    assert not any("lr" in d.where.split()[-1] for d in info.value.differences)


# --------------------------------------------------------------------------- integer bounds
# Every count a state dict or a file carries is bounded by what the code keeps: 2**53 for a
# step count (schema.MAX_STEP: float64-exact) and a group's counter; a step from the limit
# refuses before anything changes, so what is stepped always saves and loads.
COUNTERS = {  # optimizer: (where the count is, its name)
    "Adam": ("column", "step"),
    "AdEMAMix": ("group", "step"),
    "Prodigy": ("group", "k"),
    "ScheduleFreeAdamW": ("group", "k"),
}
PAST_THE_LIMIT = st.one_of(st.integers(MAX_STEP + 1, 2 ** 63 - 1), st.integers(-2 ** 63, -1),
                           st.just(True))


def _counted(kind):
    opt = getattr(flatopt, kind)({"w": np.linspace(-1, 1, 300, dtype=np.float32)}, lr=1e-3)
    opt.step({"w": np.ones(300, np.float32)})
    return opt


def _set_count(kind, sd, value):
    where, name = COUNTERS[kind]
    if where == "column":
        sd["state"]["w"][name] = value
    else:
        sd["param_groups"][0][name] = value


@pytest.mark.parametrize("kind", COUNTERS)
@settings(max_examples=10, deadline=None)
@given(value=PAST_THE_LIMIT)
def test_a_count_out_of_range_is_refused_by_load_state_dict(kind, value):
    sd = _counted(kind).state_dict()
    _set_count(kind, sd, value)
    live = _counted(kind)
    before = snapshot(live)
    with pytest.raises((flatopt.errors.StateDictError, flatopt.HyperparameterError),
                       match=COUNTERS[kind][1]):
        live.load_state_dict(sd)
    assert same_snapshot(before, snapshot(live))


@pytest.mark.parametrize("kind", COUNTERS)
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(st.integers(MAX_STEP + 1, 2 ** 63 - 1), st.integers(-2 ** 63, -1)))
def test_a_count_out_of_range_in_a_file_is_corrupt(kind, value, tmp_path):
    flatopt.save(tmp_path / "ck.h5", _counted(kind))
    where, name = COUNTERS[kind]

    def change(f):
        if where == "column":
            column = f["index"][name][...]
            column[0] = value
            del f["index"][name]
            f["index"].create_dataset(name, data=column)
        else:
            values = json.loads(f["groups/0"].attrs["hyperparameters"])
            values[name] = value
            set_text(f["groups/0"], "hyperparameters", json.dumps(values))
    live = _counted(kind)
    before = snapshot(live)
    with pytest.raises(flatopt.CheckpointCorrupt, match=name):
        flatopt.load(edit((tmp_path / "ck.h5").read_bytes(), change), live)
    assert same_snapshot(before, snapshot(live))


@pytest.mark.parametrize("kind", COUNTERS)
def test_a_count_at_the_limit_loads_saves_and_refuses_the_next_step(kind, tmp_path):
    sd = _counted(kind).state_dict()
    _set_count(kind, sd, MAX_STEP)
    live = _counted(kind)
    live.load_state_dict(sd)
    path = flatopt.save(tmp_path / "limit.h5", live)
    other = _counted(kind)
    flatopt.load(path, other)
    before = snapshot(other)
    with pytest.raises(flatopt.errors.StepLimitError,
                       match=rf"{COUNTERS[kind][1]} is {MAX_STEP}.*nothing was changed|"
                             rf"nothing was changed.*{COUNTERS[kind][1]} is {MAX_STEP}"):
        other.step({"w": np.ones(300, np.float32)})
    assert same_snapshot(before, snapshot(other))
    assert other.state_dict()["param_groups"] == sd["param_groups"]
