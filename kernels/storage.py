"""Scalar primitives of the storage codec: reduced-precision formats of optimizer buffers.

Plain functions, like the rule helpers in ``rules/``: each backend compiles them (Numba
``njit(inline="always", error_model="numpy")`` on the CPU, ``cuda.jit(device=True)`` on a
GPU), and they call the bit casts ``f32_bits`` / ``f32_from_bits`` and the 32-bit hash
``hash32`` of ``arithmetic.py`` by name, which a backend may rebind (the CUDA simulator binds
the ``simulated_`` and ``portable_`` versions).
Everything inside stays float32 / fixed-width unsigned integers; the tables below are small
module-level numpy arrays, which Numba freezes into the compiled code as constants.

Formats (each value is carried by its bit pattern, an unsigned integer):

* **bfloat16** (``uint16``): the top half of a float32. ``bf16_decode`` is exact;
  ``bf16_encode_nearest`` rounds to nearest, ties to even, as ``ml_dtypes.bfloat16`` (NaN stays
  a quiet NaN with the sign and top payload bits, infinities stay, overflow rounds to inf);
  ``bf16_encode_stochastic`` adds 16 random bits to the 16 discarded bits and truncates.
* **float16** (IEEE half, ``uint16``): ``f16_decode`` is exact (subnormals, inf, NaN);
  ``f16_encode_nearest`` equals numpy's ``float32 -> float16`` cast bit for bit (nearest even,
  gradual underflow, ``>= 65520`` to inf); ``f16_encode_stochastic`` rounds to one of the two
  neighbouring halfs with probability proportional to the distance.
* **8-bit blockwise dynamic quantization**, bitsandbytes' optimizer format: the elements of
  a block of ``BLOCK`` (256) elements share one float32 scale ``absmax`` (the block's largest
  ``|x|``); each element is a ``uint8`` index into the 256-entry code table ``DYNAMIC_SIGNED``
  (first moments) or ``DYNAMIC_UNSIGNED`` (second moments), which equal
  ``bitsandbytes.functional.create_dynamic_map(signed=True / False)``; its value is
  ``table[code] * absmax``. Encoding reproduces bitsandbytes' CPU ``quantize_blockwise``
  (0.50) bit for bit, see :func:`q8_encode`.

Stochastic rounding draws its bits from :func:`mix32`, a counter-based hash of
``(seed, step, stream, index)``: the same bits whatever the threads or chunking.

Stochastic rounding, both 16-bit formats: an exactly representable value is returned
unchanged; otherwise the result is the neighbour below or above in magnitude, the one above
with probability (distance to the one below) / (gap), so the expected result is the input.
Beyond the largest finite value the next value up is taken to be infinity (one gap above
the largest finite: 2**128 for bfloat16, 65536 for float16): a value between the largest
finite and that becomes inf with the probability of the distance fraction, a value at or past
it (only float16: ``|x| >= 65536``) becomes inf. A finite input never gives NaN.
"""

from __future__ import annotations

import numpy as np

from .arithmetic import byte_word, f32_bits, f32_from_bits, hash32

BLOCK = 256
"""Elements per 8-bit block (bitsandbytes' optimizers' blocksize)."""

MIN_8BIT_SIZE = 4096
"""bitsandbytes' ``min_8bit_size``: a tensor with fewer elements keeps float32 state."""

_U8 = np.uint8
_U16 = np.uint16
_U32 = np.uint32
_U64 = np.uint64
_F32 = np.float32


# --- counter-based random bits ---------------------------------------------------------------

_GOLDEN = _U64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, splitmix64's increment
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)
_S30 = _U64(30)
_S27 = _U64(27)
_S31 = _U64(31)
_S32 = _U64(32)
_STREAM_KEY = _U64(0xD6E8FEB86659FD93)


def _fmix64(h):
    """splitmix64's finalizer (Stafford's "Mix13"): a bijection of uint64 with full avalanche."""
    h = (h ^ (h >> _S30)) * _MIX1
    h = (h ^ (h >> _S27)) * _MIX2
    return h ^ (h >> _S31)


