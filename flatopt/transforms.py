"""optax-style gradient transformations, chained into one fused rule: :func:`chain`.

Each transformation is a :class:`Transform`: an element function ``piece(u, p, *state,
*values) -> (u, *state)`` (``u`` the update so far, starting as the gradient; ``p`` the
parameter, read only), its state slots, hyperparameters, and optionally the ``derived`` and
``per_step`` functions of :func:`flatopt.define_optimizer`. :func:`chain` writes one update
function calling the pieces in order, then ``p = p + u``, and defines it as an optimizer with
:func:`flatopt.define_optimizer`: one pass over each buffer, whatever the number of pieces.

Names: a piece's hyperparameters and slots keep their optax names (``b1``, ``mu``) in the
chain; a name that a second piece uses again gets the suffix ``_2`` (``_3``, ...). The
learning rate is the group's ``lr`` (flatopt's schedulers change it, as torch's do).

What each piece computes (optax 0.2.8, ``optax/_src/transform.py``, with ``t`` the
parameter's step count):

- ``scale_by_adam(b1, b2, eps, eps_root)``: ``mu = (1 - b1) g + b1 mu``, ``nu = (1 - b2) g^2
  + b2 nu``, ``u = (mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t) + eps_root) + eps)``.
- ``scale_by_rms(decay, eps)``: ``nu = (1 - decay) g^2 + decay nu``, ``u = g / sqrt(nu +
  eps)`` (optax's ``initial_scale`` other than 0 is refused: state starts at zero).
- ``scale_by_sign()``: ``u = sign(u)`` (0 for 0).
- ``trace(decay, nesterov)``: ``t = u + decay t``; ``u = t``, or ``u + decay t`` with nesterov.
- ``add_decayed_weights(weight_decay)``: ``u = u + weight_decay p``.
- ``scale_by_learning_rate(lr)``: ``u = -lr u``.
- ``clip_by_global_norm(max_norm)``: first in a chain only; the step's gradient clipping
  (``step(max_grad_norm=...)``: torch's ``clip_grad_norm_``, ``g * min(1, max_norm / (norm +
  1e-6))`` over every parameter), where optax multiplies by ``max_norm / norm`` when ``norm >
  max_norm``: the two differ by the 1e-6 in the denominator.
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from .kernels.elementwise import compile_function
from .custom import define_optimizer
from .errors import RuleDefinitionError
from .optimizer import Optimizer
from .schema import Hyperparameter, Invalid, Slot, flag, non_negative


class Transform(NamedTuple):
    """One gradient transformation of a chain (see the module docstring)."""

    kind: str
    piece: Callable | None
    state: dict[str, Slot]
    hyperparameters: dict[str, Any]
    derived: Callable | None = None
    per_step: Callable | None = None
    per_step_values: tuple[str, ...] = ()
    clip_norm: float | None = None
    mask: tuple[str, ...] | None = None
    """Path patterns: the piece applies to the parameters matching one (:func:`masked`)."""


# ----------------------------------------------------------------------------- pieces
def adam_piece(u, p, mu, nu, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root,
               bias_correction1, bias_correction2):
    mu = one_minus_b1 * u + b1 * mu
    nu = one_minus_b2 * (u * u) + b2 * nu
    return (mu / bias_correction1) / (math.sqrt(nu / bias_correction2 + eps_root) + eps), mu, nu


def adam_derived(b1, b2):
    return {"one_minus_b1": 1.0 - b1, "one_minus_b2": 1.0 - b2}


def adam_per_step(step, b1, b2):
    return 1.0 - b1 ** step, 1.0 - b2 ** step


def rms_piece(u, p, nu, decay, one_minus_decay, eps):
    nu = one_minus_decay * (u * u) + decay * nu
    return u / math.sqrt(nu + eps), nu


def rms_derived(decay):
    return {"one_minus_decay": 1.0 - decay}


def sign_piece(u, p, one):
    # ``one``: 1 in the buffer's dtype (a literal would make a float32 kernel float64)
    if u > 0:
        return one
    if u < 0:
        return -one
    return u


def sign_derived():
    return {"one": 1.0}


def trace_piece(u, p, trace, decay, nesterov):
    trace = u + decay * trace
    if nesterov:
        return u + decay * trace, trace
    return trace, trace


def decay_piece(u, p, weight_decay):
    return u + weight_decay * p


def learning_rate_piece(u, p, neg_lr):
    return neg_lr * u


def learning_rate_derived(lr):
    return {"neg_lr": -lr}


# ----------------------------------------------------------------------------- transforms
def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  eps_root: float = 0.0) -> Transform:
    """Adam's scaling (optax.scale_by_adam): slots ``mu``, ``nu``."""
    return Transform("scale_by_adam", adam_piece, {"mu": Slot(), "nu": Slot(nonnegative=True)},
                     {"b1": _unit(b1), "b2": _unit(b2), "eps": _non_negative(eps),
                      "eps_root": _non_negative(eps_root)},
                     adam_derived, adam_per_step, ("bias_correction1", "bias_correction2"))


