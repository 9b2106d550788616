"""Reduced-precision optimizers in checkpoints and state dicts: lossless (bit-exact resume,
in this process and in a fresh one), storage compared on load (refused by path and format,
or converted with convert=True), inspect and read, hostile files refused."""

import io
import json
import os
import subprocess
import sys

import h5py
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flatopt
from flatopt.checkpoint import inspect_checkpoint
from flatopt.errors import CheckpointCorrupt, CheckpointMismatch, StateDictError
from checkpoint_helpers import add_buffer, reseal
from flatopt.checkpoint.h5write import set_text
from flatopt.kernels.storage import BLOCK
from flatopt.schema import MAX_STEP

BF16 = ml_dtypes.bfloat16
MODES = {
    "bf16_nearest": (BF16, {}),
    "bf16_stochastic": (BF16, {"rounding": "stochastic", "seed": 3}),
    "bf16_kahan": (BF16, {"rounding": "kahan"}),
    "fp16_master": (np.float16, {"master_weights": True}),
    "bf16_master": (BF16, {"master_weights": True}),
    "bf16_state": (np.float32, {"state_dtype": "bfloat16", "seed": 5}),
    "int8_state": (np.float32, {"state_dtype": "int8"}),
    "int8_master_g32": (BF16, {"state_dtype": "int8", "master_weights": True,
                               "grad_dtype": "float32"}),
}
SPLIT, TOTAL = 3, 6


def params(dtype):
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((40, 128)).astype(dtype),
            "b": rng.standard_normal(300).astype(dtype)}


def build(mode):
    dtype, kwargs = MODES[mode]
    return flatopt.AdamW(params(dtype), lr=1e-2, **kwargs)


def grads(opt, k):
    rng = np.random.default_rng(100 + k)
    return {p: rng.standard_normal(opt.params[p].shape).astype(opt.grads[p].dtype)
            for p in opt.index.paths}


def run(opt, start, stop):
    for k in range(start, stop):
        opt.step(grads(opt, k))


def bits(opt):
    return {p: opt.params[p].view(np.uint8).copy() for p in opt.index.paths}


def assert_same_bits(a, b):
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)


def stored(opt):
    """Every stored array of every buffer (and draws), to compare bit for bit."""
    out = {}
    for buf in opt.buffers:
        arrays = {"params": buf.params, "master": buf.master, "comp": buf.compensation,
                  **buf.state, **{f"{k}.absmax": v for k, v in buf.absmax.items()}}
        for name, flat in arrays.items():
            if flat is not None:
                out[buf.number, name] = flat.view(np.uint8).copy()
        if buf.coded:  # a plain buffer draws nothing: its counter is not state
            out[buf.number, "draws"] = buf.draws
    return out


def uninterrupted(mode):
    opt = build(mode)
    run(opt, 0, TOTAL)
    return bits(opt)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_resume_is_bit_exact(mode, tmp_path):
    a = build(mode)
    run(a, 0, SPLIT)
    path = flatopt.save(tmp_path / "ck.h5", a)
    b = build(mode)
    flatopt.load(path, b)
    sa, sb = stored(a), stored(b)
    assert sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa)
    run(b, SPLIT, TOTAL)
    assert_same_bits(uninterrupted(mode), bits(b))


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_round_trip_is_bit_exact(mode):
    a = build(mode)
    run(a, 0, SPLIT)
    sd = a.state_dict()
    assert sd["version"] == 2 and sd["storage"][0]["draws"] == SPLIT
    b = build(mode)
    for path in b.index.paths:
        b.params[path][...] = a.params[path]
    b.load_state_dict(sd)
    run(b, SPLIT, TOTAL)
    assert_same_bits(uninterrupted(mode), bits(b))


