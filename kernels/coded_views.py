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
  stochastic store of element ``i`` draws ``hash32(add32(lo, i), hi)``: ``lo`` and ``hi`` are
  the words of ``key + index`` of the slice's first element (``mix32_at``), and the walk cuts a
  span where the low word would wrap, so ``hi`` is fixed over it (32-bit vector lanes).
- :class:`MasterView`: 16-bit parameters with a float32 master copy: reads the master, writes
  the master and the parameter rounded to nearest.
- :class:`KahanView`: 16-bit parameters with a 16-bit compensation (torch-optimi's Kahan
  summation in float32, one rounding per stored value).
- :class:`ScaledView`: gradients (float32 or 16-bit) read times a multiplier (clipping,
  loss-scale removal), read-only; :func:`keep_scaled` stores the scaled values back.
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
    """A 16-bit array (``bits``, uint16) of format ``kind``; ``lo``, ``hi``: the words its
    stochastic stores draw from (unused when rounding to nearest)."""

    def __init__(self, array, kind, stochastic):
        self.array, self.kind, self.stochastic = array, kind, stochastic
        super().__init__(name=f"HalfView({array}, {kind}, stochastic={stochastic})")


class MasterView(types.Type):
    """16-bit parameters (``bits``) with their float32 master copy (``master``)."""

    def __init__(self, array, master, kind):
        self.array, self.master, self.kind = array, master, kind
        super().__init__(name=f"MasterView({array}, {master}, {kind})")


class KahanView(types.Type):
    """16-bit parameters (``bits``) with their 16-bit Kahan compensation
    (``compensation``, the same format)."""

    def __init__(self, array, kind):
        self.array, self.kind = array, kind
        super().__init__(name=f"KahanView({array}, {kind})")


class ScaledView(types.Type):
    """Gradients (``values``: float32, or 16-bit patterns of format ``kind``) read times
    ``multiplier``."""

    def __init__(self, array, kind):
        self.array, self.kind = array, kind
        super().__init__(name=f"ScaledView({array}, {kind})")


def _members(view):
    if isinstance(view, HalfView):
        return [("bits", view.array), ("lo", types.uint32), ("hi", types.uint32)]
    if isinstance(view, MasterView):
        return [("bits", view.array), ("master", view.master)]
    if isinstance(view, KahanView):
        return [("bits", view.array), ("compensation", view.array)]
    return [("values", view.array), ("multiplier", types.float32)]


class _ViewModel(models.StructModel):
    """A view is a struct of its members, passed by value (as arrays are): inside a loop its
    slices' data pointers are values LLVM can hoist, so the loop vectorizes."""

    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _members(fe_type))


for _view in (HalfView, MasterView, KahanView, ScaledView):
    register_model(_view)(_ViewModel)
for _view, _names in ((HalfView, ("bits", "lo", "hi")), (MasterView, ("bits", "master")),
                      (KahanView, ("bits", "compensation")),
                      (ScaledView, ("values", "multiplier"))):
    for _name in _names:
        make_attribute_wrapper(_view, _name, _name)


def _constructor(make_type):
    """An intrinsic building a view from its members in order (``make_type(*argument
    types)`` is the view's type); arrays among them are referenced, as a new array would be.
    (Numba's intrinsics take no ``*args``: one of two or three arguments.)"""

    def typing(members):
        view = make_type(*members)

        def codegen(context, builder, signature, args):
            struct = cgutils.create_struct_proxy(view)(context, builder)
            for (name, member), value, given in zip(_members(view), args, signature.args):
                if isinstance(member, types.Array):
                    context.nrt.incref(builder, given, value)
                setattr(struct, name, context.cast(builder, value, given, member))
            return struct._getvalue()

        return view(*members), codegen

    if make_type.__code__.co_argcount == 2:
        @intrinsic
        def construct2(typingctx, a, b):
            return typing((a, b))
        return construct2

    @intrinsic
    def construct3(typingctx, a, b, c):
        return typing((a, b, c))
    return construct3


def half_view(kind, stochastic):
    """``make(bits, lo, hi)``: a :class:`HalfView` of ``kind`` over the uint16 array ``bits``."""
    return _constructor(lambda bits, lo, hi: HalfView(bits, kind, stochastic))


def master_view(kind):
    """``make(bits, master)``: a :class:`MasterView`."""
    return _constructor(lambda bits, master: MasterView(bits, master, kind))


def kahan_view(kind):
    """``make(bits, compensation)``: a :class:`KahanView`."""
    return _constructor(lambda bits, compensation: KahanView(bits, kind))


def scaled_view(kind):
    """``make(values, multiplier)``: a :class:`ScaledView` (``kind`` ``"f32"`` for float32
    gradients); the multiplier becomes float32."""
    return _constructor(lambda values, multiplier: ScaledView(values, kind))


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