def scale_by_rms(decay: float = 0.9, eps: float = 1e-8,
                 initial_scale: float = 0.0) -> Transform:
    """RMSprop's scaling (optax.scale_by_rms): slot ``nu``."""
    if initial_scale != 0.0:
        raise RuleDefinitionError(f"scale_by_rms: initial_scale={initial_scale!r}: flatopt's "
                                  "state starts at zero (only 0.0)")
    return Transform("scale_by_rms", rms_piece, {"nu": Slot(nonnegative=True)},
                     {"decay": _unit(decay), "eps": _non_negative(eps)}, rms_derived)


def scale_by_sign() -> Transform:
    """``sign(u)`` (optax.scale_by_sign)."""
    return Transform("scale_by_sign", sign_piece, {}, {}, sign_derived)


def trace(decay: float = 0.9, nesterov: bool = False) -> Transform:
    """Momentum (optax.trace): slot ``trace``."""
    return Transform("trace", trace_piece, {"trace": Slot()},
                     {"decay": _non_negative(decay),
                      "nesterov": Hyperparameter(bool(nesterov), flag, (False, True))})


def add_decayed_weights(weight_decay: float = 0.0) -> Transform:
    """``u + weight_decay * p`` (optax.add_decayed_weights)."""
    return Transform("add_decayed_weights", decay_piece, {},
                     {"weight_decay": _non_negative(weight_decay)})


def scale_by_learning_rate(lr: float) -> Transform:
    """``-lr * u`` (optax.scale_by_learning_rate); ``lr`` is the group's, which flatopt's
    schedulers (``flatopt.lr_scheduler``) change at every step."""
    return Transform("scale_by_learning_rate", learning_rate_piece, {},
                     {"lr": _non_negative(lr)}, learning_rate_derived)


def clip_by_global_norm(max_norm: float) -> Transform:
    """Gradient clipping by the global norm, first in a chain (see the module docstring)."""
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise RuleDefinitionError(f"clip_by_global_norm: max_norm must be a finite number > 0, "
                                  f"got {max_norm!r}")
    return Transform("clip_by_global_norm", None, {}, {}, clip_norm=float(max_norm))


def masked(inner: Transform, mask: str | Sequence[str]) -> Transform:
    """``inner`` applied only to parameters whose path matches a pattern of ``mask`` (glob
    patterns, ``*`` crossing dots, as :func:`flatopt.group_by_pattern`); the others' update
    passes through unchanged, as ``optax.masked`` (whose mask is a tree of booleans). The
    mask is a constant of each parameter, set when it is added; ``inner``'s state exists for
    every parameter (staying zero where masked out)."""
    patterns = (mask,) if isinstance(mask, str) else tuple(mask)
    if not isinstance(inner, Transform) or inner.piece is None or inner.mask is not None:
        raise RuleDefinitionError("masked() takes one transformation that is neither "
                                  "clipping nor masked already")
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise RuleDefinitionError(f"masked(): mask must be a path pattern or a sequence of "
                                  f"them, got {mask!r}")
    return inner._replace(kind=f"masked_{inner.kind}", mask=patterns)