def test_state_dict_holds_stored_arrays():
    opt = build("int8_master_g32")
    run(opt, 0, 2)
    entry = opt.state_dict()["state"]["w"]
    assert entry["exp_avg"]["codes"].dtype == np.uint8
    assert entry["exp_avg"]["absmax"].shape == (40 * 128 // 256,)
    assert entry["master"].dtype == np.float32
    assert opt.state_of("w").exp_avg.dtype == np.float32  # state_of: float32 values
    sd = build("bf16_state")
    run(sd, 0, 2)
    assert sd.state_dict()["state"]["w"]["exp_avg"].dtype == BF16


def test_draws_matter_for_stochastic_rounding():
    """Without the saved draws the stochastic stream would repeat: the test above would
    fail."""
    a = build("bf16_stochastic")
    run(a, 0, SPLIT)
    sd = a.state_dict()
    sd["storage"][0]["draws"] = 0
    b = build("bf16_stochastic")
    for path in b.index.paths:
        b.params[path][...] = a.params[path]
    b.load_state_dict(sd)
    run(b, SPLIT, TOTAL)
    assert any(not np.array_equal(x, y) for x, y in
               zip(uninterrupted("bf16_stochastic").values(), bits(b).values()))


def test_state_dict_storage_mismatch_refused_then_converted():
    a = build("int8_state")
    run(a, 0, SPLIT)
    sd = a.state_dict()
    b = flatopt.AdamW(params(np.float32), lr=1e-2)
    before = b.state_dict()
    with pytest.raises(StateDictError, match=r"'w'.*state int8.*state float32.*convert=True"):
        b.load_state_dict(sd)
    assert b.state_dict()["state"] == before["state"]
    b.load_state_dict(sd, convert=True)
    np.testing.assert_array_equal(b.state_of("w").exp_avg, a.state_of("w").exp_avg)


def test_resume_in_a_fresh_process(tmp_path):
    a = build("bf16_stochastic")
    run(a, 0, SPLIT)
    path = flatopt.save(tmp_path / "ck.h5", a)
    script = f"""
import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
import numpy as np, flatopt
from test_checkpoint_precision import build, run, SPLIT, TOTAL
opt = build("bf16_stochastic")
flatopt.load({str(path)!r}, opt)
run(opt, SPLIT, TOTAL)
np.savez({str(tmp_path / 'out.npz')!r}, **{{p: opt.params[p].view(np.uint16) for p in opt.index.paths}})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600)
    out = np.load(tmp_path / "out.npz")
    for p, values in uninterrupted("bf16_stochastic").items():
        np.testing.assert_array_equal(values.view(np.uint16), out[p], err_msg=p)


def test_mismatch_refused_by_path_and_format_nothing_changed(tmp_path):
    a = build("int8_state")
    run(a, 0, SPLIT)
    path = flatopt.save(tmp_path / "ck.h5", a)
    b = build("bf16_state")
    run(b, 0, 1)
    before = stored(b)
    with pytest.raises(CheckpointMismatch) as info:
        flatopt.load(path, b)
    text = str(info.value)
    assert "storage" in text and "w:" in text and "state int8" in text \
        and "state bfloat16" in text and "convert=True" in text
    after = stored(b)
    assert before.keys() == after.keys() and all(
        np.array_equal(before[k], after[k]) for k in before)


def test_convert_int8_file_into_float32_optimizer_and_back(tmp_path):
    a = build("int8_state")
    run(a, 0, SPLIT)
    path = flatopt.save(tmp_path / "ck.h5", a)
    b = flatopt.AdamW(params(np.float32), lr=1e-2)
    flatopt.load(path, b, convert=True)
    for name in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(getattr(b.state_of("w"), name),
                                      getattr(a.state_of("w"), name))
    np.testing.assert_array_equal(b.params["w"], a.params["w"])
    # float32 file -> int8 optimizer: the codes are the float32 values quantized
    run(b, SPLIT, SPLIT + 1)
    path2 = flatopt.save(tmp_path / "f32.h5", b)
    assert inspect_checkpoint(path2)["format_version"] < 5  # plain files keep their version
    c = build("int8_state")
    with pytest.raises(CheckpointMismatch, match="convert=True"):
        flatopt.load(path2, c)
    flatopt.load(path2, c, convert=True)
    assert c.buffers[0].state["exp_avg"].dtype == np.uint8
    want = b.state_of("w").exp_avg
    got = c.state_of("w").exp_avg
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 0.02 * scale
    np.testing.assert_array_equal(c.params["w"], b.params["w"])


def test_convert_16bit_params_into_master_weights(tmp_path):
    a = build("bf16_nearest")
    run(a, 0, SPLIT)
    path = flatopt.save(tmp_path / "ck.h5", a)
    b = build("bf16_master")
    flatopt.load(path, b, convert=True)
    buf = b.buffers[0]
    np.testing.assert_array_equal(buf.view(buf.master, 0),
                                  a.params[buf.paths[0]].astype(np.float32))
    np.testing.assert_array_equal(b.state_of("w").exp_avg, a.state_of("w").exp_avg)


def test_inspect_shows_storage_and_read_gives_float32(tmp_path):
    a = build("int8_master_g32")
    run(a, 0, SPLIT)
    path = flatopt.save(tmp_path / "ck.h5", a)
    info = inspect_checkpoint(path)
    assert info["format_version"] == 5
    storage = info["groups"][0]["storage"]
    assert storage[0]["state"] == "int8" and storage[0]["master"] is True
    assert "params bfloat16" in storage[0]["storage"] and storage[0]["draws"] == SPLIT
    data = flatopt.read(path, state=True)
    assert data.state["w"]["exp_avg"].dtype == np.float32
    np.testing.assert_array_equal(data.state["w"]["exp_avg"], a.state_of("w").exp_avg)
    assert data.params["w"].dtype == np.float32
    np.testing.assert_array_equal(data.params["w"], a.params["w"].astype(np.float32))


def _storage_array(f, suffix):
    for key in f["arrays"]:
        ds = f["arrays"][key]
        if ds.attrs["name"].decode().endswith(suffix):
            return key, ds
    raise KeyError(suffix)


def _replace_array(f, key, values):
    old = f["arrays"][key]
    name, dtype = old.attrs["name"], old.attrs["dtype"]
    del f["arrays"][key]
    ds = add_buffer(f["arrays"], key, values)
    ds.attrs["name"], ds.attrs["dtype"] = name, dtype


def _tampered(path, edit):
    data = open(path, "rb").read()
    bio = io.BytesIO(data)
    with h5py.File(bio, "r+") as f:
        edit(f)
    return io.BytesIO(reseal(bio.getvalue()))


@pytest.mark.parametrize("edit", ["dtype", "absmax", "codes"])
def test_tampered_storage_is_corrupt(edit, tmp_path):
    a = build("int8_master_g32")
    run(a, 0, SPLIT)
    path = flatopt.save(tmp_path / "ck.h5", a)

    def change(f):
        if edit == "dtype":
            g = f["groups"]["0"]
            items = json.loads(g.attrs["storage"])
            items[0]["param"] = "float32"
            set_text(g, "storage", json.dumps(items))
        else:
            key, ds = _storage_array(f, "exp_avg.absmax" if edit == "absmax" else "/exp_avg")
            _replace_array(f, key, ds[...][:-1])
    b = build("int8_master_g32")
    before = stored(b)
    with pytest.raises(CheckpointCorrupt):
        flatopt.load(_tampered(path, change), b)
    assert all(np.array_equal(before[k], v) for k, v in stored(b).items())


def test_older_reader_reports_newer_file(tmp_path, monkeypatch):
    a = build("bf16_state")
    run(a, 0, 1)
    path = flatopt.save(tmp_path / "ck.h5", a)
    from flatopt.checkpoint import reader
    monkeypatch.setattr(reader, "FORMAT_VERSION", 4)
    monkeypatch.setattr(reader.read_header, "__defaults__",
                        (reader.FORMAT, 4, None, None))
    with pytest.raises(CheckpointMismatch, match="newer|upgrade"):
        flatopt.load(path, build("bf16_state"))


def test_a_seed_does_not_make_plain_buffers_differ(tmp_path):
    """A float32 buffer beside 16-bit ones draws nothing: the seed given to the optimizer is
    no part of its storage, so an identically built optimizer loads the file."""
    def make():
        return flatopt.Adam({"h": np.ones(8, ml_dtypes.bfloat16), "f": np.ones(8, np.float32)},
                            lr=1e-2, seed=5, rounding="stochastic")
    opt = make()
    opt.step({"h": np.ones(8, ml_dtypes.bfloat16), "f": np.ones(8, np.float32)})
    path = flatopt.save(tmp_path / "seeded.h5", opt)
    other = make()
    flatopt.load(path, other)
    np.testing.assert_array_equal(other.params["h"].view(np.uint16),
                                  opt.params["h"].view(np.uint16))


def _ema_case():
    """A group split into three buffers: 16-bit parameters (with a float32 master copy),
    a float32 tensor with 8-bit state and one too small for it (its own float32 buffer),
    plus a second group; the EMA's averages of all of them are float32."""
    rng = np.random.default_rng(7)
    groups = [{"params": {"h": rng.standard_normal(5000).astype(BF16),
                          "big": rng.standard_normal(6000).astype(np.float32),
                          "small": rng.standard_normal(300).astype(np.float32)},
               "state_dtype": "int8", "master_weights": True},
              {"params": {"n": rng.standard_normal(70).astype(np.float32)}}]
    opt = flatopt.AdamW(groups, lr=1e-2)
    return opt, flatopt.EMA(opt, decay=0.9)


def _ema_steps(opt, ema, start, stop):
    for k in range(start, stop):
        opt.step(grads(opt, k))
        ema.update()


def test_an_ema_of_a_reduced_precision_optimizer_resumes_bit_exact(tmp_path):
    opt, ema = _ema_case()
    assert len({(b.group, b.dtype) for b in opt.buffers}) < len(opt.buffers)  # split groups
    _ema_steps(opt, ema, 0, SPLIT)
    path = flatopt.save(tmp_path / "ema.h5", opt, ema=ema)
    other, other_ema = _ema_case()
    flatopt.load(path, other, ema=other_ema)
    assert other_ema.num_updates == ema.num_updates
    for p, average in ema.params.items():
        assert other_ema.params[p].dtype == np.float32
        np.testing.assert_array_equal(other_ema.params[p], average, err_msg=p)
    _ema_steps(opt, ema, SPLIT, TOTAL)
    _ema_steps(other, other_ema, SPLIT, TOTAL)
    assert_same_bits(bits(opt), bits(other))
    for p, average in ema.params.items():
        np.testing.assert_array_equal(other_ema.params[p], average, err_msg=p)


def test_an_ema_of_a_reduced_precision_optimizer_in_a_run(tmp_path):
    opt, ema = _ema_case()
    _ema_steps(opt, ema, 0, 2)
    flatopt.save(tmp_path / "run", {"a": opt}, ema=[ema])
    other, other_ema = _ema_case()
    flatopt.load(tmp_path / "run", {"a": other}, ema=[other_ema])
    for p, average in ema.params.items():
        np.testing.assert_array_equal(other_ema.params[p], average, err_msg=p)


@pytest.mark.parametrize("mode", ["bf16_nearest", "bf16_master", "bf16_kahan"])
@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_a_state_of_record_stays_live_across_a_load(mode, how, tmp_path):
    """As with float32 parameters, a record taken before a load views the buffers: it shows
    the loaded state, then what later steps make of it (a load writes into the live arrays
    instead of replacing them)."""
    a = build(mode)
    run(a, 0, SPLIT)
    b = build(mode)
    run(b, 10, 11)  # other state, so that the record shows the load
    record = b.state_of("w")
    if how == "checkpoint":
        flatopt.load(flatopt.save(tmp_path / "ck.h5", a), b)
    else:
        for path in b.index.paths:
            b.params[path][...] = a.params[path]
        b.load_state_dict(a.state_dict())
    for name in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(getattr(record, name), getattr(a.state_of("w"), name))
    run(a, SPLIT, SPLIT + 1)
    run(b, SPLIT, SPLIT + 1)
    for name in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(getattr(record, name), getattr(a.state_of("w"), name))
        np.testing.assert_array_equal(getattr(record, name), getattr(b.state_of("w"), name))


# ----------------------------------------------------------------------------- master copies
STATELESS = {"master": {"master_weights": True}, "kahan": {"rounding": "kahan"}}


def _sgd(mode, dtype=BF16):
    """SGD without momentum: no state, but a float32 master copy or a Kahan compensation
    that holds what the 16-bit parameters cannot."""
    return flatopt.SGD(params(dtype), lr=1e-3, **STATELESS[mode])


def _beyond_16_bits(opt, path="w"):
    """The parameter's value beyond its 16 bits: its master copy, or its compensation."""
    buf = opt.buffers[opt.index[path].buffer]
    slot = opt.index[path].slot
    if buf.master is not None:
        return buf.view(buf.master, slot) - opt.params[path].astype(np.float32)
    return buf.view(buf.compensation, slot).astype(np.float32)


@pytest.mark.parametrize("mode", STATELESS)
@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_master_copy_of_a_stateless_rule_resumes_bit_exact(mode, how, tmp_path):
    a = _sgd(mode)
    run(a, 0, SPLIT)
    assert a.state_of("w") is None and np.any(_beyond_16_bits(a) != 0)
    b = _sgd(mode)
    if how == "checkpoint":
        flatopt.load(flatopt.save(tmp_path / "ck.h5", a), b)
    else:
        sd = a.state_dict()
        kept = {"master"} if mode == "master" else {"compensation"}
        assert set(sd["state"]) == {"w", "b"} and set(sd["state"]["w"]) == kept
        for path in b.index.paths:
            b.params[path][...] = a.params[path]
        b.load_state_dict(sd)
    sa, sb = stored(a), stored(b)
    assert sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa)
    assert b.state_of("w") is None  # still without state: SGD's momentum stays unseeded
    run(b, SPLIT, TOTAL)
    never_saved = _sgd(mode)
    run(never_saved, 0, TOTAL)
    assert_same_bits(bits(never_saved), bits(b))


