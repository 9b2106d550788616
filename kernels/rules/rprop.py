"""Rprop (torch.optim.Rprop): resilient backpropagation, one step size per element."""

from typing import NamedTuple

from ..elementwise import element_prepare
from ..layouts import positions
from ..rule import Rule


class Scalars(NamedTuple):
    lr: float
    etaminus: float
    etaplus: float
    step_size_min: float
    step_size_max: float
    zero: float


class Flags(NamedTuple):
    maximize: bool


class Columns(NamedTuple):
    step: int


S, F, C = positions(Scalars), positions(Flags), positions(Columns)


def rprop_rule(p, g, prev, step_size, etaminus, etaplus, step_size_min, step_size_max, zero,
               maximize):
    """One Rprop element update; returns ``(p, prev, step_size)``::

        g = -g                                       if maximize
        step_size = step_size * etaplus              if g * prev > 0
        step_size = step_size * etaminus; g = 0      if g * prev < 0
        step_size = clamp(step_size, step_size_min, step_size_max)
        p = p - sign(g) * step_size
        prev = g

    as torch computes it: the sign of the product ``g * prev`` (which can underflow to 0), a
    factor of 1 where it is 0 or NaN (``torch.sign(nan)`` is 0 on the CPU), the gradient
    zeroed where the sign flipped and stored as ``prev``, and ``sign(g)`` 0 for a NaN ``g``.
    """
    if maximize:
        g = -g
    direction = g * prev
    if direction > 0:
        step_size = step_size * etaplus
    elif direction < 0:
        step_size = step_size * etaminus
        g = zero
    if step_size < step_size_min:
        step_size = step_size_min
    if step_size > step_size_max:
        step_size = step_size_max
    if g > 0:
        p = p - step_size
    elif g < 0:
        p = p + step_size
    return p, g, step_size


def rprop_span(arrays, scalars, columns, flags, k, start, stop, stride):
    p, g, prev, step_size = arrays
    etaminus = scalars[S.etaminus]
    etaplus = scalars[S.etaplus]
    low = scalars[S.step_size_min]
    high = scalars[S.step_size_max]
    zero = scalars[S.zero]
    maximize = flags[F.maximize]
    if columns[C.step][k] == 1:
        # The parameter's first step: torch creates its state now, prev = 0 and every step
        # size = the group's current lr (the same arrays are written in both loops).
        lr = scalars[S.lr]
        for i in range(start, stop, stride):
            p[i], prev[i], step_size[i] = rprop_rule(p[i], g[i], zero, lr, etaminus, etaplus,
                                                     low, high, zero, maximize)
    else:
        for i in range(start, stop, stride):
            p[i], prev[i], step_size[i] = rprop_rule(p[i], g[i], prev[i], step_size[i],
                                                     etaminus, etaplus, low, high, zero,
                                                     maximize)


rprop_prepare = element_prepare("rprop_prepare", None, (), None, Columns)
"""Advances each present parameter's own step count (the update does not read it)."""


RULE = Rule(name="rprop", span=rprop_span, prepare=rprop_prepare, helpers=(rprop_rule,),
            slots=("prev", "step_size"), columns={"step": "int64"}, scalars=Scalars,
            flags=Flags)