class PathMask:
    """1.0 for a path matching one of ``patterns``, else 0.0 (a ``per_parameter`` value)."""

    def __init__(self, patterns: tuple[str, ...]):
        self.patterns = patterns

    def __call__(self, path: str, shape: tuple) -> float:
        return 1.0 if any(fnmatchcase(path, p) for p in self.patterns) else 0.0


def _unit(value: float) -> Hyperparameter:
    return Hyperparameter(value, _beta, (value,))


def _beta(value: Any) -> float:
    number = non_negative(value)
    if number >= 1.0:
        raise Invalid(f"must be in [0, 1), got {value!r}")
    return number


def _non_negative(value: float) -> Hyperparameter:
    return Hyperparameter(value, non_negative, (value,))


# ----------------------------------------------------------------------------- chain
def chain(*transforms: Transform, name: str | None = None) -> type[Optimizer]:
    """An optimizer class applying ``transforms`` in order to each element's gradient, then
    ``p = p + u``, in one fused pass (see the module docstring). ``name`` is the registry
    name saved in checkpoints (default: the transforms' kinds joined by ``+``)."""
    if not transforms or not all(isinstance(t, Transform) for t in transforms):
        raise RuleDefinitionError("chain() takes one or more transformations "
                                  "(flatopt.transforms.scale_by_adam(), ...)")
    clips = [position for position, t in enumerate(transforms) if t.clip_norm is not None]
    if clips and clips != [0]:
        raise RuleDefinitionError("clip_by_global_norm must come first in a chain, once (it "
                                  "clips the gradients before the step)")
    pieces = [t for t in transforms if t.piece is not None]
    if not pieces:
        raise RuleDefinitionError("a chain needs a transformation besides clipping")
    name = name or "chain:" + "+".join(t.kind for t in transforms)
    taken: set[str] = set()
    renames = [_rename(t, taken) for t in pieces]
    state = {renamed[slot]: t.state[slot] for t, renamed in zip(pieces, renames)
             for slot in t.state}
    hypers = {renamed[k]: v for t, renamed in zip(pieces, renames)
              for k, v in t.hyperparameters.items()}
    sources, namespace = {}, {}
    update = _generated("chain_update", _update_source(pieces, renames, state), pieces,
                        sources, namespace)
    derived = per_step = None
    per_step_values: tuple[str, ...] = ()
    if any(t.derived for t in pieces):
        derived = _generated("chain_derived", _derived_source(pieces, renames), pieces,
                             sources, namespace)
    if any(t.per_step for t in pieces):
        per_step_values = tuple(renamed[v] for t, renamed in zip(pieces, renames)
                                for v in t.per_step_values)
        per_step = _generated("chain_per_step", _per_step_source(pieces, renames), pieces,
                              sources, namespace)
    masks = {renamed["mask"]: PathMask(t.mask) for t, renamed in zip(pieces, renames)
             if t.mask is not None}
    cls = define_optimizer(name, update, hyperparameters=hypers, state=state, derived=derived,
                           per_step=per_step, per_step_values=per_step_values,
                           per_parameter=masks,
                           int8_state=True, sources=sources,
                           doc=f"{name}: optax-style chain, one fused pass per buffer.")
    if clips:
        cls.max_grad_norm = transforms[0].clip_norm
        cls.step = _clipping_step
    return cls


def _clipping_step(self, grads=None, *, max_grad_norm=None, **options):
    """Optimizer.step with the chain's clip_by_global_norm as the default max_grad_norm."""
    norm = self.max_grad_norm if max_grad_norm is None else max_grad_norm
    return Optimizer.step(self, grads, max_grad_norm=norm, **options)


def _parameters(function: Callable) -> tuple[str, ...]:
    code = function.__code__
    return code.co_varnames[:code.co_argcount]