def mix32_key(seed, step, stream):
    """The per-(seed, step, stream) part of :func:`mix32` (uint64), to hoist out of a loop."""
    h = _fmix64(_U64(seed) + _GOLDEN)
    h = _fmix64((h ^ _U64(step)) + _GOLDEN)
    return _fmix64((h ^ (_U64(stream) * _STREAM_KEY)) + _GOLDEN)


def mix32_at(key, index):
    """``mix32`` for a key from :func:`mix32_key` and an element index: :func:`hash32` of the
    low and high 32-bit words of ``key + index`` (wrapping). Consecutive indices then differ
    only in the low word until it wraps, so a loop over a run of elements computes the hash
    in 32-bit lanes (``kernels/coded_views.py``'s ``HalfView``, spans cut by
    ``kernels/coded.py``'s ``_draw_words``)."""
    x = key + _U64(index)
    return hash32(x, x >> _S32)


def mix32(seed, step, stream, index):
    """32 random bits (uint32) for element ``index`` of ``stream`` at ``step`` under ``seed``.

    Counter-based: a pure function of the four non-negative integers (all taken as uint64),
    so the bits do not depend on which thread or chunk handles the element. Three rounds of
    splitmix64's finalizer :func:`_fmix64` chained over ``seed``, ``step`` and ``stream`` (times
    an odd constant), each word xored in and the golden-ratio increment added before a round,
    give a 64-bit key (once per step and array); the element's index is added to it and the
    two 32-bit words folded by :func:`hash32` (lowbias32, a bijection: within a step and
    stream, indices less than 2**32 apart draw distinct words). Every bit of the result, the
    low 16 that :func:`bf16_encode_stochastic` uses included, depends on every bit of the
    index and key."""
    return mix32_at(mix32_key(seed, step, stream), index)


# --- bfloat16 -----------------------------------------------------------------------------

_ABS = _U32(0x7FFFFFFF)
_INF32 = _U32(0x7F800000)
_S16 = _U32(16)
_BF16_NAN32 = _U32(0x7FC00000)
_SIGN32 = _U32(0x80000000)
_H_SIGN = _U32(0x8000)
_BF16_ROUND = _U32(0x7FFF)
_LOW16 = _U32(0xFFFF)
_ONE32 = _U32(1)


def bf16_decode(u):
    """The float32 value of the bfloat16 bit pattern ``u`` (exact)."""
    return f32_from_bits(_U32(u) << _S16)


def _bf16_nan_or(x, b, t):
    """``t`` (a float32 pattern, rounded by the caller), or for a NaN ``x`` (pattern ``b``) the
    quiet NaN with ``x``'s sign in the top half. The test is ``x != x`` and the choice is made
    in 32-bit lanes before the one shift to 16 bits: in a vector loop one compare, one
    ternary logic op and one blend per element, where testing the pattern and choosing
    between two 16-bit results took three more."""
    return ((b & _SIGN32) | _BF16_NAN32) if x != x else t


def bf16_encode_nearest(x):
    """The bfloat16 pattern (uint16) nearest to float32 ``x``, ties to even (as
    ``ml_dtypes.bfloat16``): NaN gives the quiet NaN ``0x7fc0`` with its sign, inf stays
    inf, a value at or past the midpoint above the largest finite bfloat16 gives inf."""
    b = f32_bits(x)
    t = b + _BF16_ROUND + ((b >> _S16) & _ONE32)
    return _U16(_bf16_nan_or(x, b, t) >> _S16)


def bf16_encode_stochastic(x, r):
    """float32 ``x`` as bfloat16 (uint16) rounded stochastically with the random uint32 ``r``.

    The low 16 bits of ``r`` are added to ``x``'s bit pattern and the low 16 bits dropped:
    the magnitude rounds up with probability (discarded bits) / 2**16, the exact distance
    fraction, so the result is unbiased; an exact value is unchanged; NaN gives the quiet NaN
    of :func:`bf16_encode_nearest`, inf stays inf, and a finite value past the largest finite
    bfloat16 may become inf (see the module docstring) but never NaN."""
    b = f32_bits(x)
    return _U16(_bf16_nan_or(x, b, b + (_U32(r) & _LOW16)) >> _S16)


