"""Stored arrays as float32 arrays, element by element: what the CPU's coded walk hands a span.

A rule's span reads and writes its arrays by index (``p[i]``, ``p[i] = x``). For a buffer
kept in reduced precision (``kernels/coded.py``) the walk hands it *views* instead of float32
arrays: small Numba values (an array slice or two and a few words, passed like an array) whose
``getitem`` decodes element ``i`` to float32 and whose ``setitem`` encodes a float32 with the
array's rounding. The span's own loop then loads, computes and stores every element in one
pass, which LLVM vectorizes as it does the plain loop: no float32 copy of the arrays is made.

Kinds (``kind`` names the 16-bit format, ``"bf16"`` or ``"f16"``; the compiled codec of
``kernels/storage.py`` does the arithmetic):

- :class:`HalfView`: a 16-bit array, stored rounded to nearest or stochastically. A
  stochastic store of element ``i`` draws ``hash32(add32(lo, i), hi)`` (``mix32_at`` of its
  index): ``lo`` is the low word of ``key + index`` of the view's element 0, ``hi`` the high
  word over the span, which the walk cuts where the low word would wrap (``_draw_words``), so
  the hash runs in 32-bit vector lanes.
- :class:`MasterView`: 16-bit parameters with a float32 master copy: reads the master, writes
  the master and the parameter rounded to nearest.
- :class:`KahanView`: 16-bit parameters with a 16-bit compensation (torch-optimi's Kahan
  summation in float32, one rounding per stored value).
- :class:`ScaledView`: gradients (float32 or 16-bit) read times a multiplier (clipping,
  loss-scale removal), read-only; :func:`keep_scaled` stores the scaled values back.
- :class:`PlainView`: a float32 array (or an 8-bit slot's scratch row) as it is.

A view holds pointers, not arrays: it is valid only while its arrays are, inside the kernel
call that makes it (``kernels/coded.py`` makes them per sub-block).
"""

from __future__ import annotations

import inspect
import operator

from numba import njit, types
from numba.core import cgutils
from numba.extending import (intrinsic, make_attribute_wrapper, models, overload,
                             register_model)

from . import storage
from ._bind import bind_functions
from .arithmetic import add32, hash32

CODEC_FUNCTIONS = tuple(f for _, f in inspect.getmembers(storage, inspect.isfunction)
                        if f.__module__ == storage.__name__)
"""The codec: ``kernels/storage.py``'s formats, plain functions compiled for each backend as
rules are (``kernels/_bind.py``)."""
CODEC = bind_functions("the storage codec", CODEC_FUNCTIONS,
                       njit(inline="always", error_model="numpy"))
"""The codec compiled for the CPU, by name."""

_DECODE = {"bf16": CODEC["bf16_decode"], "f16": CODEC["f16_decode"]}
_NEAREST = {"bf16": CODEC["bf16_encode_nearest"], "f16": CODEC["f16_encode_nearest"]}
_STOCHASTIC = {"bf16": CODEC["bf16_encode_stochastic"], "f16": CODEC["f16_encode_stochastic"]}


class HalfView(types.Type):
    """A 16-bit array (``bits``) of format ``kind``; ``lo``, ``hi``: the words its
    stochastic stores draw from (unused when rounding to nearest)."""

    def __init__(self, kind, stochastic):
        self.kind, self.stochastic = kind, stochastic
        super().__init__(name=f"HalfView({kind}, stochastic={stochastic})")


class MasterView(types.Type):
    """16-bit parameters (``bits``) with their float32 master copy (``master``)."""

    def __init__(self, kind):
        self.kind = kind
        super().__init__(name=f"MasterView({kind})")


class KahanView(types.Type):
    """16-bit parameters (``bits``) with their 16-bit Kahan compensation
    (``compensation``, the same format)."""

    def __init__(self, kind):
        self.kind = kind
        super().__init__(name=f"KahanView({kind})")


class ScaledView(types.Type):
    """Gradients (``values``: float32, or 16-bit patterns of format ``kind``) read times
    ``multiplier``."""

    def __init__(self, kind):
        self.kind = kind
        super().__init__(name=f"ScaledView({kind})")


class PlainView(types.Type):
    """A float32 array (``values``) as it is."""

    def __init__(self):
        super().__init__(name="PlainView()")


_HALF = types.CPointer(types.uint16)
_FLOAT = types.CPointer(types.float32)


def _members(view):
    """Every member is a pointer to the slice's first element or a scalar: a view holds no
    reference (it lives inside one kernel call, while the caller holds the arrays), so making
    one costs no atomic reference count."""
    if isinstance(view, HalfView):
        return [("bits", _HALF), ("lo", types.uint32), ("hi", types.uint32)]
    if isinstance(view, MasterView):
        return [("bits", _HALF), ("master", _FLOAT)]
    if isinstance(view, KahanView):
        return [("bits", _HALF), ("compensation", _HALF)]
    if isinstance(view, ScaledView):
        return [("values", _FLOAT if view.kind == "f32" else _HALF),
                ("multiplier", types.float32)]
    return [("values", _FLOAT)]


class _ViewModel(models.StructModel):
    """A view is a struct of its members, passed by value: inside a loop its pointers are
    values LLVM can hoist, so the loop vectorizes as over arrays."""

    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _members(fe_type))


