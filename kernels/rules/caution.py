"""Cautious updates (Liang et al. 2024, "Cautious Optimizers", arXiv 2411.16085), as timm's
``caution=True`` applies them: an element's update is kept only where it agrees in sign with
the gradient, and the kept ones are scaled by the inverse of the kept fraction::

    mask = (u * g > 0)                        u: the update direction (Adam's new exp_avg)
    mask = mask / max(mean(mask), 1e-3)       the mean over the whole parameter
    u = u * mask

The mean is a per-parameter total, so a cautious step is two passes: the rule's ``reduce``
counts the agreeing elements (from the moments the step is about to store; it stores
nothing), :func:`caution_finalize` turns the counts into the scale, and the span multiplies.
The counts are integers (a segment's in int64: a conditional float add would stay a branch per
element, mispredicted half the time, 3x slower; partial sums in float64), exact in any order:
the scale does not depend on the thread count, the chunking, MPI's sharding or CUDA's atomics.

Shared by the rules that offer ``caution`` (Adam/AdamW, Lion, ADOPT), which list these
functions among their helpers; their reductions are :data:`REDUCTIONS`.
"""

REDUCTIONS = ("caution_agreeing", "caution_elements")
"""The per-parameter totals of a cautious rule's reduce: agreeing elements, all elements."""


def cautious(u, g, scale):
    """timm's cautious mask on an element's update ``u``: ``u * scale`` where it agrees in sign
    with the gradient ``g``, else 0 (NaN where ``u`` is not finite: timm multiplies by the
    mask). The zero is ``scale``'s own type, so a float32 body stays float32."""
    return u * (scale if u * g > 0 else scale - scale)


def caution_finalize(present, scale, sums, start, stop, stride):
    """``scale[k] = 1 / max(agreeing / elements, 1e-3)`` for the present parameters, rounded
    as timm's tensor arithmetic in the buffer's dtype: the mean is rounded to it, the clamp
    bound too (torch's ``clamp_`` on a float32 tensor), and the reciprocal is a division of
    two values of the dtype (done in float64 and rounded once: the correctly rounded
    quotient). A parameter whose elements all disagree gets 1000: nothing is kept."""
    for k in range(start, stop, stride):
        if present[k] != 0 and sums[k, 1] > 0:
            scale[k] = sums[k, 0] / sums[k, 1]  # float64 on purpose: the counts are exact
            if scale[k] < 1e-3:
                scale[k] = 1e-3
            scale[k] = 1.0 / scale[k]