# --- float16 --------------------------------------------------------------------------------

_S10 = _U32(10)
_S13 = _U32(13)
_S23 = _U32(23)
_H_EXP = _U32(0x1F)
_H_MANT = _U32(0x3FF)
_H_INF = _U32(0x7C00)
_REBIAS = _U32(112)  # float32 bias 127 - float16 bias 15
_REBIAS_BITS = _U32(112 << 23)
_H_MIN_NORMAL = _U32(0x38800000)  # 2**-14 as float32 bits
_H_ROUNDS_TO_INF = _U32(0x477FF000)  # 65520: the midpoint between 65504 and 2**16
_H_OVERFLOW = _U32(0x47800000)  # 2**16: the step above 65504
_H_HALF_MIN_SUB = _U32(0x33000000)  # 2**-25: half the smallest subnormal
_F32_MANT = _U32(0x7FFFFF)
_F32_HIDDEN = _U32(0x800000)
_ROUND_13 = _U32(0x0FFF)
_LOW13 = _U32(0x1FFF)
_TWO_M24 = _F32(2.0 ** -24)
_TWO_24 = _F32(2.0 ** 24)
_TWO_23 = _F32(2.0 ** 23)
_TWO_23_BITS = _U32(0x4B000000)
_Z32 = _U32(0)


def f16_decode(u):
    """The float32 value of the IEEE half bit pattern ``u`` (exact: subnormals, inf, NaN with
    its payload)."""
    h = _U32(u)
    sign = (h & _H_SIGN) << _S16
    e = (h >> _S10) & _H_EXP
    m = h & _H_MANT
    if e == _H_EXP:
        return f32_from_bits(sign | _INF32 | (m << _S13))
    if e == _Z32:
        v = _F32(m) * _TWO_M24
        return -v if sign != _Z32 else v
    return f32_from_bits(sign | ((e + _REBIAS) << _S23) | (m << _S13))


def _f16_nan(b):
    """numpy's half NaN for float32 NaN bits ``b``: sign, the top 10 payload bits, and the
    lowest bit set if those are all zero (so that it stays a NaN)."""
    m = (b >> _S13) & _H_MANT
    if m == _Z32:
        m = _ONE32
    return _U16(((b >> _S16) & _H_SIGN) | _H_INF | m)


def f16_encode_nearest(x):
    """The IEEE half pattern (uint16) nearest to float32 ``x``, ties to even, as numpy's
    ``x.astype(np.float16)`` bit for bit: subnormal halfs by gradual underflow, ``|x| >= 65520``
    to inf; NaN keeps its sign and top 10 payload bits (the lowest set if they are all
    zero), as numpy's cast."""
    b = f32_bits(x)
    sign = (b >> _S16) & _H_SIGN
    a = b & _ABS
    if a > _INF32:
        return _f16_nan(b)
    if a >= _H_ROUNDS_TO_INF:
        return _U16(sign | _H_INF)
    if a >= _H_MIN_NORMAL:
        return _U16(sign | ((a + _ROUND_13 + ((a >> _S13) & _ONE32) - _REBIAS_BITS) >> _S13))
    if a <= _H_HALF_MIN_SUB:
        return _U16(sign)
    # |x| * 2**24 (exact) rounded to an integer, ties to even, by adding 2**23 in float32
    t = f32_from_bits(a) * _TWO_24 + _TWO_23
    return _U16(sign | (f32_bits(t) - _TWO_23_BITS))


_S125 = _U32(125)
_E_SUB = _U32(126)
_K32 = _U32(32)
_K56 = _U32(56)