@pytest.mark.parametrize("mode", STATELESS)
def test_master_copy_entry_is_checked(mode):
    a = _sgd(mode)
    run(a, 0, 1)
    sd = a.state_dict()
    name = "master" if mode == "master" else "compensation"
    sd["state"]["w"][name] = sd["state"]["w"][name][:3]
    b = _sgd(mode)
    before = stored(b)
    with pytest.raises(StateDictError, match=rf"'w': {name} must be"):
        b.load_state_dict(sd)
    after = stored(b)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def _best_float32(opt, path):
    """What a float32 parameter converted from ``opt`` should hold: the master copy, or the
    16-bit value plus its compensation."""
    return opt.params[path].astype(np.float32) + _beyond_16_bits(opt, path)


@pytest.mark.parametrize("mode", ["bf16_master", "bf16_kahan", "int8_master_g32"])
@pytest.mark.parametrize("target", ["float32", "float32 int8 state"])
@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_converting_into_float32_keeps_the_master_copy(mode, target, how, tmp_path):
    """A float32 parameter converted from 16-bit ones takes the best value saved for it: the
    master copy, or the parameter plus its Kahan compensation, never the rounded values.
    Under int8 state, the float32 'b' (300 elements) sits in a plain float32 buffer."""
    a = build(mode)
    run(a, 0, SPLIT)
    assert all(np.any(_beyond_16_bits(a, p) != 0) for p in a.index.paths)
    kwargs = {"state_dtype": "int8"} if target == "float32 int8 state" else {}
    # a state dict holds no parameters: the live ones are the saved 16-bit values
    b = flatopt.AdamW({p: v.astype(np.float32) for p, v in a.params.items()}, lr=1e-2,
                      **kwargs)
    if how == "checkpoint":
        flatopt.load(flatopt.save(tmp_path / "ck.h5", a), b, convert=True)
    else:
        b.load_state_dict(a.state_dict(), convert=True)
    for path in a.index.paths:
        np.testing.assert_array_equal(b.params[path], _best_float32(a, path), err_msg=path)
        assert not np.array_equal(b.params[path], a.params[path].astype(np.float32))
    np.testing.assert_array_equal(b.state_of("b").exp_avg, a.state_of("b").exp_avg)


