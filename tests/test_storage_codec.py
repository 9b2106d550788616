"""The storage codec's scalar primitives (``kernels/storage.py``) against their oracles:
ml_dtypes' bfloat16 and numpy's float16 casts, bitsandbytes' dynamic maps and its CPU
blockwise quantization, and statistics for stochastic rounding and the counter-based hash."""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import flatopt
from flatopt import _codec
from flatopt.kernels import arithmetic, storage


def _compile(primitives=None, decorate=njit(inline="always", error_model="numpy")):
    """storage.py's functions compiled as a backend compiles them: each over a namespace in
    which the module's other functions are compiled too (``kernels/_bind.py``)."""
    namespace = {**vars(storage), **(primitives or {})}
    compiled = {}
    for name, function in vars(storage).items():
        if isinstance(function, types.FunctionType) and function.__module__ == storage.__name__:
            clone = types.FunctionType(function.__code__, namespace, function.__name__,
                                       function.__defaults__, function.__closure__)
            compiled[name] = decorate(clone) if decorate else clone
    namespace.update(compiled)
    return compiled


C = _compile()
f32_bits = njit(inline="always")(lambda x: arithmetic.f32_bits(x))
bf16_decode = C["bf16_decode"]
bf16_nearest = C["bf16_encode_nearest"]
bf16_stochastic = C["bf16_encode_stochastic"]
f16_decode = C["f16_decode"]
f16_nearest = C["f16_encode_nearest"]
f16_stochastic = C["f16_encode_stochastic"]
mix32 = C["mix32"]
mix32_at = C["mix32_at"]
mix32_key = C["mix32_key"]
q8_encode = C["q8_encode"]
q8_code = C["q8_code"]
q8_scale = C["q8_scale"]
q8_decode = C["q8_decode"]
q8_encode_block = C["q8_encode_block"]
q8_decode_block = C["q8_decode_block"]
q8_block_absmax = C["q8_block_absmax"]

F32_MAX_BITS = 0x7F7FFFFF


@njit(error_model="numpy")
def bits_roundtrip(x, bits, back):
    for i in range(x.size):
        bits[i] = arithmetic.f32_bits(x[i])
        back[i] = arithmetic.f32_from_bits(bits[i])


@njit(error_model="numpy")
def decode_all(u, bf16, out):
    for i in range(u.size):
        out[i] = bf16_decode(u[i]) if bf16 else f16_decode(u[i])


@njit(error_model="numpy")
def nearest_all(x, bf16, out):
    for i in range(x.size):
        out[i] = bf16_nearest(x[i]) if bf16 else f16_nearest(x[i])


@njit(error_model="numpy")
def stochastic_all(x, r, bf16, out):
    for i in range(x.size):
        out[i] = bf16_stochastic(x[i], r[i]) if bf16 else f16_stochastic(x[i], r[i])


@njit(error_model="numpy")
def draws(seed, step, stream, n, out):
    for i in range(n):
        out[i] = mix32(seed, step, stream, np.uint64(i))


@njit(error_model="numpy")
def stochastic_mean(value, bf16, seed, n):
    """The mean of ``n`` stochastic roundings of ``value`` (float64 accumulation)."""
    total = 0.0
    for i in range(n):
        r = mix32(seed, np.uint64(7), np.uint64(3), np.uint64(i))
        if bf16:
            total += bf16_decode(bf16_stochastic(value, r))
        else:
            total += f16_decode(f16_stochastic(value, r))
    return total / n


@njit(error_model="numpy")
def quantize(x, signed, codes, absmax):
    """bitsandbytes' quantize_blockwise(x, blocksize=256) with the block helper."""
    for b in range(absmax.size):
        start = b * storage.BLOCK
        stop = min(start + storage.BLOCK, x.size)
        absmax[b] = q8_encode_block(x, start, stop, codes, start, signed)