def f16_encode_stochastic(x, r):
    """float32 ``x`` as an IEEE half (uint16) rounded stochastically with the random uint32
    ``r``: one of the two neighbouring halfs, the one above in magnitude with probability
    (distance to the one below) / (gap), so the result is unbiased; an exact value is
    unchanged. For a normal half the 13 discarded bits of ``x`` are compared with 13 bits of
    ``r`` (exact); for a subnormal half the discarded part is taken to 32 bits and compared
    with all of ``r`` (exact for ``|x| >= 2**-33``, below that the probability of rounding up
    to 2**-24 is short by less than 2**-32). Past 65504 see the module docstring: ``|x|`` in
    (65504, 65536) becomes inf with probability ``(|x| - 65504) / 32``, ``|x| >= 65536`` inf.
    NaN gives the quiet NaN of :func:`f16_encode_nearest`, inf stays inf."""
    b = f32_bits(x)
    sign = (b >> _S16) & _H_SIGN
    a = b & _ABS
    u = _U32(r)
    if a > _INF32:
        return _f16_nan(b)
    if a >= _H_OVERFLOW:
        return _U16(sign | _H_INF)
    if a >= _H_MIN_NORMAL:
        return _U16(sign | ((a + (u & _LOW13) - _REBIAS_BITS) >> _S13))
    # a subnormal half: in units of 2**-24, |x| = mantissa * 2**-shift
    e = a >> _S23
    if e == _Z32:
        mantissa = a
        shift = _S125
    else:
        mantissa = (a & _F32_MANT) | _F32_HIDDEN
        shift = _E_SUB - e  # >= 14 here
    if shift >= _K56:  # |x| < 2**-56: below what 32 random bits resolve, rounds down
        return _U16(sign)
    # |x| in units of 2**-56 (32 fraction bits below the subnormal's unit), truncated
    if shift <= _K32:
        scaled = _U64(mantissa) << _U64(_K32 - shift)
    else:
        scaled = _U64(mantissa) >> _U64(shift - _K32)
    return _U16(sign | _U32((scaled + _U64(u)) >> _S32))


# --- 8-bit blockwise dynamic quantization ---------------------------------------------------

def _linspace_fma(start, end, steps):
    """``torch.linspace(start, end, steps, dtype=torch.float32)`` as torch's CPU kernel
    computes it (``aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp``): ``step = (end -
    start) / (steps - 1)`` in float32; element ``i`` is ``start + step * i`` below
    ``steps // 2`` and ``end - step * (steps - i - 1)`` from there, each a fused multiply-add
    (how the x86-64 AVX2/AVX512 and aarch64 builds compile it). The fused result is formed in
    float64, exactly (a 24-bit step times an integer below 2**8 plus a float32 near it), and
    rounded once to float32."""
    a, b = _F32(start), _F32(end)
    step = _F32((b - a) / _F32(steps - 1))
    half = steps // 2
    out = np.empty(steps, np.float32)
    for i in range(steps):
        if i < half:
            out[i] = _F32(float(step) * i + float(a))
        else:
            out[i] = _F32(float(b) - float(step) * (steps - i - 1))
    return out


def _dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """``bitsandbytes.functional.create_dynamic_map(signed)`` in numpy, in float32 as it is
    formed there: decade ``i`` holds ``10**(i - 6)`` times the midpoints of
    ``linspace(0.1, 1, n_i)`` (the scale rounded to float32, as torch multiplies a float32
    tensor by a Python scalar), with negated copies when signed, then 0 and 1, sorted."""
    data = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = (2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                 else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = _linspace_fma(0.1, 1.0, items)
        means = (boundaries[:-1] + boundaries[1:]) / _F32(2.0)
        scale = _F32(10.0 ** (-(max_exponent_bits - 1) + i))
        data.extend(scale * means)
        if signed:
            data.extend(-scale * means)
    if additional_items > 0:  # not reached with the defaults (kept to follow the formula)
        boundaries = _linspace_fma(0.1, 1.0, additional_items + 1)
        means = (boundaries[:-1] + boundaries[1:]) / _F32(2.0)
        scale = _F32(10.0 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1))
        data.extend(scale * means)
        if signed:
            data.extend(-scale * means)
    data.extend([_F32(0.0), _F32(1.0)])
    assert len(data) == 2 ** total_bits
    data.extend([_F32(0.0)] * (256 - len(data)))
    return np.sort(np.array(data, dtype=np.float32))


