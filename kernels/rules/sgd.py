"""SGD with momentum, dampening, Nesterov, weight decay and maximize (torch.optim.SGD)."""

from typing import NamedTuple

from ..arithmetic import fma
from ..elementwise import Off, element_span
from ..layouts import positions
from ..rule import Rule


class Scalars(NamedTuple):
    neg_lr: float
    weight_decay: float
    momentum: float
    one_minus_dampening: float


class Flags(NamedTuple):
    has_weight_decay: bool
    has_momentum: bool
    nesterov: bool
    maximize: bool


class Columns(NamedTuple):
    momentum_initialized: int
    first: int


F, C = positions(Flags), positions(Columns)


def sgd_rule(p, g, buf, first, neg_lr, weight_decay, momentum, one_minus_dampening,
             has_weight_decay, has_momentum, nesterov, maximize):
    """One SGD element update; returns ``(p, buf)``.

    ::

        g = -g                               if maximize
        g = g + weight_decay * p             if weight_decay != 0
        buf = g                              if momentum != 0 and first step with a gradient
        buf = momentum * buf + (1 - dampening) * g          otherwise (momentum != 0)
        g = g + momentum * buf  if nesterov else buf        (momentum != 0)
        p = p - lr * g

    Rounded as torch's single-tensor SGD on the CPU: each ``x + a * y`` is its
    ``add(x, y, alpha=a)``, one fused multiply-add; ``momentum * buf`` is rounded first.
    """
    if maximize:
        g = -g
    if has_weight_decay:
        g = fma(p, weight_decay, g)
    if has_momentum:
        if first:
            buf = g
        else:
            buf = fma(g, one_minus_dampening, buf * momentum)
        if nesterov:
            g = fma(buf, momentum, g)
        else:
            g = buf
    p = fma(g, neg_lr, p)
    return p, buf


# has_momentum chooses the loop (a Rule.variant): without momentum the buffer is neither read
# nor written
sgd_span = element_span("sgd_span", sgd_rule, 1, Scalars, Columns, Flags,
                        branches={"has_momentum": Off(unread=("buf",), unwritten=("buf",))})


def sgd_prepare(present, columns, scalars, flags, start, stop, stride):
    """The momentum buffer is seeded (not decayed) the first step a parameter has a gradient."""
    initialized = columns[C.momentum_initialized]
    first = columns[C.first]
    track = flags[F.has_momentum]
    for k in range(start, stop, stride):
        if present[k] != 0:
            first[k] = initialized[k] == 0
            if track:
                initialized[k] = 1


RULE = Rule(name="sgd", span=sgd_span, prepare=sgd_prepare, helpers=(sgd_rule,),
            slots=("momentum_buffer",),
            columns={"momentum_initialized": "uint8", "first": "uint8"},
            scalars=Scalars, flags=Flags, variants=("has_momentum",))
