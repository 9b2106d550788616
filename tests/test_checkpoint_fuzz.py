"""Fuzzing the loader: thousands of mutated checkpoints, each loaded from bytes in memory.

Every case must end either in a CheckpointError subclass with the optimizer untouched, or (a
mutation that hit unused bytes) in a load that gives exactly the saved state. Cases whose digest
was recomputed (an attacker's consistent edit) must end in a CheckpointError or a load, never in
another exception or a crash.
"""

from __future__ import annotations

import io
import os
import random
import time

import h5py
import numpy as np
import pytest

import flatopt
from checkpoint_helpers import (make_opt, reseal, same_snapshot, snapshot, state_equal)
import optimizers
from optimizers import INFO, NAMES

CASES = int(os.environ.get("FLATOPT_FUZZ_CASES", "4000"))

ATTR_VALUES = ["", "garbage", "{", "null", "[]", '{"lr": 1}', 0, -1, 7, 2 ** 62, 1.5,
               np.array([1, 2]), np.void(b"\x80\x04\x95pickle."), "flatopt.checkpoint",
               "sha256:" + "0" * 64, "crc32:00000000", "\udcff".encode("utf-8", "surrogatepass")]
INT_VALUES = [-1, 0, 1, 3, 16, 17, 2 ** 31, 2 ** 62, -(2 ** 63)]


def restore(opt, snap) -> None:
    """Put the optimizer back to a snapshot (after a successful load) for the next case."""
    for group, saved in zip(opt.param_groups, snap["groups"]):
        group.clear()
        group.update(saved)
    for buf, saved in zip(opt.buffers, snap["buffers"]):
        buf.params[...] = saved["params"]
        for name in list(buf.state):
            if name not in saved["state"]:
                del buf.state[name]
        for name, flat in saved["state"].items():
            buf.state_buffer(name)[...] = flat
        for name, flat in saved["per_param"].items():
            buf.columns[name][...] = flat


def attribute_sites(f):
    sites = [(f, name) for name in f.attrs]

    def visit(name, obj):
        sites.extend((obj, key) for key in obj.attrs)
    f.visititems(visit)
    return sites


def edit_attribute(data: bytes, rng: random.Random) -> bytes:
    bio = io.BytesIO(data)
    with h5py.File(bio, "r+") as f:
        obj, name = rng.choice(attribute_sites(f))
        if rng.random() < 0.15:
            del obj.attrs[name]
        else:
            obj.attrs[name] = rng.choice(ATTR_VALUES)
    return bio.getvalue()


def edit_index(data: bytes, rng: random.Random) -> bytes:
    bio = io.BytesIO(data)
    with h5py.File(bio, "r+") as f:
        index = f["index"]
        column = rng.choice(list(index))
        ds = index[column]
        row = rng.randrange(ds.shape[0])
        values = ds[...]
        if column == "path":
            other = values[rng.randrange(len(values))]
            values[row] = rng.choice([b"", b"x", other, b"\xff\xfe", b"a" * 300])
        elif column == "dtype":
            values[row] = rng.choice([b"float16", b"object", b"float64", b"float32", b""])
        elif column == "shape":
            values[row, rng.randrange(values.shape[1])] = rng.choice(INT_VALUES)
        else:
            # a uint8 column (a state marker such as momentum_initialized) holds 0..255
            values[row] = rng.choice(INT_VALUES) if ds.dtype != np.uint8 \
                else rng.choice([0, 1, 2, 255])
        if rng.random() < 0.2:  # also a wrong row count
            values = values[:-1]
        del index[column]
        index.create_dataset(column, data=values, dtype=ds.dtype)
    return bio.getvalue()


def edit_data(data: bytes, rng: random.Random) -> bytes:
    """Change a buffer through HDF5 (fletcher32 recomputed, the CRC attribute not)."""
    bio = io.BytesIO(data)
    with h5py.File(bio, "r+") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset)
                     and n.startswith("groups/") and o.shape[0] else None)
        ds = f[rng.choice(names)]
        values = ds[...]
        values[rng.randrange(values.size)] += rng.choice([1.0, -1e-30, np.inf, np.nan])
        ds[...] = values
    return bio.getvalue()