DYNAMIC_SIGNED = _dynamic_map(True)
"""bitsandbytes' signed dynamic map (256 float32 codes, sorted; -0.99296874 ... 1)."""
DYNAMIC_UNSIGNED = _dynamic_map(False)
"""bitsandbytes' unsigned dynamic map (256 float32 codes, sorted; 0 ... 1)."""


# How bitsandbytes' CPU quantize_blockwise (0.50, csrc/cpu_ops.cpp) picks a code: with
# ``v = x * (1.0f / absmax)`` it takes ``k = (uint16)((clamp(v, -1, 1) + 1) * 0.5f * 65535
# + 0.5f)`` (NaN: 0) and reads a 65536-entry table built once per code table: entry ``k`` is
# the code nearest to ``-1 + 2k / 65535``, i.e. the number of midpoints ``0.5f * (c[j] +
# c[j+1])`` below it. (So a code is the nearest one only up to that 1/65535 grid.)
# The composite ``v -> code`` is a monotone step function of ``v``; here it is computed
# without the 64 KiB table: the float32 bits of ``|v|`` pick a bucket (exponent and top
# mantissa bits, so buckets follow the codes' logarithmic spacing), a small table gives the
# code at the bucket's edge, and at most ``_Q8_STEPS`` comparisons with the exact float32
# thresholds where the code changes finish it.

_LUT_SIZE = 65536
_Q8_E0 = 112  # biased exponents below this (|v| < 2**-15) share bucket 0
_Q8_M = 6  # mantissa bits per bucket: 64 buckets per binade (961 buckets)
_Q8_BUCKETS = 1 + (127 - _Q8_E0) * (1 << _Q8_M)
_Q8_STEPS = 2


def _bnb_lut_index(v: np.ndarray) -> np.ndarray:
    """bitsandbytes' ``norm_to_lut_index`` of float32 ``v`` (numpy, for building tables)."""
    with np.errstate(invalid="ignore"):
        c = np.minimum(np.maximum(v.astype(np.float32), _F32(-1)), _F32(1))
        c = np.where(np.isnan(v), v, c).astype(np.float32)
        t = ((c + _F32(1)) * _F32(0.5)).astype(np.float32) * _F32(65535) + _F32(0.5)
        t = t.astype(np.float32)
    k = np.zeros(v.shape, np.int64)
    ok = ~np.isnan(t)
    k[ok] = t[ok].astype(np.int64)
    return k


def _bnb_lut(code: np.ndarray) -> np.ndarray:
    """bitsandbytes' ``build_quantize_lut``: the 65536-entry index -> code table."""
    i = np.arange(_LUT_SIZE)
    val = (_F32(-1) + (_F32(2) * i.astype(np.float32)) / _F32(_LUT_SIZE - 1)).astype(np.float32)
    mid = (_F32(0.5) * (code[:-1] + code[1:])).astype(np.float32)
    # the first j whose midpoint is not below val (bitsandbytes advances while mid < val)
    return np.searchsorted(mid, val, side="left").astype(np.uint8)


def _bnb_code(v: np.ndarray, lut: np.ndarray) -> np.ndarray:
    return lut[_bnb_lut_index(v)]


def _key(bits: np.ndarray) -> np.ndarray:
    """A monotone uint32 key of float32 bit patterns (int64 array): -inf < ... < -0 < +0 <
    ... < +inf."""
    bits = bits.astype(np.int64)
    return np.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)


def _unkey(key: np.ndarray) -> np.ndarray:
    key = key.astype(np.int64)
    bits = np.where(key >= 0x80000000, key - 0x80000000, 0xFFFFFFFF - key)
    return bits.astype(np.uint32).view(np.float32)