@njit(error_model="numpy")
def quantize_elementwise(x, signed, codes, absmax, normalized):
    """The same with the element functions: both call forms of q8_encode."""
    for b in range(absmax.size):
        start = b * storage.BLOCK
        stop = min(start + storage.BLOCK, x.size)
        largest = q8_block_absmax(x, start, stop)
        absmax[b] = largest
        scale = q8_scale(largest)
        for i in range(start, stop):
            codes[i] = q8_encode(x[i], largest, signed)
            normalized[i] = q8_encode(x[i] * scale, signed)


@njit(error_model="numpy")
def dequantize(codes, table, absmax, out, elementwise):
    for b in range(absmax.size):
        start = b * storage.BLOCK
        stop = min(start + storage.BLOCK, codes.size)
        if elementwise:
            for i in range(start, stop):
                out[i] = q8_decode(codes[i], table, absmax[b])
        else:
            q8_decode_block(codes, start, stop, table, absmax[b], out, start)


@njit(error_model="numpy")
def codes_of(v, signed, out):
    for i in range(v.size):
        out[i] = q8_code(v[i], signed)


def _float32_sample(n, seed=0):
    """float32 values of every kind: random bit patterns (all exponents, subnormals, inf and
    NaN), log-uniform magnitudes over the 16-bit ranges, and edge cases."""
    rng = np.random.default_rng(seed)
    random_bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    magnitudes = np.exp2(rng.uniform(-30, 18, n)).astype(np.float32)
    signs = np.where(rng.random(n) < 0.5, -1, 1).astype(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0, 65504.0,
                      65519.996, 65520.0, 65536.0, 6.1035156e-05, 5.9604645e-08,
                      2.9802322e-08, 2.9802326e-08, 1e-45, -1e-45, 1.1754942e-38,
                      3.4028235e38, -3.4028235e38, 3.3895314e38, 3.3961776e38],
                     dtype=np.float32)
    return np.concatenate([random_bits.view(np.float32), magnitudes * signs, edges])


def _bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def test_bit_casts_are_exact_and_match_the_simulated_versions():
    x = _float32_sample(10_000)
    bits = np.empty(x.size, np.uint32)
    back = np.empty(x.size, np.float32)
    bits_roundtrip(x, bits, back)
    assert np.array_equal(bits, _bits(x))
    assert np.array_equal(_bits(back), _bits(x))  # NaN payloads too
    for value, pattern in zip(x[:200], bits[:200]):
        assert arithmetic.simulated_f32_bits(value) == pattern
        assert _bits(arithmetic.simulated_f32_from_bits(pattern)) == pattern


@pytest.mark.parametrize("bf16", [True, False], ids=["bfloat16", "float16"])
def test_decode_every_pattern(bf16):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    u = np.arange(2 ** 16, dtype=np.uint16)
    out = np.empty(u.size, np.float32)
    decode_all(u, bf16, out)
    expected = u.view(ml_dtypes.bfloat16 if bf16 else np.float16).astype(np.float32)
    assert np.array_equal(_bits(out), _bits(expected))


def _halfway_cases(bf16):
    """float32 values halfway between neighbouring 16-bit values, and one ulp either side."""
    u = np.arange(0x7C00 if not bf16 else 0x7F80, dtype=np.uint32)
    if bf16:
        mid = (u << 16) | 0x8000
    else:
        lo = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
        hi = np.arange(1, 0x7C01, dtype=np.uint16).view(np.float16).astype(np.float64)
        hi[-1] = 65536.0
        mid = _bits(((lo + hi) / 2).astype(np.float32))
    mid = np.concatenate([mid, mid - 1, mid + 1]).astype(np.uint32)
    values = mid.view(np.float32)
    return np.concatenate([values, -values])