for _view, _names in ((HalfView, ("bits", "lo", "hi")), (MasterView, ("bits", "master")),
                      (KahanView, ("bits", "compensation")),
                      (ScaledView, ("values", "multiplier")), (PlainView, ("values",))):
    register_model(_view)(_ViewModel)
    for _name in _names:
        make_attribute_wrapper(_view, _name, _name)


def _construct(view, context, builder, signature, args):
    """The view's struct from the intrinsic's arguments: ``(start, *members)``, each array
    member given as the whole array (the member is a pointer to element ``start``), each
    scalar member cast to its type."""
    start = context.cast(builder, args[0], signature.args[0], types.intp)
    struct = cgutils.create_struct_proxy(view)(context, builder)
    for (name, member), value, given in zip(_members(view), args[1:], signature.args[1:]):
        if isinstance(given, types.Array):
            data = context.make_array(given)(context, builder, value).data
            value = builder.gep(data, [start])
        else:
            value = context.cast(builder, value, given, member)
        setattr(struct, name, value)
    return struct._getvalue()


def _constructor(view):
    """An intrinsic ``make(start, *members)`` building ``view`` over the sub-array from
    element ``start`` (Numba's intrinsics take no ``*args``: one per arity)."""

    def typing(args):
        return view(*args), lambda c, b, sig, a: _construct(view, c, b, sig, a)

    arity = len(_members(view))
    if arity == 1:
        @intrinsic
        def construct1(typingctx, start, a):
            return typing((start, a))
        return construct1
    if arity == 2:
        @intrinsic
        def construct2(typingctx, start, a, b):
            return typing((start, a, b))
        return construct2

    @intrinsic
    def construct3(typingctx, start, a, b, c):
        return typing((start, a, b, c))
    return construct3


def half_view(kind, stochastic):
    """``make(start, bits, lo, hi)``: a :class:`HalfView` of ``kind`` over the uint16 array
    ``bits`` from element ``start``."""
    return _constructor(HalfView(kind, stochastic))


def master_view(kind):
    """``make(start, bits, master)``: a :class:`MasterView`."""
    return _constructor(MasterView(kind))


def kahan_view(kind):
    """``make(start, bits, compensation)``: a :class:`KahanView`."""
    return _constructor(KahanView(kind))


def scaled_view(kind):
    """``make(start, values, multiplier)``: a :class:`ScaledView` (``kind`` ``"f32"`` for
    float32 gradients); the multiplier becomes float32."""
    return _constructor(ScaledView(kind))


plain_view = _constructor(PlainView())
"""``plain_view(start, values)``: a :class:`PlainView` of a float32 array."""


@overload(operator.getitem)
def _getitem(view, i):
    if isinstance(view, (HalfView, KahanView)):
        decode = _DECODE[view.kind]
        return lambda view, i: decode(view.bits[i])
    if isinstance(view, MasterView):
        return lambda view, i: view.master[i]
    if isinstance(view, ScaledView):
        if view.kind == "f32":
            return lambda view, i: view.values[i] * view.multiplier
        decode = _DECODE[view.kind]
        return lambda view, i: decode(view.values[i]) * view.multiplier
    if isinstance(view, PlainView):
        return lambda view, i: view.values[i]
    return None


@overload(operator.setitem)
def _setitem(view, i, x):
    if isinstance(view, HalfView):
        if view.stochastic:
            stochastic = _STOCHASTIC[view.kind]

            def store_drawn(view, i, x):
                view.bits[i] = stochastic(x, hash32(add32(view.lo, i), view.hi))
            return store_drawn
        nearest = _NEAREST[view.kind]

        def store_nearest(view, i, x):
            view.bits[i] = nearest(x)
        return store_nearest
    if isinstance(view, MasterView):
        nearest = _NEAREST[view.kind]

        def store_master(view, i, x):
            view.master[i] = x
            view.bits[i] = nearest(x)
        return store_master
    if isinstance(view, KahanView):
        nearest, decode = _NEAREST[view.kind], _DECODE[view.kind]

        def store_kahan(view, i, x):
            # torch-optimi's Kahan summation in float32, one rounding per stored value: the
            # compensation takes the update, the parameter moves by it, and what the 16-bit
            # parameter could not take stays in the compensation
            old = decode(view.bits[i])
            carry = decode(view.compensation[i]) + (x - old)
            q = nearest(old + carry)
            view.bits[i] = q
            view.compensation[i] = nearest(carry - (decode(q) - old))
        return store_kahan
    if isinstance(view, PlainView):
        def store_plain(view, i, x):
            view.values[i] = x
        return store_plain
    return None


def keep_scaled(view, n):
    """Store elements ``[0, n)`` of a :class:`ScaledView` back as read (scaled; 16-bit
    rounded to nearest): the gradient buffer then holds what the update used, as in the
    plain walk."""


@overload(keep_scaled)
def _keep_scaled(view, n):
    if not isinstance(view, ScaledView):
        return None
    if view.kind == "f32":
        def keep_f32(view, n):
            for i in range(n):
                view.values[i] = view.values[i] * view.multiplier
        return keep_f32
    nearest, decode = _NEAREST[view.kind], _DECODE[view.kind]

    def keep_half(view, n):
        for i in range(n):
            view.values[i] = nearest(decode(view.values[i]) * view.multiplier)
    return keep_half