def _bucket_low(bucket: np.ndarray) -> np.ndarray:
    """The smallest ``|v|`` bits of each bucket (uint32)."""
    bucket = bucket.astype(np.int64)
    rest = np.maximum(bucket - 1, 0)
    e = _Q8_E0 + (rest >> _Q8_M)
    m = rest & ((1 << _Q8_M) - 1)
    low = (e << 23) | (m << (23 - _Q8_M))
    return np.where(bucket == 0, 0, low).astype(np.uint32)


def _q8_tables(code: np.ndarray):
    """(used codes, thresholds, start index per sign and bucket, codes for NaN, v <= -1, v
    >= 1) of one code table; checks the bucket walk against bitsandbytes' LUT for every
    bucket edge."""
    lut = _bnb_lut(code)
    used = np.unique(lut)  # sorted codes bitsandbytes can produce
    n = used.size
    lo_key = int(_key(np.array([_F32(-1.0)]).view(np.uint32))[0])
    hi_key = int(_key(np.array([_F32(1.0)]).view(np.uint32))[0])
    # thresholds: the smallest v with a code >= used[j], j = 1 .. n-1 (bisection on keys)
    lo = np.full(n - 1, lo_key, np.int64)  # code(lo) < used[j]
    hi = np.full(n - 1, hi_key, np.int64)  # code(hi) >= used[j]
    target = used[1:]
    assert (_bnb_code(_unkey(lo), lut) < target).all()
    assert (_bnb_code(_unkey(hi), lut) >= target).all()
    while (hi - lo > 1).any():
        mid = (lo + hi) // 2
        up = _bnb_code(_unkey(mid), lut) >= target
        hi = np.where(up, mid, hi)
        lo = np.where(up, lo, mid)
    thresholds = np.empty(n + 1, np.float32)
    thresholds[0] = -np.inf
    thresholds[1:n] = _unkey(hi)
    thresholds[n] = np.inf
    # start index at each bucket's smallest |v|, for +v and for -v
    low = _bucket_low(np.arange(_Q8_BUCKETS)).view(np.float32)
    start = np.empty((2, _Q8_BUCKETS), np.uint8)
    start[0] = np.searchsorted(used, _bnb_code(low, lut))
    start[1] = np.searchsorted(used, _bnb_code(-low, lut))
    # each bucket's largest |v|: the walk must not take more than _Q8_STEPS steps
    high = (_bucket_low(np.arange(1, _Q8_BUCKETS + 1)).astype(np.int64) - 1)
    high[-1] = 0x3F7FFFFF  # the largest float32 below 1
    high = high.astype(np.uint32).view(np.float32)
    steps_up = np.searchsorted(used, _bnb_code(high, lut)) - start[0].astype(np.int64)
    steps_down = start[1].astype(np.int64) - np.searchsorted(used, _bnb_code(-high, lut))
    assert steps_up.min() >= 0 and steps_down.min() >= 0
    assert max(steps_up.max(), steps_down.max()) <= _Q8_STEPS
    edges = np.array([lut[0], lut[0], lut[_LUT_SIZE - 1]], np.uint8)  # NaN, <= -1, >= 1
    padded = np.zeros(256, np.uint8)
    padded[:n] = used
    return padded, thresholds, start, edges


def _stack_q8():
    tables = [_q8_tables(DYNAMIC_SIGNED), _q8_tables(DYNAMIC_UNSIGNED)]
    width = max(t[1].size for t in tables)
    thresholds = np.full((2, width), np.inf, np.float32)
    for kind, t in enumerate(tables):
        thresholds[kind, :t[1].size] = t[1]
    return (np.stack([t[0] for t in tables]), thresholds, np.stack([t[2] for t in tables]),
            np.stack([t[3] for t in tables]))


_Q8_USED, _Q8_THRESHOLDS, _Q8_START, _Q8_EDGES = _stack_q8()
# [kind (0 signed, 1 unsigned), ...]: used codes; thresholds (-inf, t_1 .. t_{n-1}, +inf):
# index i moves up past t_{i+1} <= v and down while t_i > v; start [kind, sign, bucket];
# edge codes [kind, (NaN, v <= -1, v >= 1)].