@pytest.mark.parametrize("bf16", [True, False], ids=["bfloat16", "float16"])
def test_nearest_matches_the_reference_cast(bf16):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.concatenate([_float32_sample(1_000_000, seed=1), _halfway_cases(bf16)])
    out = np.empty(x.size, np.uint16)
    nearest_all(x, bf16, out)
    with np.errstate(all="ignore"):
        expected = x.astype(ml_dtypes.bfloat16 if bf16 else np.float16).view(np.uint16)
    mismatch = np.nonzero(out != expected)[0]
    assert mismatch.size == 0, [(hex(_bits(x[i])), hex(out[i]), hex(expected[i]))
                                for i in mismatch[:10]]


def _neighbours(x, bf16):
    """The 16-bit patterns just below and just above ``|x|`` in magnitude (sign kept), from
    the truncation of ``x``; for exact values both are the value itself."""
    if bf16:
        low = (_bits(x) >> 16).astype(np.uint32)
        exact = (_bits(x) & 0xFFFF) == 0
    else:
        with np.errstate(all="ignore"):
            near = x.astype(np.float16)
        back = near.astype(np.float32)
        low = near.view(np.uint16).astype(np.uint32)
        exact = back == x
        low = np.where(np.abs(back) > np.abs(x), low - 1, low)
    high = np.where(exact, low, low + 1)
    return low, high


@pytest.mark.parametrize("bf16", [True, False], ids=["bfloat16", "float16"])
def test_stochastic_gives_a_neighbour_and_keeps_exact_values(bf16):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    sixteen = ml_dtypes.bfloat16 if bf16 else np.float16
    rng = np.random.default_rng(2)
    x = _float32_sample(300_000, seed=3)
    finite = x[np.isfinite(x)]
    if not bf16:  # within the half range: beyond 65536 is inf, checked below
        finite = finite[np.abs(finite) < 65504]
    r = rng.integers(0, 2 ** 32, finite.size, dtype=np.uint64).astype(np.uint32)
    out = np.empty(finite.size, np.uint16)
    stochastic_all(finite, r, bf16, out)
    low, high = _neighbours(finite, bf16)
    assert np.all((out == low) | (out == high))
    # exact values, with every kind of random bits, stay exact
    exact = np.arange(2 ** 16, dtype=np.uint16).view(sixteen).astype(np.float32)
    exact = exact[np.isfinite(exact)]
    for fill in (0, 0xFFFFFFFF, 0x7FFF, 0x1234ABCD):
        out = np.empty(exact.size, np.uint16)
        stochastic_all(exact, np.full(exact.size, fill, np.uint32), bf16, out)
        assert np.array_equal(out, exact.astype(sixteen).view(np.uint16))
    # NaN stays NaN (the nearest cast's), inf stays inf, finite never becomes NaN
    special = np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32)
    special = np.concatenate([special, np.array([0x7F800001, 0xFFFFFFFF], np.uint32)
                              .view(np.float32)])
    for fill in (0, 0xFFFFFFFF):
        out = np.empty(special.size, np.uint16)
        stochastic_all(special, np.full(special.size, fill, np.uint32), bf16, out)
        nearest = np.empty(special.size, np.uint16)
        nearest_all(special, bf16, nearest)
        assert np.array_equal(out, nearest)
    big = np.array([3.4028235e38, -3.4028235e38, 3.3961776e38, 65504.5, 65535.996, 65536.0,
                    1e30, -70000.0], np.float32)
    for fill in (0, 0xFFFFFFFF, 0xFFFF, 0x1FFF):
        out = np.empty(big.size, np.uint16)
        stochastic_all(big, np.full(big.size, fill, np.uint32), bf16, out)
        assert not np.isnan(out.view(sixteen).astype(np.float32)).any()
    if not bf16:
        out = np.empty(3, np.uint16)
        stochastic_all(np.array([65536.0, -1e30, 65520.0], np.float32),
                       np.array([0, 0, 0], np.uint32), False, out)
        assert list(out) == [0x7C00, 0xFC00, 0x7BFF]


