"""Element arithmetic for the bodies of your own rules (:func:`flatopt.define_optimizer`): the
pieces the built-in rules are made of, rounded as torch's CPU kernels round them::

    from flatopt.blocks import fma, lerp

    def my_update(p, g, m, w, lr):
        m = lerp(m, g, w)              # torch's m.lerp_(g, w), to the bit
        return fma(m, -lr, p), m       # torch's p.add_(m, alpha=-lr): one rounding

- :func:`lerp`: ``torch.lerp``; ``square_ema(v, g, beta, one_minus_beta)``: a second moment
  as torch's ``v.mul_(beta).addcmul_(g, g, value=1 - beta)``; ``cautious(u, g, scale)``:
  timm's cautious mask (``u * scale`` where ``u`` agrees in sign with ``g``, else 0);
  ``fma(a, b, c)``: ``a * b + c`` rounded once (torch's ``add`` with ``alpha``); for a
  ``per_step`` body, ``bias_correction(beta, step)``: ``1 - beta ** step`` in float64.

Each is a plain function a rule's body calls; flatopt compiles it into the body for every
backend (the CPU walks, CUDA), with the value types of the call: a float32 rule stays float32.
The built-in rules call these same functions (Adam's, ADOPT's, AdEMAMix's, schedule-free's).
"""

from __future__ import annotations

from .kernels.arithmetic import fma
from .kernels.rules.caution import cautious
from .kernels.rules.moments import bias_correction, nearer_lerp, square_ema

__all__ = ["lerp", "square_ema", "cautious", "fma", "bias_correction"]


def lerp(start, end, weight):
    """``torch.lerp(start, end, weight)`` as torch's CPU kernel computes it: one fused
    multiply-add from the nearer end, ``start + weight * (end - start)`` when ``|weight| <
    0.5``, else ``end + (weight - 1) * (end - start)`` (with ``weight`` = 1 the result is then
    exactly ``end``). The built-in rules (Adam's first moment, Adamax, ADOPT, schedule-free)
    call the same ``nearer_lerp`` with the end chosen once per step."""
    from_end = abs(weight) >= 0.5
    return nearer_lerp(start, end, weight - from_end, from_end)  # a bool subtracts as 0 or 1