def test_kahan_converted_into_master_weights_keeps_the_compensation(tmp_path):
    a = build("bf16_kahan")
    run(a, 0, SPLIT)
    b = build("bf16_master")
    flatopt.load(flatopt.save(tmp_path / "ck.h5", a), b, convert=True)
    for path in a.index.paths:
        np.testing.assert_array_equal(b.params[path].astype(np.float32) + _beyond_16_bits(
            b, path), _best_float32(a, path), err_msg=path)


def test_float32_converted_into_kahan_carries_the_rounding_in_the_compensation(tmp_path):
    """Into 16-bit parameters with Kahan summation the float32 values are rounded to
    nearest and what that lost becomes the compensation."""
    a = flatopt.AdamW(params(np.float32), lr=1e-2)
    run(a, 0, SPLIT)
    b = build("bf16_kahan")
    flatopt.load(flatopt.save(tmp_path / "ck.h5", a), b, convert=True)
    for path in a.index.paths:
        want = a.params[path]
        np.testing.assert_array_equal(b.params[path], want.astype(BF16))
        carried = b.params[path].astype(np.float32) + _beyond_16_bits(b, path)
        assert np.all(np.abs(carried - want) <= np.abs(b.params[path].astype(np.float32)
                                                       - want))
        assert np.mean(np.abs(carried - want)) < 0.01 * np.mean(
            np.abs(b.params[path].astype(np.float32) - want))