_ONE_BITS = _U32(0x3F800000)
_Q8_E0_U = _U32(_Q8_E0)
_Q8_SHIFT = _U32(23 - _Q8_M)
_Q8_SHIFT_E = _U32(_Q8_M)
_Q8_MASK = _U32((1 << _Q8_M) - 1)
_S31_32 = _U32(31)
_F32_ONE = _F32(1.0)


def q8_scale(absmax):
    """The factor bitsandbytes normalizes a block with: ``1.0f / absmax`` (float32; inf for an
    all-zero block, which then encodes every element as code 0, as bitsandbytes does). The
    caller must be compiled with ``error_model="numpy"`` (as every kernel here is), or the
    division by zero raises."""
    return _F32_ONE / _F32(absmax)


def q8_code(v, signed):
    """The code (uint8) bitsandbytes' CPU ``quantize_blockwise`` gives an element whose
    normalized value is ``v = x * q8_scale(absmax)`` (float32) in table ``DYNAMIC_SIGNED``
    (``signed``) or ``DYNAMIC_UNSIGNED``. Arithmetic: a bucket from ``v``'s exponent and top
    mantissa bits, a table lookup and at most two comparisons (see the comment above
    ``_Q8_E0``). ``v`` outside [-1, 1] clamps; NaN (``0 * inf`` in an all-zero block, or a NaN
    element) gives code 0."""
    kind = 0 if signed else 1
    b = f32_bits(v)
    a = b & _ABS
    if a >= _ONE_BITS:
        if v != v:
            return _Q8_EDGES[kind, 0]
        if v < _F32_ONE - _F32_ONE:
            return _Q8_EDGES[kind, 1]
        return _Q8_EDGES[kind, 2]
    e = a >> _S23
    if e < _Q8_E0_U:
        bucket = 0
    else:
        bucket = 1 + np.intp(((e - _Q8_E0_U) << _Q8_SHIFT_E) | ((a >> _Q8_SHIFT) & _Q8_MASK))
    if (b >> _S31_32) == _Z32:
        i = np.intp(_Q8_START[kind, 0, bucket])
        if _Q8_THRESHOLDS[kind, i + 1] <= v:
            i += 1
            if _Q8_THRESHOLDS[kind, i + 1] <= v:
                i += 1
    else:
        i = np.intp(_Q8_START[kind, 1, bucket])
        if _Q8_THRESHOLDS[kind, i] > v:
            i -= 1
            if _Q8_THRESHOLDS[kind, i] > v:
                i -= 1
    return _Q8_USED[kind, i]


def q8_encode(x, absmax_or_signed, signed=None):
    """An element's 8-bit code (uint8), as bitsandbytes' CPU ``quantize_blockwise`` gives it.

    Two call forms:

    * ``q8_encode(x, absmax, signed)``: ``x`` (float32) of a block whose scale is ``absmax``
      (float32, the block's largest ``|x|``); ``x * q8_scale(absmax)`` is encoded.
    * ``q8_encode(v, signed)``: ``v`` is already normalized, ``v = x * q8_scale(absmax)``
      (multiplied by the float32 reciprocal, not divided: that is what bitsandbytes does,
      and it rounds differently from ``x / absmax``).

    ``signed`` picks ``DYNAMIC_SIGNED`` (True) or ``DYNAMIC_UNSIGNED`` (False)."""
    if signed is None:
        return q8_code(x, absmax_or_signed)
    return q8_code(x * q8_scale(absmax_or_signed), signed)


def q8_decode(code, table, absmax):
    """The float32 value of 8-bit ``code`` in ``table`` (``DYNAMIC_SIGNED`` or
    ``DYNAMIC_UNSIGNED``) for a block of scale ``absmax``: ``table[code] * absmax``, as
    bitsandbytes' dequantize_blockwise (an all-zero block, absmax 0, decodes to zeros)."""
    return table[code] * absmax