@pytest.mark.parametrize("bf16", [True, False], ids=["bfloat16", "float16"])
def test_stochastic_rounding_is_unbiased(bf16):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    sixteen = ml_dtypes.bfloat16 if bf16 else np.float16
    n = 200_000
    bases = [1.0, -3.0, 1000.0, 2.0 ** -20] + ([1e-30, 3e35] if bf16 else [6e-8, 1e-5, 65000.0])
    for base in bases:
        low = np.array([base], np.float32).astype(sixteen)
        pattern = low.view(np.uint16)[0]
        high = np.array([pattern + 1], np.uint16).view(sixteen).astype(np.float64)[0]
        low = float(low.astype(np.float64)[0])
        gap = high - low
        for fraction in (0.5, 0.1, 0.77, 1 / 3, 0.003):
            value = np.float32(low + fraction * gap)
            p = (float(value) - low) / gap
            mean = stochastic_mean(value, bf16, np.uint64(11), n)
            sigma = abs(gap) * np.sqrt(max(p * (1 - p), 1e-12) / n)
            assert abs(mean - float(value)) <= 5 * sigma + 1e-12 * abs(gap), (
                base, fraction, mean, float(value), sigma)


def test_mix32_is_deterministic_uniform_and_uncorrelated():
    n = 1_000_000
    a = np.empty(n, np.uint32)
    b = np.empty(n, np.uint32)
    draws(np.uint64(1234), np.uint64(5), np.uint64(2), n, a)
    draws(np.uint64(1234), np.uint64(5), np.uint64(2), n, b)
    assert np.array_equal(a, b)
    low = (a & 0xFFFF).astype(np.float64) / 65536
    assert abs(low.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    assert abs(low.var() - 1 / 12) < 0.002
    assert np.histogram(a & 0xFF, bins=256, range=(0, 256))[0].min() > n / 256 * 0.9
    draws(np.uint64(1234), np.uint64(6), np.uint64(2), n, b)  # the next step
    later = (b & 0xFFFF).astype(np.float64) / 65536
    assert abs(np.corrcoef(low, later)[0, 1]) < 5 / np.sqrt(n)
    assert abs(np.corrcoef(low[:-1], low[1:])[0, 1]) < 5 / np.sqrt(n)  # neighbours
    high = (a >> 16).astype(np.float64) / 65536
    assert abs(high.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    for seed, step, stream in ((1235, 5, 2), (1234, 5, 3), (0, 0, 0)):
        draws(np.uint64(seed), np.uint64(step), np.uint64(stream), n, b)
        assert (a == b).mean() < 1e-4
    # the same bits from Python (the CUDA simulator)
    simulated = _compile({"f32_bits": arithmetic.simulated_f32_bits,
                          "f32_from_bits": arithmetic.simulated_f32_from_bits,
                          "hash32": arithmetic.portable_hash32}, decorate=None)
    with np.errstate(over="ignore"):
        for i in (0, 1, 777, n - 1):
            assert simulated["mix32"](np.uint64(1234), np.uint64(5), np.uint64(2),
                                      np.uint64(i)) == a[i]


@njit
def _hash32_all(lo, hi, out):
    for i in range(lo.size):
        out[i] = arithmetic.hash32(lo[i], hi[i])


def test_hash32_is_lowbias32_and_portable_gives_its_bits():
    """The CPU's 32-bit intrinsic, its plain version (CUDA, the simulator) and lowbias32
    written out in Python integers agree, for words given as 64-bit integers too."""
    rng = np.random.default_rng(4)
    lo = rng.integers(0, 2 ** 64, 2000, dtype=np.uint64)
    hi = rng.integers(0, 2 ** 64, 2000, dtype=np.uint64)
    out = np.empty(lo.size, np.uint32)
    _hash32_all(lo, hi, out)
    for a, b, got in zip(lo[:300], hi[:300], out[:300]):
        x = (int(a) ^ (int(b) * 0x9E3779B9)) & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * 0x846CA68B) & 0xFFFFFFFF
        assert int(got) == x ^ (x >> 16)
        assert arithmetic.portable_hash32(a, b) == got


@pytest.mark.parametrize("wrap_at", [300, 2048, 2990, 5000])
def test_the_cpu_walk_draws_mix32_at_across_a_low_word_wrap(monkeypatch, wrap_at):
    """The CPU walk's stochastic stores hash 32-bit words (``kernels/coded.py``'s
    ``_draw_words`` cuts a span where the low word of ``key + index`` wraps): the stored bits
    are ``mix32_at`` of each element's index, also past the carry into the high word. The
    buffer's ``base`` (a ZeRO-1 range's first element) is set so that the low word wraps at
    element ``wrap_at``: inside a sub-block, at its end, in the last one, or not at all."""
    n, seed = 3000, 7
    rng = np.random.default_rng(4)
    start = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    grads = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    key = mix32_key(np.uint64(seed), np.uint64(1), np.uint64(0))  # draw 1, stream 0: params
    base = np.uint64((2 ** 32 - (int(key) & 0xFFFFFFFF) - wrap_at) % 2 ** 32)
    plan = _codec.coded_plan
    monkeypatch.setattr(_codec, "coded_plan", lambda *a, **k: plan(*a, **k)._replace(base=base))
    opt = flatopt.AdamW({"w": start.copy()}, lr=1e-2, rounding="stochastic", seed=seed)
    exact = flatopt.AdamW({"w": start.astype(np.float32)}, lr=1e-2)  # the update in float32
    for o in (opt, exact):
        o.grads["w"][...] = grads
        o.grads.mark_present()
        o.step()
    assert opt.buffers[0].draws == 1  # the first step's draw
    want = _stochastic_bits(exact.params["w"], key, base)
    np.testing.assert_array_equal(opt.params["w"].view(np.uint16), want)
    crosses = ((int(key) + int(base)) & 0xFFFFFFFF) + n >= 2 ** 32
    assert crosses == (wrap_at < n)


@njit(error_model="numpy")
def _stochastic_bits(x, key, first):
    out = np.empty(x.size, np.uint16)
    for i in range(x.size):
        out[i] = bf16_stochastic(x[i], mix32_at(key, first + np.uint64(i)))
    return out


def test_simulated_primitives_give_the_same_bits():
    """The plain Python functions, with the simulator's bit casts, as the compiled ones."""
    simulated = _compile({"f32_bits": arithmetic.simulated_f32_bits,
                          "f32_from_bits": arithmetic.simulated_f32_from_bits,
                          "hash32": arithmetic.portable_hash32}, decorate=None)
    x = _float32_sample(300, seed=9)
    r = np.random.default_rng(9).integers(0, 2 ** 32, x.size, dtype=np.uint64).astype(np.uint32)
    for bf16, nearest, stochastic, decode in (
            (True, "bf16_encode_nearest", "bf16_encode_stochastic", "bf16_decode"),
            (False, "f16_encode_nearest", "f16_encode_stochastic", "f16_decode")):
        near = np.empty(x.size, np.uint16)
        nearest_all(x, bf16, near)
        sto = np.empty(x.size, np.uint16)
        stochastic_all(x, r, bf16, sto)
        back = np.empty(x.size, np.float32)
        decode_all(near, bf16, back)
        for i in range(x.size):
            assert simulated[nearest](x[i]) == near[i]
            assert simulated[stochastic](x[i], r[i]) == sto[i]
            assert _bits(simulated[decode](near[i])) == _bits(back[i])
    v = np.linspace(-1, 1, 301).astype(np.float32)
    codes = np.empty(v.size, np.uint8)
    codes_of(v, True, codes)
    assert [simulated["q8_code"](value, True) for value in v] == list(codes)


# --- 8-bit blockwise quantization against bitsandbytes ---------------------------------------

def _bnb():
    pytest.importorskip("torch")
    return pytest.importorskip("bitsandbytes.functional")


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_dynamic_maps_equal_bitsandbytes(signed):
    functional = _bnb()
    expected = functional.create_dynamic_map(signed=signed).numpy()
    table = storage.DYNAMIC_SIGNED if signed else storage.DYNAMIC_UNSIGNED
    assert table.dtype == np.float32 and table.shape == (256,)
    assert np.array_equal(_bits(table), _bits(expected))


def _bnb_quantize(functional, x, signed):
    import torch
    code = functional.create_dynamic_map(signed=signed)
    codes, state = functional.quantize_blockwise(torch.from_numpy(x.copy()), code=code,
                                                 blocksize=storage.BLOCK)
    out = functional.dequantize_blockwise(codes, absmax=state.absmax.clone(),
                                          code=functional.create_dynamic_map(signed=signed),
                                          blocksize=storage.BLOCK)
    return codes.numpy(), state.absmax.numpy(), out.numpy()


def _blocks(signed, seed):
    """Test data for 8-bit blocks: random values of many scales, zero blocks, exact code
    values and midpoints between codes (times a scale), and a partial last block."""
    rng = np.random.default_rng(seed)
    table = storage.DYNAMIC_SIGNED if signed else storage.DYNAMIC_UNSIGNED
    parts = []
    for scale in (1e-30, 1e-8, 1e-3, 1.0, 37.5, 1e4, 1e30):
        parts.append((rng.standard_normal(256 * 40) * scale).astype(np.float32))
        parts.append((rng.standard_t(2, 256 * 20) * scale).astype(np.float32))
    parts.append(np.zeros(256 * 3, np.float32))
    parts.append(np.concatenate([np.zeros(255, np.float32), [np.float32(-0.0)]]))
    mids = ((table[:-1].astype(np.float64) + table[1:]) / 2).astype(np.float32)
    for absmax in (1.0, 3.0, 0.125, 7.3e-5):
        for values in (table, mids, np.nextafter(mids, np.float32(np.inf)),
                       np.nextafter(mids, np.float32(-np.inf))):
            block = np.zeros(256, np.float32)
            block[0] = absmax
            block[1:] = rng.permutation(np.resize(values, 255)) * np.float32(absmax)
            parts.append(block)
    if not signed:  # bitsandbytes' optimizers keep the second moment here: non-negative
        parts = [np.abs(p) for p in parts]
    parts.append(rng.standard_normal(100).astype(np.float32))  # partial block, any sign
    return np.concatenate(parts)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_matches_bitsandbytes(signed):
    functional = _bnb()
    x = _blocks(signed, seed=4 if signed else 5)
    expected_codes, expected_absmax, expected_values = _bnb_quantize(functional, x, signed)
    blocks = -(-x.size // storage.BLOCK)
    codes = np.empty(x.size, np.uint8)
    absmax = np.empty(blocks, np.float32)
    quantize(x, signed, codes, absmax)
    assert np.array_equal(_bits(absmax), _bits(expected_absmax))
    mismatch = np.nonzero(codes != expected_codes)[0]
    assert mismatch.size == 0, [(x[i], codes[i], expected_codes[i]) for i in mismatch[:10]]
    again = np.empty(x.size, np.uint8)
    normalized = np.empty(x.size, np.uint8)
    quantize_elementwise(x, signed, again, absmax, normalized)
    assert np.array_equal(again, codes) and np.array_equal(normalized, codes)
    table = storage.DYNAMIC_SIGNED if signed else storage.DYNAMIC_UNSIGNED
    for elementwise in (True, False):
        values = np.empty(x.size, np.float32)
        dequantize(codes, table, absmax, values, elementwise)
        assert np.array_equal(_bits(values), _bits(expected_values))
    zero_blocks = np.nonzero(absmax == 0)[0]
    assert zero_blocks.size >= 4
    for b in zero_blocks:
        assert (codes[b * 256:(b + 1) * 256] == 0).all()


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_codes_at_every_threshold_match_bitsandbytes(signed):
    """The normalized values where the code changes, and one ulp below: in blocks whose
    absmax is 1 they reach bitsandbytes' kernel unchanged."""
    functional = _bnb()
    kind = 0 if signed else 1
    thresholds = storage._Q8_THRESHOLDS[kind]
    thresholds = thresholds[np.isfinite(thresholds)]
    v = np.concatenate([thresholds, np.nextafter(thresholds, np.float32(-np.inf)),
                        np.nextafter(thresholds, np.float32(np.inf)),
                        np.float32([-1, 1, 0, -0.0, 1e-30, -1e-30])])
    v = v[np.abs(v) <= 1]
    per_block = 255
    blocks = -(-v.size // per_block)
    x = np.zeros((blocks, 256), np.float32)
    x[:, 0] = 1.0
    x.reshape(-1)[np.arange(v.size) // per_block * 256 + 1 + np.arange(v.size) % per_block] = v
    expected, _, _ = _bnb_quantize(functional, x.reshape(-1), signed)
    codes = np.empty(x.size, np.uint8)
    absmax = np.empty(blocks, np.float32)
    quantize(x.reshape(-1), signed, codes, absmax)
    assert np.array_equal(codes, expected)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_codes_equal_the_table_walk_of_bitsandbytes(signed):
    """q8_code against storage's numpy model of bitsandbytes' 65536-entry LUT, over dense
    normalized values (the model itself is checked against bitsandbytes above)."""
    rng = np.random.default_rng(6)
    table = storage.DYNAMIC_SIGNED if signed else storage.DYNAMIC_UNSIGNED
    lut = storage._bnb_lut(table)
    v = np.concatenate([
        rng.uniform(-1, 1, 1_000_000).astype(np.float32),
        (np.exp2(rng.uniform(-40, 0, 500_000)) * np.where(rng.random(500_000) < 0.5, -1, 1))
        .astype(np.float32),
        np.float32([np.nan, np.inf, -np.inf, 2.0, -2.0, 1.0, -1.0, 0.0, -0.0]),
    ])
    out = np.empty(v.size, np.uint8)
    codes_of(v, signed, out)
    assert np.array_equal(out, storage._bnb_code(v, lut))


q8_lut_index = C["q8_lut_index"]


@njit(error_model="numpy")
def lut_indices(v, out):
    for i in range(v.size):
        out[i] = q8_lut_index(v[i])


def test_lut_index_is_bitsandbytes_formula_on_every_32nd_float32():
    """q8_lut_index computes ``(c + 1) * 32767.5 + 0.5`` where bitsandbytes computes ``((c + 1)
    * 0.5f) * 65535 + 0.5f``: the same index for every float32 (NaN and infinities included),
    checked on every 32nd bit pattern (and the neighbours of the grid's edges) against the
    unfused formula in NumPy."""
    bits = np.arange(0, 1 << 32, 32, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x3F800000, 0xBF800000, 0x3F000000, 0x38000000, 0xB8000000], np.uint32)
    bits = np.concatenate([bits, (edges[:, None] + np.arange(-64, 65)).ravel().astype(np.uint32)])
    v = bits.view(np.float32)
    ours = np.empty(v.size, np.uint32)
    lut_indices(v, ours)
    np.testing.assert_array_equal(ours, storage._bnb_lut_index(v))


def test_encode_block_reads_the_padded_byte_table():
    """Codes read as the low byte of a 32-bit word (``byte_word``) equal the table's bytes,
    at the table's last entries too (the padding is read, never kept)."""
    assert storage.Q8_LUTS.dtype == np.uint8 and storage.Q8_LUTS.shape[1] >= (1 << 16) + 3
    x = np.array([1.0, -1.0, 0.999, -0.999, 0.0, 1e-3, -1e-3] + [0.5] * 249, np.float32)
    for signed in (True, False):
        codes = np.empty(x.size, np.uint8)
        absmax = np.empty(1, np.float32)
        quantize(x, signed, codes, absmax)
        lut = storage.Q8_LUTS[0 if signed else 1]
        np.testing.assert_array_equal(codes, lut[storage._bnb_lut_index(x / np.float32(1.0))])