# ----------------------------------------------------------------------------- int8 and inf
INT8_SIGNED = {"SGD": {"momentum": 0.9}, "Lion": {}}


def _int8(name, extra=None):
    rng = np.random.default_rng(1)
    return getattr(flatopt, name)({"w": rng.standard_normal(5000).astype(np.float32),
                                   "b": rng.standard_normal(300).astype(np.float32)},
                                  lr=1e-3, state_dtype="int8", **(extra or {}))


def _inf_steps(opt, start, stop):
    """Steps whose gradients hold an inf at step 1 (a run without non-finite skipping)."""
    for k in range(start, stop):
        g = grads(opt, k)
        if k == 1:
            g["w"][700] = np.inf
        opt.step(g)


@pytest.mark.parametrize("name", INT8_SIGNED)
@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_int8_state_with_an_infinite_block_scale_round_trips(name, how, tmp_path):
    """An inf gradient element makes its 8-bit block's scale inf (the block then decodes to
    inf and NaN, as a float32 momentum would be inf). Like torch's inf momentum buffer, it is
    saved, verified sound and loaded as it is: the resumed run has the same bits as one that
    never saved."""
    a = _int8(name, INT8_SIGNED[name])
    _inf_steps(a, 0, SPLIT)
    slot = next(iter(a.buffers[0].absmax))
    assert np.isinf(a.buffers[0].absmax[slot]).any()
    b = _int8(name, INT8_SIGNED[name])
    if how == "checkpoint":
        path = flatopt.save(tmp_path / "ck.h5", a)
        report = flatopt.checkpoint.verify_checkpoint(path)
        assert report["ok"], report["problems"]
        flatopt.load(path, b)
    else:
        for p in b.index.paths:
            b.params[p] = a.params[p]
        b.load_state_dict(a.state_dict())
    sa, sb = stored(a), stored(b)
    assert sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa)
    _inf_steps(b, SPLIT, TOTAL)
    never_saved = _int8(name, INT8_SIGNED[name])
    _inf_steps(never_saved, 0, TOTAL)
    assert_same_bits(bits(never_saved), bits(b))


