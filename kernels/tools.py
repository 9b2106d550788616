"""Kernels of the training-loop tools: scaling present gradients through the chunk walk (a
rule whose span does nothing: the walk's gradient multiplier does the work), and the
exponential moving average of whole flat buffers."""

from __future__ import annotations

from numba import prange

from .rule import Rule
from .threads import threaded


def untouched_span(arrays, scalars, columns, flags, k, start, stop, stride):
    pass


def untouched_prepare(present, columns, scalars, flags, start, stop, stride):
    pass


SCALE_GRADIENTS = Rule(name="scale_gradients", span=untouched_span, prepare=untouched_prepare,
                       helpers=(), slots=(), columns={})
"""Run with ``scale_grads=True``: each present gradient segment is multiplied in place."""


@threaded(cache=True, error_model="numpy")
def lerp_into(average, value, weight, from_end):
    """``average = lerp(average, value, weight)`` over a whole flat buffer, computed from the
    nearer end as torch's lerp does: ``a + w (v - a)`` for ``w < 0.5``, else
    ``v - (1 - w)(v - a)`` (``weight`` is then passed as ``w - 1``, in the buffer's dtype)."""
    for i in prange(average.size):  # one parallel region; LLVM unswitches the branch
        if from_end:
            average[i] = value[i] + weight * (value[i] - average[i])
        else:
            average[i] = average[i] + weight * (value[i] - average[i])


@threaded(cache=True, error_model="numpy")
def lookahead_into(slow, fast, starts, stops, alpha):
    """timm's Lookahead sync over the pieces ``[starts[j], stops[j])`` of a flat buffer (each
    piece at most a chunk long, so threads get even work): ``slow += alpha (fast - slow)``
    (torch's ``add_(fast - slow, alpha=alpha)``), then ``fast = slow``."""
    for j in prange(starts.size):
        for i in range(starts[j], stops[j]):
            slow[i] = slow[i] + alpha * (fast[i] - slow[i])
            fast[i] = slow[i]