def _rename(t: Transform, taken: set[str]) -> dict[str, str]:
    """The transform's local names (slots, hyperparameters, derived and per_step values)
    -> the chain's: the same, or with ``_2``, ``_3`` ... where an earlier piece took it."""
    local = [*t.state, *t.hyperparameters, *t.per_step_values, *(["mask"] if t.mask else []),
             *[v for v in _parameters(t.piece)[2 + len(t.state):]
               if v not in t.hyperparameters and v not in t.per_step_values]]
    renamed = {}
    for word in dict.fromkeys(local):
        chosen, n = word, 1
        while chosen in taken:
            n += 1
            chosen = f"{word}_{n}"
        taken.add(chosen)
        renamed[word] = chosen
    return renamed


def _update_source(pieces, renames, state: Mapping[str, Slot]) -> str:
    slots = [f"_s{j}" for j in range(len(state))]
    slot_of = dict(zip(state, slots))
    values = list(dict.fromkeys(renamed[v] for t, renamed in zip(pieces, renames)
                                for v in [*_parameters(t.piece)[2 + len(t.state):],
                                          *(["mask"] if t.mask else [])]))
    lines = [f"def chain_update({', '.join(['_p', '_g', *slots, *values])}):", "    _u = _g"]
    for t, renamed in zip(pieces, renames):
        own = [slot_of[renamed[s]] for s in t.state]
        arguments = ["_u", "_p", *own,
                     *[renamed[v] for v in _parameters(t.piece)[2 + len(t.state):]]]
        targets = ", ".join(["_u", *own])
        indent = "    "
        if t.mask is not None:  # a constant per parameter: the same branch for all its elements
            lines.append(f"    if {renamed['mask']} != 0:")
            indent = "        "
        lines.append(f"{indent}{targets} = {t.piece.__name__}({', '.join(arguments)})")
    lines += ["    _p = _p + _u", f"    return {', '.join(['_p', *slots])}", ""]
    return "\n".join(lines)


def _derived_source(pieces, renames) -> str:
    reads = list(dict.fromkeys(renamed[v] for t, renamed in zip(pieces, renames) if t.derived
                               for v in _parameters(t.derived)))
    lines = [f"def chain_derived({', '.join(reads)}):", "    out = {}"]
    for j, (t, renamed) in enumerate(zip(pieces, renames)):
        if t.derived is None:
            continue
        arguments = ", ".join(renamed[v] for v in _parameters(t.derived))
        lines.append(f"    for key, value in {t.derived.__name__}({arguments}).items():")
        lines.append(f"        out[{_keys(renamed)}[key]] = value")
    lines += ["    return out", ""]
    return "\n".join(lines)


def _keys(renamed: Mapping[str, str]) -> str:
    return repr(dict(renamed))


def _per_step_source(pieces, renames) -> str:
    reads = list(dict.fromkeys(renamed[v] for t, renamed in zip(pieces, renames) if t.per_step
                               for v in _parameters(t.per_step)[1:]))
    lines = [f"def chain_per_step({', '.join(['step', *reads])}):"]
    results = []
    for j, (t, renamed) in enumerate(zip(pieces, renames)):
        if t.per_step is None:
            continue
        names = [f"_v{j}_{n}" for n in range(len(t.per_step_values))]
        arguments = ", ".join(["step", *[renamed[v] for v in _parameters(t.per_step)[1:]]])
        lines.append(f"    {''.join(n + ', ' for n in names)}= {t.per_step.__name__}({arguments})")
        results += names
    lines += [f"    return {''.join(n + ', ' for n in results)}", ""]
    return "\n".join(lines)


def _generated(function_name: str, source: str, pieces, sources: dict,
               namespace: dict) -> Callable:
    for t in pieces:
        for function in filter(None, (t.piece, t.derived, t.per_step)):
            namespace[function.__name__] = function
    sources[function_name] = source
    # filed under a module of its own: its own namespace when bound (_bind)
    return compile_function(source, function_name, dict(namespace), f"{__name__}.generated")