def test_an_infinite_second_moment_is_refused_before_the_file_is_touched(tmp_path):
    """An unsigned (second-moment) slot must hold finite values: save refuses an infinite
    scale there before it touches the target, so the previous checkpoint stays."""
    a = _int8("Adam")
    _inf_steps(a, 0, 1)
    path = flatopt.save(tmp_path / "ck.h5", a)
    good = path.read_bytes() if hasattr(path, "read_bytes") else open(path, "rb").read()
    _inf_steps(a, 1, 2)
    assert np.isinf(a.buffers[0].absmax["exp_avg_sq"]).any()
    with pytest.raises(flatopt.errors.CheckpointError, match="exp_avg_sq"):
        flatopt.save(path, a)
    assert open(path, "rb").read() == good
    flatopt.load(path, _int8("Adam"))


def test_a_nan_block_scale_is_refused_by_load_and_verify(tmp_path):
    """No step writes a NaN (or negative) scale: a file or state dict holding one is
    damaged, for load, load_state_dict and verify alike."""
    a = _int8("SGD", INT8_SIGNED["SGD"])
    run(a, 0, 2)
    path = flatopt.save(tmp_path / "ck.h5", a)

    def poison(f):
        key, ds = _storage_array(f, "momentum_buffer.absmax")
        values = ds[...]
        values[3] = np.nan
        _replace_array(f, key, values)
    damaged = _tampered(path, poison)
    report = flatopt.checkpoint.verify_checkpoint(io.BytesIO(damaged.getvalue()))
    assert not report["ok"] and any("NaN" in p for p in report["problems"])
    b = _int8("SGD", INT8_SIGNED["SGD"])
    before = stored(b)
    with pytest.raises(CheckpointCorrupt, match="negative or NaN"):
        flatopt.load(damaged, b)
    sd = a.state_dict()
    sd["state"]["w"]["momentum_buffer"]["absmax"][0] = -1.0
    with pytest.raises(StateDictError, match="'w': momentum_buffer has block scales"):
        b.load_state_dict(sd)
    after = stored(b)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_non_finite_float32_state_converts_to_int8_scales_a_step_would_write(tmp_path):
    """float32 momentum holding a NaN (block 0) and an inf (block 1), converted into int8:
    the scales are what a step writes (NaN skipped, an inf kept: never a NaN scale), so the
    converted optimizer saves what loads, and back in float32 the inf is still there."""
    def sgd(**kwargs):
        return flatopt.SGD(params(np.float32), lr=1e-3, momentum=0.9, **kwargs)
    f = sgd()
    run(f, 0, 1)
    g = grads(f, 1)
    g["w"][0, 5], g["w"][3, 7] = np.nan, np.inf  # flat elements 5 and 391
    f.step(g)
    c = sgd(state_dtype="int8")
    flatopt.load(flatopt.save(tmp_path / "f32.h5", f), c, convert=True)
    scales = c.buffers[0].absmax["momentum_buffer"]
    momentum = np.abs(f.state_of("w").momentum_buffer.reshape(-1))
    assert scales[0] == np.nanmax(momentum[:BLOCK]) and np.isinf(scales[1])
    assert not np.isnan(scales).any()
    again = flatopt.save(tmp_path / "again.h5", c)
    flatopt.load(again, sgd(state_dtype="int8"))
    back = sgd()
    flatopt.load(again, back, convert=True)
    assert np.isinf(back.state_of("w").momentum_buffer.reshape(-1)[BLOCK:2 * BLOCK]).any()