def q8_block_absmax(x, start, stop):
    """The scale of block ``x[start:stop]`` (float32 array): the largest ``|x|``, 0 for an
    empty or all-zero block. As bitsandbytes' CPU kernel (``std::max`` from 0), a NaN element
    is skipped; an inf makes it inf."""
    # the largest |x| bit pattern, NaN patterns counted as 0: for finite and infinite
    # values the integer order of |x|'s bits is their order, and an integer maximum
    # vectorizes where a float one (NaN-ordered) does not
    # (every value held as uint32: Numba widens uint32 arithmetic to 64 bits, and a 64-bit
    # maximum did not vectorize, 1.8 ns per element against 0.2)
    largest = _Z32
    first = _U64(start)
    for i in range(_U64(stop - start)):  # unsigned: no negative-index check
        a = _U32(f32_bits(x[first + i]) & _ABS)
        a = _U32(a if a <= _INF32 else _Z32)
        largest = _U32(max(largest, a))
    return f32_from_bits(largest)


Q8_LUTS = np.zeros((2, _LUT_SIZE + 4), np.uint8)
Q8_LUTS[0, :_LUT_SIZE] = _bnb_lut(DYNAMIC_SIGNED)
Q8_LUTS[1, :_LUT_SIZE] = _bnb_lut(DYNAMIC_UNSIGNED)
"""bitsandbytes' own 65536-entry quantization tables ([0] signed, [1] unsigned; uint8, four
bytes of padding each), indexed by :func:`q8_lut_index`: what the step's CPU kernels use. A
multiply, a clamp, a conversion and one load per element, with no branch, so the loop
vectorizes: the load is a 32-bit word read at the byte (``byte_word``) and its low byte kept,
since x86 gathers words, not bytes (a byte load stayed scalar: 1.5 ns per element against
0.5), and a byte table (64 KiB) stays in the near caches where a word table (256 KiB) did not.
:func:`q8_code` is the same function of ``v`` without the table, and the tests hold the two
equal."""
_F32_HALF = _F32(0.5)
_F32_HALF_GRID = _F32(32767.5)
_BYTE = _U32(0xFF)


def q8_lut_index(v):
    """bitsandbytes' ``norm_to_lut_index``: ``(uint16)((clamp(v, -1, 1) + 1) * 0.5f * 65535
    + 0.5f)``; a NaN clamps to -1 here (bitsandbytes gives index 0 too)."""
    c = v if v > -_F32_ONE else -_F32_ONE
    c = c if c < _F32_ONE else _F32_ONE
    # ((c + 1) * 0.5f) * 65535 is (c + 1) * 32767.5 rounded once either way: c + 1 is 0 or
    # at least 2**-24, so halving it is exact, and both round the same real number.
    # Unsigned (the value is in [0.5, 65535.5]): a signed index would keep Numba's
    # negative-index check in the loop
    return _U32((c + _F32_ONE) * _F32_HALF_GRID + _F32_HALF)


def q8_encode_block(x, start, stop, codes, out_start, signed):
    """Quantize the block ``x[start:stop]`` (float32, at most ``BLOCK`` elements, a whole
    bitsandbytes block) into ``codes[out_start : out_start + stop - start]`` (uint8) and
    return its scale (float32; store it as the block's absmax). Bit for bit bitsandbytes'
    CPU ``quantize_blockwise`` with ``blocksize=BLOCK`` on that block."""
    absmax = q8_block_absmax(x, start, stop)
    scale = q8_scale(absmax)
    lut = Q8_LUTS[0] if signed else Q8_LUTS[1]
    out = codes[out_start:out_start + stop - start]
    for i in range(_U64(stop - start)):
        out[i] = _U8(byte_word(lut, q8_lut_index(x[_U64(start) + i] * scale)) & _BYTE)
    return absmax


def q8_decode_block(codes, start, stop, table, absmax, out, out_start):
    """``out[out_start : out_start + stop - start]`` = the float32 values of
    ``codes[start:stop]`` (one block, scale ``absmax``) in ``table``."""
    first = _U64(start)
    place = _U64(out_start)
    for i in range(_U64(stop - start)):
        out[place + i] = table[codes[first + i]] * absmax
