"""Property tests for checkpoints and state dicts of reduced-precision ("coded") optimizers.

Every storage mix compiles its own coded kernels (about 15 s each here), so the mixes are a
small FIXED set (one compile per coded layout, shared by every test of this file); what is
random, from seeded NumPy generators, is everything else: shapes, parameter values and their
scales (float16 subnormals included), hyperparameters, step counts (0 included), gradient
scales, gradients missing for some parameters some steps and int8 blocks of zeros.

Properties: whatever ``flatopt.save`` writes, ``flatopt.load`` accepts into an identically
built optimizer, and the two then step on with identical bytes in every buffer (parameters,
state as stored, block scales, master weights, Kahan compensation, the rounding stream's
counter); the same for ``state_dict()``/``load_state_dict`` and for a run of two coded
optimizers; ``flatopt.read`` gives the float32 values; a storage mismatch is refused by path and
both formats with the target left exactly as it was, and ``convert=True`` (file and state dict,
which agree) gives the source's float32 values within the target format's rounding.

``tests/test_checkpoint_precision.py`` holds the example-based tests (one AdamW per mode, a
fresh process, tampered files).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import flatopt
from flatopt.errors import CheckpointMismatch, CheckpointOptionError, StateDictError
from flatopt.kernels.storage import BLOCK, DYNAMIC_SIGNED, DYNAMIC_UNSIGNED
from test_checkpoint_precision import bits, stored as stored_bytes

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
AFTER = 2  # steps both optimizers take after the save / the load

# a family fixes the rule, the groups and their parameters' dtypes (mixes of one family convert
# into each other); each group draws (size, fewest, most) tensors of each size: "big" has
# >= 4,096 elements, where int8 state applies
FAMILIES = {
    "adamw": ("AdamW", {}, ((BF16, (("big", 1, 2),)), (F32, (("any", 1, 3),)))),
    "sgd": ("SGD", {"momentum": 0.9}, ((F16, (("any", 1, 3),)), (F16, (("small", 1, 2),)))),
    "lion": ("Lion", {}, ((F32, (("big", 1, 1), ("small", 1, 2))), (F32, (("any", 1, 2),)))),
}
# mix -> (family, per-group storage keys, optimizer storage keys); "SEED": a drawn seed.
# Five coded layouts in all, each compiled once.
MIXES = {
    # bf16 params rounded stochastically, bf16 state; a plain float32 group beside it (the
    # optimizer's seed is no part of that buffer's storage)
    "adamw_bf16_stochastic_bf16state": (
        "adamw", ({"rounding": "stochastic", "state_dtype": "bfloat16"}, {}), {"seed": "SEED"}),
    # bf16 params with Kahan compensation and int8 state; the other group float32
    "adamw_bf16_kahan_int8": (
        "adamw", ({"rounding": "kahan", "state_dtype": "int8"}, {}), {"seed": "SEED"}),
    # float16 params with float32 master weights and float32 gradients, two groups
    "sgd_f16_master_g32": ("sgd", ({}, {}), {"master_weights": True, "grad_dtype": "float32"}),
    # float16 params rounded stochastically (subnormals), bf16 momentum
    "sgd_f16_stochastic_bf16state": (
        "sgd", ({}, {}), {"rounding": "stochastic", "state_dtype": "bfloat16", "seed": "SEED"}),
    # float32 params: int8 state in group 0 (its small tensors keep float32 in a buffer of
    # their own), group 1 plain float32
    "lion_f32_int8": ("lion", ({"state_dtype": "int8"}, {}), {}),
    # the plain optimizer of the lion family (compiles nothing coded; a conversion partner)
    "lion_plain": ("lion", ({}, {}), {}),
}
CODED = [name for name in MIXES if name != "lion_plain"]
CONVERSIONS = [("adamw_bf16_stochastic_bf16state", "adamw_bf16_kahan_int8"),
               ("adamw_bf16_kahan_int8", "adamw_bf16_stochastic_bf16state"),
               ("sgd_f16_master_g32", "sgd_f16_stochastic_bf16state"),
               ("sgd_f16_stochastic_bf16state", "sgd_f16_master_g32"),
               ("lion_f32_int8", "lion_plain"),
               ("lion_plain", "lion_f32_int8")]
LR = {"AdamW": (1e-3, 3e-2), "SGD": (1e-2, 2e-1), "Lion": (1e-4, 3e-3)}


# ----------------------------------------------------------------------------- cases
def shape_draw(rng, size: str) -> tuple:
    if size == "big" or (size == "any" and rng.random() < 0.3):
        return ((int(rng.integers(4096, 6000)),) if rng.random() < 0.5
                else (64, int(rng.integers(64, 90))))
    return ((int(rng.integers(1, 700)),) if rng.random() < 0.5
            else (int(rng.integers(1, 20)), int(rng.integers(1, 60))))


def case(mix: str, seed: int) -> dict:
    """The random parts of a case: groups of {path: shape}, hyperparameters, values' seed,
    steps before the save; the same for every mix of a family."""
    family = MIXES[mix][0]
    name, extra, groups = FAMILIES[family]
    rng = np.random.default_rng([7, seed, list(FAMILIES).index(family)])
    shapes, k = [], 0
    for dtype, sizes in groups:
        group = {}
        for size, low, high in sizes:
            for _ in range(int(rng.integers(low, high + 1))):
                group[f"g{len(shapes)}.p{k}"] = (shape_draw(rng, size), dtype)
                k += 1
        shapes.append(group)
    lo, hi = LR[name]
    hypers = [{"lr": float(rng.uniform(lo, hi)),
               "weight_decay": float(rng.choice([0.0, 0.01, 0.1]))} for _ in shapes]
    if name == "AdamW":
        hypers[0]["betas"] = (float(rng.uniform(0.8, 0.95)), float(rng.uniform(0.95, 0.999)))
    if name == "Lion":
        hypers[-1]["betas"] = (float(rng.uniform(0.85, 0.95)), float(rng.uniform(0.95, 0.99)))
    return {"name": name, "extra": extra, "shapes": shapes, "hypers": hypers,
            "seed": seed, "storage_seed": int(rng.integers(0, 2**62)),
            "before": 0 if seed == 0 else int(rng.integers(1, 5))}


def build(mix: str, seed: int):
    c = case(mix, seed)
    _, group_keys, opt_keys = MIXES[mix]
    rng = np.random.default_rng([11, seed])
    groups = []
    for shapes, hypers, keys in zip(c["shapes"], c["hypers"], group_keys):
        params = {}
        for path, (shape, dtype) in shapes.items():
            scale = 10.0 ** rng.uniform(-3, 1)
            params[path] = (scale * rng.standard_normal(shape)).astype(dtype)
        groups.append({"params": params, **hypers, **keys})
    kwargs = {key: c["storage_seed"] if value == "SEED" else value
              for key, value in opt_keys.items()}
    return getattr(flatopt, c["name"])(groups, **c["extra"], **kwargs)


def gradients(opt, seed: int, step: int) -> dict:
    """Random gradients in the optimizer's gradient dtypes and of random scales; some paths
    missing, some with a run of zeros (up to two int8 blocks' worth)."""
    rng = np.random.default_rng([13, seed, step])
    out = {}
    for path in opt.index.paths:
        shape = opt.params[path].shape
        g = 10.0 ** rng.uniform(-4, 1) * rng.standard_normal(shape)
        flat = g.reshape(-1)
        if rng.random() < 0.2 and flat.size > 1:
            start = int(rng.integers(0, flat.size))
            flat[start:start + int(rng.integers(1, 2 * BLOCK))] = 0
        if rng.random() < 0.85 or (not out and path == opt.index.paths[-1]):
            out[path] = g.astype(opt.grads[path].dtype)
    return out


def run(opt, seed: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        opt.step(gradients(opt, seed, step))


# ----------------------------------------------------------------------------- comparisons
def stored(opt) -> dict:
    """Every stored array of every buffer as (dtype, bytes) (test_checkpoint_precision's
    ``stored`` gives the bytes), with each buffer's storage and rounding counter."""
    out = {}
    by_number = {buf.number: buf for buf in opt.buffers}
    for key, raw in stored_bytes(opt).items():
        number, name = key
        if name == "draws":
            out[key] = raw
            continue
        buf = by_number[number]
        flat = {"params": buf.params, "master": buf.master, "comp": buf.compensation,
                **buf.state}.get(name)
        dtype = flat.dtype.str if flat is not None else "<f4"  # "<slot>.absmax"
        out[key] = (dtype, raw)
    for buf in opt.buffers:
        out[buf.number, "storage"] = buf.storage
        out[buf.number, "paths"] = tuple(buf.paths)
    return out


def assert_same(a, b, where="state_dict"):
    """Nested dicts/lists/arrays/scalars identical (arrays: dtype, shape and bytes)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), b.keys())
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, \
            (where, a.dtype, b.dtype, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, (float, np.floating)) and np.isnan(a):
        assert np.isnan(b), where
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def snapshot(opt) -> tuple:
    return ({p: (opt.params[p].dtype, opt.params[p].shape) for p in opt.index.paths},
            bits(opt), stored(opt), opt.state_dict(), opt.settings())


def assert_same_optimizer(a, b) -> None:
    sa, sb = snapshot(a), snapshot(b)
    assert sa[0] == sb[0]
    for x, y, what in zip(sa[1:], sb[1:], ("params", "stored", "state_dict", "settings")):
        assert_same(x, y, what)


# ----------------------------------------------------------------------------- formats
def bf16_bracket(want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bfloat16 values at or either side of each float32 in ``want`` (as float32): its
    bits truncated towards zero, and one bfloat16 step further out (the same when exact)."""
    w = np.ascontiguousarray(want, np.float32).view(np.uint32)
    low = w & np.uint32(0xFFFF0000)
    high = np.where(low == w, low, low + np.uint32(0x10000))
    return low.view(np.float32), high.view(np.float32)


def assert_bf16_rounding(got, want, where):
    got = np.asarray(got, np.float32)
    assert np.array_equal(got.astype(BF16).astype(np.float32), got), where  # representable
    low, high = bf16_bracket(want)
    ok = (got == low) | (got == high)
    assert ok.all(), (where, want[~ok][:5], got[~ok][:5])


def assert_int8_rounding(absmax, got, want, nonnegative, where):
    """Blockwise dynamic 8-bit: each 256-element block's scale is its largest magnitude, and
    each value is one of the two map entries around it (bitsandbytes rounds on a 1/65535
    grid first, so a value within that of an entry may take the entry's neighbour)."""
    want = np.asarray(want, np.float32).reshape(-1)
    got = np.asarray(got, np.float32).reshape(-1)
    table = np.sort((DYNAMIC_UNSIGNED if nonnegative else DYNAMIC_SIGNED).astype(np.float64))
    n = want.size
    blocks = -(-n // BLOCK)
    assert absmax.shape == (blocks,), where
    for b in range(blocks):
        w = want[b * BLOCK:(b + 1) * BLOCK].astype(np.float64)
        g = got[b * BLOCK:(b + 1) * BLOCK].astype(np.float64)
        scale = np.abs(w).max()
        assert absmax[b] == np.float32(scale), (where, b, absmax[b], scale)
        if scale == 0:
            assert not g.any(), (where, b)
            continue
        x, y = w / scale, g / scale
        slack = 1.0 / 65535 + 1e-6
        below = table[np.clip(np.searchsorted(table, x - slack, side="right") - 1, 0, None)]
        above = table[np.clip(np.searchsorted(table, x + slack, side="left"),
                              None, table.size - 1)]
        ok = (y >= below - 1e-6) & (y <= above + 1e-6)
        assert ok.all(), (where, b, x[~ok][:5], y[~ok][:5])


def buffer_of(opt, path):
    for buf in opt.buffers:
        if path in buf.paths:
            return buf, buf.paths.index(path)
    raise KeyError(path)


def words(opt, path) -> str:
    """How ``path``'s buffer stores it, as refusals name it (a plain buffer: its dtype)."""
    buf = buffer_of(opt, path)[0]
    if buf.storage is None:
        return f"params {buf.dtype.name}, state {buf.dtype.name}"
    return buf.storage.describe()


# ----------------------------------------------------------------------------- 1. resume
@pytest.mark.parametrize("seed", (0, 1, 2))
@pytest.mark.parametrize("mix", CODED)
def test_save_load_read_resume_is_bit_exact(mix, seed, tmp_path):
    a = build(mix, seed)
    assert any(buf.coded for buf in a.buffers)
    before = case(mix, seed)["before"]
    run(a, seed, 0, before)
    path = flatopt.save(tmp_path / "ck.h5", a)
    b = build(mix, seed)
    flatopt.load(path, b)
    assert_same_optimizer(a, b)
    converted = build(mix, seed)  # convert=True changes nothing where the storage matches
    flatopt.load(path, converted, convert=True)
    assert_same_optimizer(a, converted)

    data = flatopt.read(path, state=True)
    for p in a.index.paths:
        assert data.params[p].dtype == np.float32, p
        np.testing.assert_array_equal(data.params[p], a.params[p].astype(np.float32), p)
        state = a.state_of(p)
        if state is None:
            assert p not in data.state, p
            continue
        for slot in a.schema.slots:
            value = getattr(state, slot, None)
            if value is not None:
                assert data.state[p][slot].dtype == np.float32, (p, slot)
                np.testing.assert_array_equal(data.state[p][slot], value, f"{p}.{slot}")

    run(a, seed, before, before + AFTER)
    run(b, seed, before, before + AFTER)
    assert_same_optimizer(a, b)


@pytest.mark.parametrize("seed", (3, 4))
@pytest.mark.parametrize("mix", CODED)
def test_state_dict_round_trip_resume_is_bit_exact(mix, seed):
    a = build(mix, seed)
    before = case(mix, seed)["before"]
    run(a, seed, 0, before)
    sd = a.state_dict()
    b = build(mix, seed)
    for path in b.index.paths:  # a state dict holds no parameters (torch's convention)
        b.params[path][...] = a.params[path]
    b.load_state_dict(sd)
    assert_same_optimizer(a, b)
    run(a, seed, before, before + AFTER)
    run(b, seed, before, before + AFTER)
    assert_same_optimizer(a, b)


def test_run_of_two_coded_optimizers_resumes_bit_exact(tmp_path):
    seed = 5
    names = ("adamw_bf16_kahan_int8", "sgd_f16_stochastic_bf16state")
    live = {name: build(name, seed) for name in names}
    for k, opt in enumerate(live.values()):
        run(opt, seed + k, 0, 2)
    target = flatopt.save(tmp_path / "run", live)

    # one member stored otherwise: the whole run is refused, every member left as it was
    other = {names[0]: build(names[0], seed), names[1]: build("sgd_f16_master_g32", seed)}
    for k, opt in enumerate(other.values()):
        run(opt, seed + 50 + k, 0, 1)
    unchanged = {name: snapshot(opt)[1:] for name, opt in other.items()}
    with pytest.raises(CheckpointMismatch, match="convert=True"):
        flatopt.load(target, other)
    with pytest.raises(CheckpointOptionError, match="one optimizer"):
        flatopt.load(target, other, convert=True)  # documented: convert is for one optimizer
    for name, opt in other.items():
        assert_same(unchanged[name], snapshot(opt)[1:], f"{name} after a refused run load")
    fresh = {name: build(name, seed) for name in names}
    flatopt.load(target, fresh)
    for k, name in enumerate(names):
        assert_same_optimizer(live[name], fresh[name])
        run(live[name], seed + k, 2, 2 + AFTER)
        run(fresh[name], seed + k, 2, 2 + AFTER)
        assert_same_optimizer(live[name], fresh[name])


@pytest.mark.parametrize("mix", CODED)
def test_ema_of_a_coded_optimizer_resumes_bit_exact(mix, tmp_path):
    """An EMA saved with a coded optimizer (its float32 averages, packed as the file's
    float32 view) comes back bit for bit, and both runs then average alike."""
    seed = 1
    a = build(mix, seed)
    ema = flatopt.EMA(a, decay=0.9)
    for k in range(2):
        run(a, seed, k, k + 1)
        ema.update()
    path = flatopt.save(tmp_path / "ck.h5", a, ema=ema)
    b = build(mix, seed)
    b_ema = flatopt.EMA(b, decay=0.5)
    flatopt.load(path, b, ema=b_ema)
    assert (b_ema.decay, b_ema.num_updates) == (ema.decay, ema.num_updates)
    for k in range(2, 2 + AFTER):
        for opt, average in ((a, ema), (b, b_ema)):
            run(opt, seed, k, k + 1)
            average.update()
    assert_same_optimizer(a, b)
    assert_same(ema.state_dict()["averages"], b_ema.state_dict()["averages"], "EMA averages")


# ----------------------------------------------------------------------------- 2. convert
@pytest.mark.parametrize("src,dst", CONVERSIONS)
def test_mismatch_refused_unchanged_then_converted(src, dst, tmp_path):
    seed = 6 + CONVERSIONS.index((src, dst))
    a = build(src, seed)
    before = max(1, case(src, seed)["before"])
    run(a, seed, 0, before)
    path = flatopt.save(tmp_path / "ck.h5", a)
    sd = a.state_dict()

    def target():
        b = build(dst, seed)
        rng = np.random.default_rng([17, seed])
        for p in b.index.paths:  # live values and state that differ from the file's
            b.params[p] = rng.standard_normal(b.params[p].shape).astype(b.params[p].dtype)
        run(b, seed + 100, 0, 1)
        return b

    b = target()
    unchanged = snapshot(b)
    differing = [p for p in a.index.paths if words(a, p) != words(b, p)]
    assert differing

    def assert_names_them(text):
        assert "convert=True" in text, text
        named = [p for p in a.index.paths
                 if re.search(rf"(^|\s)'?{re.escape(p)}'?:", text, re.MULTILINE)]
        assert set(named) == set(differing), (named, differing, text)
        for p in named:  # both formats, in words
            assert words(a, p) in text and words(b, p) in text, (words(a, p), words(b, p), text)

    with pytest.raises(CheckpointMismatch) as info:
        flatopt.load(path, b)
    assert str(path) in str(info.value), str(info.value)
    assert_names_them(str(info.value))
    assert_same(unchanged[1:], snapshot(b)[1:], "after a refused load")
    with pytest.raises(StateDictError) as info:
        b.load_state_dict(sd)
    assert_names_them(str(info.value))
    assert_same(unchanged[1:], snapshot(b)[1:], "after a refused load_state_dict")

    flatopt.load(path, b, convert=True)
    saved = flatopt.read(path, state=True)
    for p in b.index.paths:
        buf, slot = buffer_of(b, p)
        sbuf, sslot = buffer_of(a, p)
        # the best float32 value saved: the master copy, or the parameter plus its Kahan
        # compensation
        source = a.params[p].astype(np.float32)
        if sbuf.master is not None:
            source = sbuf.view(sbuf.master, sslot)
        elif sbuf.compensation is not None:
            source = source + sbuf.view(sbuf.compensation, sslot).astype(np.float32)
        # ... becomes the live one: equal where the formats agree
        np.testing.assert_array_equal(b.params[p].view(np.uint8),
                                      source.astype(b.params[p].dtype).view(np.uint8), p)
        if buf.master is not None:
            np.testing.assert_array_equal(buf.view(buf.master, slot), source, p)
        if buf.compensation is not None:  # what rounding it to nearest lost
            lost = (source - b.params[p].astype(np.float32)).astype(b.params[p].dtype)
            np.testing.assert_array_equal(buf.view(buf.compensation, slot).view(np.uint8),
                                          lost.view(np.uint8), p)
        state = b.state_of(p)
        if p not in saved.state:  # not stepped before the save: the live state is gone
            assert state is None, p
            continue
        for key, want in saved.state[p].items():
            got = getattr(state, key)
            if key not in b.schema.slots:
                assert np.asarray(got) == np.asarray(want), (p, key, got, want)
                continue
            where = f"{p}.{key}"
            kind = buf.storage.state if buf.storage is not None else "float32"
            if kind == "float32":
                np.testing.assert_array_equal(got, want, where)
            elif kind == "bfloat16":
                assert_bf16_rounding(got, want, where)
            else:
                first = int(buf.offsets[slot]) // BLOCK
                absmax = buf.absmax[key][first:first + -(-want.size // BLOCK)]
                assert_int8_rounding(absmax, got, want,
                                     b.schema.slots[key].nonnegative, where)

    # load_state_dict(convert=True) converts the same way
    c = target()
    for p in c.index.paths:  # a state dict holds no parameters: the saved ones, copied in
        c.params[p] = a.params[p].astype(c.params[p].dtype)
    c.load_state_dict(sd, convert=True)
    assert_same(stored(b), stored(c), "file convert vs state dict convert")
    assert_same(b.state_dict(), c.state_dict())

    # the converted optimizer steps on, and what it saves loads bit for bit
    run(b, seed, before, before + 1)
    assert all(np.isfinite(b.params[p].astype(np.float32)).all() for p in b.index.paths)
    again = flatopt.save(tmp_path / "again.h5", b)
    d = build(dst, seed)
    flatopt.load(again, d)
    assert_same_optimizer(b, d)


def test_mixes_cover_the_formats():
    """The fixed mixes reach what the module docstring promises: three rules, both 16-bit
    parameter dtypes, every rounding, master weights, float32 gradients, bfloat16 and int8
    state, a small tensor's float32 state beside int8, plain float32 buffers beside coded
    ones in a seeded optimizer."""
    seen = set()
    for mix in CODED:
        opt = build(mix, 1)
        seen.add(type(opt).__name__)
        coded = [buf for buf in opt.buffers if buf.coded]
        plain = [buf for buf in opt.buffers if not buf.coded]
        if coded and plain:
            seen.add("plain beside coded")
        for buf in coded:
            s = buf.storage
            seen |= {s.param.name, f"state {s.state}", f"grads {s.grad.name}",
                     "master" if s.master else f"rounding {s.rounding}"}
        states = {}  # group -> the states its buffers keep
        for buf in opt.buffers:
            states.setdefault(buf.group, set()).add(buf.storage.state if buf.coded
                                                    else "plain")
        if any("int8" in g for g in states.values()):
            if any(g == {"plain"} for g in states.values()):
                seen.add("int8 group beside a plain group")
            if any({"int8", "plain"} <= g for g in states.values()):
                seen.add("small tensors' float32 state beside int8")
    wanted = {"AdamW", "SGD", "Lion", "bfloat16", "float16", "float32", "state int8",
              "state bfloat16", "master", "grads float32", "rounding stochastic",
              "rounding kahan", "plain beside coded", "int8 group beside a plain group",
              "small tensors' float32 state beside int8"}
    assert wanted <= seen, wanted - seen