# ----------------------------------------------------------------------------- integers
OUT_OF_RANGE = {  # each storage integer: values no save writes (bools are not integers)
    "draws": st.one_of(st.integers(MAX_STEP + 1, 2 ** 80), st.integers(-2 ** 70, -1),
                       st.just(True), st.just(2 ** 64)),
    "seed": st.one_of(st.integers(2 ** 63, 2 ** 80), st.integers(-2 ** 70, -1),
                      st.just(False)),
}
SLOW = settings(max_examples=12, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _stochastic():
    opt = build("bf16_stochastic")
    run(opt, 0, 1)
    return opt


def _everything(opt):
    """Every stored array, the draws, the per-parameter columns and the groups."""
    return {**stored(opt), **{(buf.number, name): column.copy() for buf in opt.buffers
                              for name, column in buf.columns.items()},
            "groups": [dict(g) for g in opt.param_groups]}


def _unchanged(opt, before):
    after = _everything(opt)
    assert before.keys() == after.keys()
    assert all(before[k] == after[k] if k == "groups" else np.array_equal(before[k], after[k])
               for k in before)


@pytest.mark.parametrize("field", OUT_OF_RANGE)
@SLOW
@given(data=st.data())
def test_a_state_dict_storage_integer_out_of_range_is_refused(field, data):
    """A ``draws`` past 2**53 (2**64 made every later step raise after advancing the step
    counts) or a seed outside [0, 2**63): refused naming the entry, before anything changes;
    the optimizer steps on."""
    value = data.draw(OUT_OF_RANGE[field])
    a = _stochastic()
    sd = a.state_dict()
    sd["storage"][0][field] = value
    b = _stochastic()
    before = _everything(b)
    with pytest.raises(StateDictError, match=rf"'storage' entry 0 .*{field} must be an "
                                             r"integer in \[0, "):
        b.load_state_dict(sd)
    _unchanged(b, before)
    run(b, 1, 2)


@pytest.mark.parametrize("field", [*OUT_OF_RANGE, "offsets"])
@SLOW
@given(data=st.data())
def test_a_checkpoint_storage_integer_out_of_range_is_corrupt(field, data, tmp_path):
    a = _stochastic()
    path = flatopt.save(tmp_path / "ck.h5", a)
    value = data.draw(OUT_OF_RANGE.get(field, st.just(False)))

    def change(f):
        g = f["groups"]["0"]
        items = json.loads(g.attrs["storage"])
        if field == "offsets":  # JSON false is a Python bool, not the offset 0
            assert items[0]["offsets"][0] == 0
            items[0]["offsets"][0] = value
        else:
            items[0][field] = value
        set_text(g, "storage", json.dumps(items))
    b = _stochastic()
    before = _everything(b)
    with pytest.raises(CheckpointCorrupt, match="group 0 storage 0"):
        flatopt.load(_tampered(path, change), b)
    _unchanged(b, before)


def test_draws_at_the_limit_load_save_and_refuse_the_next_step(tmp_path):
    """2**53 draws is the largest count kept: it loads and saves, and a step from there
    refuses before anything changes (it would make a count no load accepts)."""
    a = _stochastic()
    sd = a.state_dict()
    sd["storage"][0]["draws"] = MAX_STEP
    b = _stochastic()
    b.load_state_dict(sd)
    assert b.buffers[0].draws == MAX_STEP
    c = _stochastic()
    flatopt.load(flatopt.save(tmp_path / "limit.h5", b), c)
    assert c.buffers[0].draws == MAX_STEP
    before = _everything(c)
    with pytest.raises(flatopt.errors.StepLimitError, match="drawn 9007199254740992"):
        run(c, 1, 2)
    _unchanged(c, before)
    c.buffers[0].draws = MAX_STEP + 1  # only by hand: save refuses it before the file
    with pytest.raises(flatopt.errors.CheckpointError, match="drawn 9007199254740993"):
        flatopt.save(tmp_path / "limit.h5", c)
    flatopt.load(tmp_path / "limit.h5", _stochastic())