def hostile(data: bytes, rng: random.Random, scratch) -> bytes:
    bio = io.BytesIO(data)
    with h5py.File(bio, "r+") as f:
        names = []
        f.visititems(lambda n, o: names.append("/" + n) if isinstance(o, h5py.Dataset)
                     and n.startswith("groups/") and o.shape[0] else None)
        name = rng.choice(names)
        length = f[name].shape[0]
        attrs = dict(f[name].attrs)
        choice = rng.randrange(7)
        del f[name]
        if choice == 0:
            f.create_dataset(name, shape=(length,), dtype="<f4",
                             external=[(scratch, 0, length * 4)])
        elif choice == 1:
            layout = h5py.VirtualLayout(shape=(length,), dtype="<f4")
            layout[:] = h5py.VirtualSource(scratch + ".missing.h5", "x", shape=(length,))
            f.create_virtual_dataset(name, layout, fillvalue=0)
        elif choice == 2:
            f[name] = h5py.SoftLink(rng.choice(names))
        elif choice == 3:
            f[name] = h5py.ExternalLink(scratch, "/x")
        elif choice == 4:
            f.create_dataset(name, shape=(length,), dtype=rng.choice(
                [h5py.string_dtype(), np.dtype([("a", "<f4")]), "<i8", ">f8", "u1"]))
        elif choice == 5:
            n = rng.choice([2 ** 62, length + 1, 0, length])
            f.create_dataset(name, shape=(n,), dtype="<f4", chunks=(min(n, 16),) if n else None)
        else:
            f.create_group(name).attrs["x"] = 1
        obj = f.get(name) if choice not in (2, 3) else None
        if obj is not None:
            for key, value in attrs.items():
                obj.attrs[key] = value
    return bio.getvalue()


def mutate(data: bytes, rng: random.Random, scratch) -> tuple[str, bytes, bool]:
    """(description, mutated bytes, resealed?)"""
    roll = rng.random()
    if roll < 0.40:
        damaged = bytearray(data)
        flips = rng.choice([1, 1, 1, 2, 4])
        for _ in range(flips):
            damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        return f"{flips} bit flips", bytes(damaged), False
    if roll < 0.52:
        cut = rng.randrange(len(data))
        tail = bytes(rng.randrange(256) for _ in range(rng.choice([0, 0, 8, 100])))
        return f"truncated at {cut}", data[:cut] + tail, False
    if roll < 0.60:
        damaged = bytearray(data)
        start = rng.randrange(len(damaged))
        run = rng.randrange(1, 64)
        damaged[start:start + run] = bytes(rng.randrange(256) for _ in range(run))[
            :len(damaged) - start]
        return f"random bytes at {start}", bytes(damaged), False
    seal = rng.random() < 0.6
    if roll < 0.73:
        out = edit_attribute(data, rng)
        what = "attribute edit"
    elif roll < 0.86:
        out = edit_index(data, rng)
        what = "index edit"
    elif roll < 0.93:
        out, seal = edit_data(data, rng), False
        what = "data edit"
    else:
        out, seal = hostile(data, rng, scratch), True
        what = "hostile construct"
    if seal:
        try:
            out = reseal(out)
        except Exception:
            seal = False  # too broken to reseal; still a damaged file to load
    return what + (" (resealed)" if seal else ""), out, seal


@pytest.mark.parametrize("kind", optimizers.cases("test_fuzzed_checkpoints_never_load_wrong",
                                                  slow_beyond_representatives=2))
def test_fuzzed_checkpoints_never_load_wrong(kind, tmp_path):
    hyper = INFO[kind].every_slot
    source = make_opt(kind, steps=3, **hyper)
    path = tmp_path / "ck.h5"
    flatopt.save(path, source, metadata={"epoch": 3})
    data = path.read_bytes()
    scratch = str(tmp_path / "scratch.bin")
    with open(scratch, "wb") as handle:
        handle.write(os.urandom(1 << 16))
    target = make_opt(kind, seed=7, steps=2, **hyper)
    original = snapshot(target)
    assert not state_equal(source, target)

    rng = random.Random(1234 + len(kind))
    outcomes: dict[str, int] = {}
    start = time.perf_counter()
    cases = max(200, CASES // len(NAMES))
    for case in range(cases):
        what, mutated, sealed = mutate(data, rng, scratch)
        try:
            flatopt.load(mutated, target)
        except flatopt.CheckpointError as exc:
            assert same_snapshot(original, snapshot(target)), \
                f"case {case} ({what}): the optimizer changed before {type(exc).__name__}"
            outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
            continue
        except Exception as exc:  # pragma: no cover - the failure being tested for
            pytest.fail(f"case {case} ({what}): {type(exc).__name__}: {exc}")
        if not sealed:
            assert state_equal(source, target), f"case {case} ({what}): loaded wrong values"
        outcomes["loaded"] = outcomes.get("loaded", 0) + 1
        restore(target, original)
        assert same_snapshot(original, snapshot(target))
    elapsed = time.perf_counter() - start
    print(f"{kind}: {cases} cases in {elapsed:.1f} s: {outcomes}")
    assert outcomes.get("CheckpointCorrupt", 0) > cases // 2
