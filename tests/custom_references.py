"""NumPy oracles for rules flatopt users define themselves: AdaBelief, Adan, and optax's transforms.

Self-contained (NumPy and the standard library only), so tests can use it with neither torch,
pytorch_optimizer nor jax installed. Every function is a transcription, in the same order of
operations, of one upstream source; each docstring cites the file and lines it follows:

* ``adabelief_reference`` and ``adan_reference`` follow pytorch_optimizer 4.1.0
  (``pytorch_optimizer/optimizer/adabelief.py``, ``adan.py``, and the helpers in
  ``pytorch_optimizer/base/optimizer.py``). They were checked against the real optimizers in
  float64 (both their ``foreach`` and per-parameter paths), agreeing to ~1e-16 relative.
* The optax part follows optax 0.2.8 (``optax/_src/transform.py``, ``alias.py``, ``numerics.py``,
  ``update.py``, ``optax/transforms/_accumulation.py``, ``_adding.py``, ``_clipping.py``,
  ``_combining.py``, ``_masking.py`` and ``optax/tree_utils/_tree_math.py``; in 0.2.8
  ``optax/_src/combine.py`` only re-exports ``optax.transforms._combining`` and there is no
  ``optax/_src/clipping.py``). A transform is a ``GradientTransformation(init, update)`` pair over
  trees of NumPy arrays (nested dicts, lists or tuples of arrays; ``None`` leaves pass through).
  Arithmetic happens in the arrays' own dtype (NumPy 2's weak Python scalars, like jax's), so
  float64 inputs mirror optax under ``jax_enable_x64`` and float32 inputs mirror its default.

The pytorch_optimizer references take ``params`` as a list of float64 arrays (or one array) and
``grads_per_step`` as a list, one entry per step, of such lists (or of single arrays); they return
the parameters after each step, one list of arrays per step (or one array per step when a single
array was given).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    # pytorch_optimizer 4.1.0
    "adabelief_reference",
    "adan_reference",
    # optax 0.2.8
    "GradientTransformation",
    "EmptyState",
    "ScaleByAdamState",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "ScaleByScheduleState",
    "TraceState",
    "WeightDecaySchedule",
    "MaskedState",
    "safe_int32_increment",
    "tree_update_moment",
    "tree_update_moment_per_elem_norm",
    "tree_bias_correction",
    "tree_norm",
    "identity",
    "scale",
    "scale_by_schedule",
    "scale_by_adam",
    "scale_by_rms",
    "scale_by_sign",
    "trace",
    "add_decayed_weights",
    "masked",
    "scale_by_learning_rate",
    "clip_by_global_norm",
    "chain",
    "apply_updates",
    "adamw",
    "adam",
    "sgd",
    "run_transform",
]


# ---------------------------------------------------------------------------------------------
# pytorch_optimizer 4.1.0: shared pieces
# ---------------------------------------------------------------------------------------------


def _as_list(params, grads_per_step):
    """Normalize the (list of arrays | one array) convention; returns (params, grads, single)."""
    single = isinstance(params, np.ndarray)
    if single:
        params = [params]
        grads_per_step = [[g] for g in grads_per_step]
    params = [np.array(p, dtype=np.asarray(p).dtype, copy=True) for p in params]
    grads_per_step = [[np.array(g, dtype=params[i].dtype, copy=True) for i, g in enumerate(gs)]
                      for gs in grads_per_step]
    for k, gs in enumerate(grads_per_step):
        if len(gs) != len(params):
            raise ValueError(f"step {k}: {len(gs)} gradients for {len(params)} parameters")
        for p, g in zip(params, gs):
            if p.shape != g.shape:
                raise ValueError(f"step {k}: gradient shape {g.shape} != parameter {p.shape}")
    return params, grads_per_step, single


def _lerp(start, end, weight):
    """``torch.lerp(start, end, weight)`` as torch's CPU kernel computes it (ATen/native/Lerp.h):
    ``start + weight * (end - start)`` when ``|weight| < 0.5``, else
    ``end - (end - start) * (1 - weight)``."""
    if abs(weight) < 0.5:
        return start + weight * (end - start)
    return end - (end - start) * (1.0 - weight)


def _addcdiv(p, t1, t2, value):
    """``p.addcdiv_(t1, t2, value=value)`` as torch's CPU kernel computes it
    (ATen/native/cpu/PointwiseOpsKernel.cpp): ``p + value * t1 / t2``, left to right."""
    p += value * t1 / t2


def _debias(beta: float, step: int) -> float:
    """``BaseOptimizer.debias`` (base/optimizer.py:269-278): ``1 - math.pow(beta, step)``."""
    return 1.0 - math.pow(beta, step)


def _adanorm_gradient(grad, adanorm: bool, exp_grad_norm, r):
    """``BaseOptimizer.get_adanorm_gradient`` (base/optimizer.py:350-377).

    ``exp_grad_norm`` is the one-element state array ``exp_grad_adanorm`` (updated in place):
    ``e = r * e + (1 - r) * ||g||_2``; returns ``g * e / ||g||`` when ``||g|| > 0`` and
    ``e > ||g||``, else ``g`` itself. ``r`` defaults to 0.95 (group key ``adanorm_r``)."""
    if not adanorm or exp_grad_norm is None:
        return grad
    if r is None:
        r = 0.95
    grad_norm = np.linalg.norm(grad.ravel())
    exp_grad_norm *= r
    exp_grad_norm += grad_norm * (1.0 - r)
    if grad_norm > 0 and exp_grad_norm[0] > grad_norm:
        return grad * exp_grad_norm[0] / grad_norm
    return grad


def _rectify_step_size(is_rectify, step, lr, beta2, n_sma_threshold, degenerated_to_sgd):
    """``BaseOptimizer.get_rectify_step_size`` (base/optimizer.py:309-348): RAdam's ``rt``."""
    step_size = lr
    n_sma = 0.0
    if is_rectify:
        n_sma_max = 2.0 / (1.0 - beta2) - 1.0
        beta2_t = beta2 ** step
        n_sma = n_sma_max - 2 * step * beta2_t / (1.0 - beta2_t)
        if n_sma >= n_sma_threshold:
            rt = math.sqrt((1.0 - beta2_t) * (n_sma - 4) / (n_sma_max - 4) * (n_sma - 2) / n_sma
                           * n_sma_max / (n_sma_max - 2))
        elif degenerated_to_sgd:
            rt = 1.0
        else:
            rt = -1.0
        step_size = step_size * rt
    return step_size, n_sma


def _snapshot(state):
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}


# ---------------------------------------------------------------------------------------------
# AdaBelief
# ---------------------------------------------------------------------------------------------


def adabelief_reference(params, grads_per_step, *, lr: float = 1e-3,
                        betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                        weight_decouple: bool = True, fixed_decay: bool = False,
                        rectify: bool = False, n_sma_threshold: int = 5,
                        degenerated_to_sgd: bool = True, ams_bound: bool = False,
                        eps: float = 1e-16, maximize: bool = False, adanorm: bool = False,
                        adanorm_r: float = 0.95, adam_debias: bool = False,
                        return_state: bool = False):
    """pytorch_optimizer 4.1.0 ``AdaBelief`` (one parameter group), step by step.

    Defaults are the constructor's (optimizer/adabelief.py:33-48): lr=1e-3, betas=(0.9, 0.999),
    weight_decay=0, weight_decouple=True, fixed_decay=False, rectify=False, n_sma_threshold=5,
    degenerated_to_sgd=True, ams_bound=False, eps=1e-16, maximize=False. ``adanorm``,
    ``adanorm_r`` and ``adam_debias`` are the ``**kwargs`` group keys the code reads with
    ``group.get`` (adabelief.py:99, 178-183, 234-238).

    Per step (``step`` is a group counter, 0 before the first step and incremented first,
    adabelief.py:79-80, 219), with ``k = step``, for each parameter ``p`` with gradient ``g``:

    1. ``bc1 = 1 - b1**k``; ``step_size = lr`` (times RAdam's ``rt`` when ``rectify``,
       base/optimizer.py:309-348), then ``step_size /= bc1`` unless ``adam_debias``
       (adabelief.py:223-238, base/optimizer.py:297-307).
    2. ``g = -g`` if ``maximize`` (adabelief.py:161).
    3. weight decay before the moments (adabelief.py:165-172, base/optimizer.py:181-209):
       decoupled: ``p *= 1 - wd * (1 if fixed_decay else lr)``; coupled: ``g += wd * p``
       (torch modifies ``p.grad`` in place there).
    4. ``s = adanorm(g)`` (only the first moment sees it, adabelief.py:178-185).
    5. ``exp_avg = lerp(exp_avg, s, 1 - b1)`` (adabelief.py:185).
    6. ``r = g - exp_avg`` with the NEW ``exp_avg`` (adabelief.py:187).
    7. ``exp_avg_var = b2 * exp_avg_var + (1 - b2) * r * r + eps``: eps is added to the stored
       state every step (adabelief.py:188).
    8. ``D = sqrt(exp_avg_var)``, or ``sqrt(max_exp_avg_var)`` after
       ``max_exp_avg_var = max(max_exp_avg_var, exp_avg_var)`` when ``ams_bound``
       (adabelief.py:190-196, base/optimizer.py:211-238 with eps=0, exp_avg_sq_eps=0).
    9. not rectify: ``D = D / sqrt(1 - b2**k) + eps``; ``p += -step_size * exp_avg / D``
       (adabelief.py:198-201; the foreach path 111-148 is the same arithmetic).
       rectify: ``D = D + eps`` (no bias correction 2: ``rt`` contains it); if
       ``n_sma >= n_sma_threshold``: ``p += -step_size * exp_avg / D``, elif
       ``step_size > 0`` (degenerated_to_sgd): ``p += -step_size * exp_avg``; else nothing
       (adabelief.py:203-208).

    State per parameter: ``exp_avg``, ``exp_avg_var`` (zeros), ``max_exp_avg_var`` if
    ``ams_bound``, ``exp_grad_adanorm`` (shape (1,)) if ``adanorm`` (adabelief.py:92-100).
    With ``return_state=True`` returns ``(params_per_step, states_per_step)``, each state a list
    (per parameter) of dicts of copies, plus the key ``step``.
    """
    params, grads_per_step, single = _as_list(params, grads_per_step)
    beta1, beta2 = betas
    states = [{"exp_avg": np.zeros_like(p), "exp_avg_var": np.zeros_like(p)} for p in params]
    for p, st in zip(params, states):
        if ams_bound:
            st["max_exp_avg_var"] = np.zeros_like(p)
        if adanorm:
            st["exp_grad_adanorm"] = np.zeros((1,), dtype=p.dtype)
    out, out_states = [], []
    step = 0
    for grads in grads_per_step:
        step += 1
        bias_correction1 = _debias(beta1, step)
        step_size, n_sma = _rectify_step_size(rectify, step, lr, beta2, n_sma_threshold,
                                              degenerated_to_sgd)
        step_size = step_size if adam_debias else step_size / bias_correction1
        bias_correction2_sq = math.sqrt(_debias(beta2, step))
        for i, (p, grad) in enumerate(zip(params, grads)):
            st = states[i]
            if maximize:
                grad = -grad
            if weight_decay != 0.0:
                if weight_decouple:
                    p *= 1.0 - weight_decay * (1.0 if fixed_decay else lr)
                elif weight_decay > 0.0:
                    grad = grad + weight_decay * p
            s_grad = _adanorm_gradient(grad, adanorm, st.get("exp_grad_adanorm"), adanorm_r)
            st["exp_avg"] = _lerp(st["exp_avg"], s_grad, 1.0 - beta1)
            exp_avg = st["exp_avg"]
            grad_residual = grad - exp_avg
            st["exp_avg_var"] = (st["exp_avg_var"] * beta2
                                 + (1.0 - beta2) * grad_residual * grad_residual) + eps
            if ams_bound:
                st["max_exp_avg_var"] = np.maximum(st["max_exp_avg_var"], st["exp_avg_var"])
                de_nom = np.sqrt(st["max_exp_avg_var"])
            else:
                de_nom = np.sqrt(st["exp_avg_var"])
            if not rectify:
                de_nom = de_nom / bias_correction2_sq + eps
                _addcdiv(p, exp_avg, de_nom, -step_size)
                continue
            de_nom = de_nom + eps
            if n_sma >= n_sma_threshold:
                _addcdiv(p, exp_avg, de_nom, -step_size)
            elif step_size > 0:
                p += -step_size * exp_avg
        out.append(params[0].copy() if single else [p.copy() for p in params])
        if return_state:
            out_states.append([dict(_snapshot(st), step=step) for st in states])
    return (out, out_states) if return_state else out


# ---------------------------------------------------------------------------------------------
# Adan
# ---------------------------------------------------------------------------------------------


def _adan_clip_coefficient(grads, max_grad_norm: float, eps: float):
    """``Adan.get_global_gradient_norm`` (adan.py:95-103) over
    ``utils.gradient.get_global_gradient_norm`` (optimizer/utils/gradient.py:107-151).

    1.0 when ``max_grad_norm == 0``; otherwise, in FLOAT32 whatever the parameters' dtype
    (the per-tensor norms are stacked, cast with ``.float()`` and squared there):
    ``min(max_grad_norm / (sqrt(sum_i float32(||g_i||)**2) + eps), 1)``. Computed on the raw
    gradients (before ``maximize``), with the optimizer's constructor ``eps`` and
    ``max_grad_norm`` (``self.defaults``), across every group.
    """
    if max_grad_norm == 0.0:
        return 1.0
    norms = np.array([np.linalg.norm(g.ravel()) for g in grads], dtype=np.float64)
    squared = np.square(norms.astype(np.float32))
    total = np.float32(squared.sum(dtype=np.float32))
    denom = np.float32(np.sqrt(total)) + np.float32(eps)
    return float(min(np.float32(np.float32(max_grad_norm) / np.float32(denom)), np.float32(1.0)))


def _centralize_gradient(grad):
    """``centralize_gradient(grad, gc_conv_only=False)`` (optimizer/gradient_centralization.py:
    6-20): for ``ndim > 1`` subtract the mean over every axis but the first."""
    if grad.ndim > 1:
        grad = grad + (-grad.mean(axis=tuple(range(1, grad.ndim)), keepdims=True))
    return grad


def adan_reference(params, grads_per_step, *, lr: float = 1e-3,
                   betas: tuple[float, float, float] = (0.98, 0.92, 0.99),
                   weight_decay: float = 0.0, weight_decouple: bool = False,
                   max_grad_norm: float = 0.0, eps: float = 1e-8, maximize: bool = False,
                   use_gc: bool = False, adanorm: bool = False, adanorm_r: float = 0.95,
                   return_state: bool = False):
    """pytorch_optimizer 4.1.0 ``Adan`` (one parameter group), step by step.

    Defaults are the constructor's (optimizer/adan.py:31-43): lr=1e-3, betas=(0.98, 0.92, 0.99),
    weight_decay=0, weight_decouple=False (the paper's proximal decay), max_grad_norm=0 (no
    clipping), eps=1e-8, maximize=False; ``use_gc``, ``adanorm``, ``adanorm_r`` are ``**kwargs``
    group keys (adan.py:92, 194-204).

    Per step, with ``k = step`` (group counter incremented first, adan.py:71-72, 239):

    0. ``c = clip coefficient`` (1.0 without max_grad_norm; see ``_adan_clip_coefficient``,
       adan.py:235). On the FIRST step the state is created with ``exp_avg = exp_avg_sq =
       exp_avg_diff = 0`` and ``previous_grad = -c * g_raw`` (the raw gradient, before
       ``maximize`` and gradient centralization; adan.py:86-93), so the first gradient
       difference is 0 (in the plain configuration).
    1. ``bc1 = 1 - b1**k``, ``bc2 = 1 - b2**k``, ``bc3_sq = sqrt(1 - b3**k)`` (adan.py:171-173).
    2. ``g = -g`` if maximize; ``g = g * c``; ``g = centralize(g)`` if use_gc (adan.py:181-195).
    3. ``d = previous_grad + g`` (``previous_grad`` stores the NEGATED previous gradient, so
       ``d = g_k - g_{k-1}``) (adan.py:197).
    4. ``exp_avg = lerp(exp_avg, adanorm(g), 1 - b1)``;
       ``exp_avg_diff = lerp(exp_avg_diff, d, 1 - b2)`` (adan.py:199-207).
    5. ``u = d * b2 + g`` (= g + b2 (g - g_prev));
       ``exp_avg_sq = exp_avg_sq * b3 + (1 - b3) * u * u`` (adan.py:209-210).
    6. ``D = sqrt(exp_avg_sq) / bc3_sq + eps`` (eps outside the root, not stored; adan.py:212).
    7. if wd and weight_decouple: ``p *= 1 - lr * wd`` (adan.py:214-215).
    8. ``p += -(lr / bc1) * exp_avg / D``; then ``p += -(lr * b2 / bc2) * exp_avg_diff / D``
       (adan.py:217-218).
    9. if wd and not weight_decouple: ``p /= 1 + lr * wd`` (adan.py:220-221).
    10. ``previous_grad = -g`` (the clipped, centralized, possibly negated g; adan.py:223-226;
        the per-parameter path negates ``p.grad`` in place to do it, the foreach path copies).

    The foreach path (adan.py:114-166, the default on CPU for real dense tensors without use_gc or
    adanorm) is the same arithmetic. With ``return_state=True`` returns
    ``(params_per_step, states_per_step)``: per step a list (per parameter) of dicts with
    ``exp_avg``, ``exp_avg_sq``, ``exp_avg_diff``, ``previous_grad`` (and ``exp_grad_adanorm``),
    plus ``step``.
    """
    params, grads_per_step, single = _as_list(params, grads_per_step)
    beta1, beta2, beta3 = betas
    states = None
    out, out_states = [], []
    step = 0
    for grads in grads_per_step:
        clip = _adan_clip_coefficient(grads, max_grad_norm, eps)
        if states is None:
            states = []
            for p, g in zip(params, grads):
                st = {"exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p),
                      "exp_avg_diff": np.zeros_like(p), "previous_grad": g * (-clip)}
                if adanorm:
                    st["exp_grad_adanorm"] = np.zeros((1,), dtype=p.dtype)
                states.append(st)
        step += 1
        bias_correction1 = _debias(beta1, step)
        bias_correction2 = _debias(beta2, step)
        bias_correction3_sq = math.sqrt(_debias(beta3, step))
        for i, (p, grad) in enumerate(zip(params, grads)):
            st = states[i]
            if maximize:
                grad = -grad
            grad = grad * clip
            if use_gc:
                grad = _centralize_gradient(grad)
            grad_diff = st["previous_grad"] + grad
            s_grad = _adanorm_gradient(grad, adanorm, st.get("exp_grad_adanorm"), adanorm_r)
            st["exp_avg"] = _lerp(st["exp_avg"], s_grad, 1.0 - beta1)
            st["exp_avg_diff"] = _lerp(st["exp_avg_diff"], grad_diff, 1.0 - beta2)
            grad_diff = grad_diff * beta2 + grad
            st["exp_avg_sq"] = st["exp_avg_sq"] * beta3 + (1.0 - beta3) * grad_diff * grad_diff
            de_nom = np.sqrt(st["exp_avg_sq"]) / bias_correction3_sq + eps
            if weight_decay != 0.0 and weight_decouple:
                p *= 1.0 - lr * weight_decay
            _addcdiv(p, st["exp_avg"], de_nom, -lr / bias_correction1)
            _addcdiv(p, st["exp_avg_diff"], de_nom, -lr * beta2 / bias_correction2)
            if weight_decay != 0.0 and not weight_decouple:
                p /= 1.0 + lr * weight_decay
            st["previous_grad"] = -grad
        out.append(params[0].copy() if single else [p.copy() for p in params])
        if return_state:
            out_states.append([dict(_snapshot(st), step=step) for st in states])
    return (out, out_states) if return_state else out


# ---------------------------------------------------------------------------------------------
# optax 0.2.8: trees, base types, numerics
# ---------------------------------------------------------------------------------------------


def _tree_map(fn, tree, *rest):
    """``jax.tree.map`` over nested dicts / lists / tuples with array (or None) leaves. Dict
    keys are visited in sorted order, like jax's flattening."""
    if isinstance(tree, dict):
        return {k: _tree_map(fn, tree[k], *(r[k] for r in rest)) for k in sorted(tree)}
    if isinstance(tree, (list, tuple)) and not _is_namedtuple(tree):
        return type(tree)(_tree_map(fn, t, *(r[j] for r in rest)) for j, t in enumerate(tree))
    return fn(tree, *rest)


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _tree_leaves(tree) -> list:
    """Leaves in jax's flattening order (sorted dict keys), ``None`` leaves dropped."""
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _tree_leaves(tree[k])]
    if isinstance(tree, (list, tuple)) and not _is_namedtuple(tree):
        return [leaf for t in tree for leaf in _tree_leaves(t)]
    return [] if tree is None else [tree]


class GradientTransformation(NamedTuple):
    """optax/_src/base.py ``GradientTransformation``: ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``."""

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


class EmptyState(NamedTuple):
    """optax/_src/base.py:219-226 ``EmptyState`` / ``init_empty_state``."""


def _init_empty_state(params) -> EmptyState:
    del params
    return EmptyState()


class ScaleByAdamState(NamedTuple):
    """optax/_src/transform.py:238-243."""

    count: np.ndarray  # shape (), int32
    mu: Any
    nu: Any


class ScaleByRmsState(NamedTuple):
    """optax/_src/transform.py:80-85."""

    nu: Any


class ScaleByRmsWithCountState(NamedTuple):
    """optax/_src/transform.py:88-92."""

    count: np.ndarray
    nu: Any


class ScaleByScheduleState(NamedTuple):
    """optax/_src/transform.py:976-979."""

    count: np.ndarray


class TraceState(NamedTuple):
    """optax/transforms/_accumulation.py:30-33."""

    trace: Any


class WeightDecaySchedule(NamedTuple):
    """optax/transforms/_adding.py:30-32."""

    count: np.ndarray


class MaskedState(NamedTuple):
    """optax/transforms/_masking.py:25-28 ``MaskedState``: the inner state (masked-in leaves)."""

    inner_state: Any


def safe_int32_increment(count):
    """optax/_src/numerics.py:106-146 (``safe_int32_increment = safe_increment``):
    ``where(count < max, count + 1, max)`` in ``count``'s dtype (int32 counters)."""
    count = np.asarray(count)
    if np.issubdtype(count.dtype, np.integer):
        max_value = np.iinfo(count.dtype).max
    elif np.issubdtype(count.dtype, np.floating):
        max_value = np.finfo(count.dtype).max
    else:
        raise ValueError(f"Cannot safely increment count with dtype {count.dtype}")
    max_value = np.array(max_value, count.dtype)
    one = np.array(1, count.dtype)
    return np.where(count < max_value, count + one, max_value).astype(count.dtype)


def _zeros_count():
    return np.zeros([], np.int32)


def _abs_sq(x):
    """optax/_src/numerics.py:31-45: ``(x.conj() * x).real``."""
    return (x.conj() * x).real


def tree_update_moment(updates, moments, decay, order):
    """optax/tree_utils/_tree_math.py:394-403: ``(1 - decay) * (g**order) + decay * t``
    (the new-gradient term FIRST, then the decayed old moment)."""
    return _tree_map(lambda g, t: None if g is None else (1 - decay) * (g ** order) + decay * t,
                     updates, moments)


def tree_update_moment_per_elem_norm(updates, moments, decay, order):
    """optax/tree_utils/_tree_math.py:418-439: ``(1 - decay) * orderth_norm(g) + decay * t``,
    where ``orderth_norm(g) = g**order`` for real ``g`` and ``abs_sq(g)**(order/2)`` for
    complex ``g``."""

    def orderth_norm(g):
        if not np.iscomplexobj(g):
            return g ** order
        half_order = order / 2
        if float(half_order).is_integer():
            half_order = int(half_order)
        return _abs_sq(g) ** half_order

    return _tree_map(lambda g, t: None if g is None else (1 - decay) * orderth_norm(g) + decay * t,
                     updates, moments)


def tree_bias_correction(moment, decay, count):
    """optax/tree_utils/_tree_math.py:442-452: ``bias = 1 - decay**count`` (computed before the
    cast, in float64 here), then ``t / bias.astype(t.dtype)``."""
    bias_correction_ = 1 - np.asarray(decay, dtype=np.float64) ** np.asarray(count)
    return _tree_map(
        lambda t: None if t is None else t / np.asarray(bias_correction_).astype(t.dtype),
        moment)


def _square(leaf):
    """optax/tree_utils/_tree_math.py:274-275: ``square(leaf.real) + square(leaf.imag)``."""
    return np.square(np.real(leaf)) + np.square(np.imag(leaf))


def tree_norm(tree, squared: bool = False):
    """optax/tree_utils/_tree_math.py:278-301 (ord=2) with ``tree_sum`` (172-199): per-leaf
    ``sum(_square(leaf))``, added left to right from 0 in flattening order, then ``sqrt``."""
    sqnorm = 0
    for leaf in _tree_leaves(tree):
        sqnorm = sqnorm + np.sum(_square(leaf))
    return np.asarray(sqnorm if squared else np.sqrt(sqnorm))


# ---------------------------------------------------------------------------------------------
# optax 0.2.8: transforms
# ---------------------------------------------------------------------------------------------


def identity() -> GradientTransformation:
    """optax/_src/base.py:229-246 ``identity``: updates unchanged, empty state."""
    return GradientTransformation(_init_empty_state, lambda updates, state, params=None:
                                  (updates, state))


def scale(step_size) -> GradientTransformation:
    """optax/_src/transform.py:495-510: ``step_size * g``."""

    def update_fn(updates, state, params=None):
        del params
        return _tree_map(lambda g: None if g is None else step_size * g, updates), state

    return GradientTransformation(_init_empty_state, update_fn)


def scale_by_schedule(step_size_fn: Callable[[np.ndarray], Any]) -> GradientTransformation:
    """optax/_src/transform.py:1008-1035: ``step_size = step_size_fn(count)`` with the count
    BEFORE it is incremented (0 on the first update), then ``array(step_size, g.dtype) * g``;
    the count then goes up by ``safe_int32_increment``."""

    def init_fn(params):
        del params
        return ScaleByScheduleState(count=_zeros_count())

    def update_fn(updates, state, params=None):
        del params
        step_size = step_size_fn(state.count)
        updates = _tree_map(
            lambda g: None if g is None else np.array(step_size, dtype=g.dtype) * g, updates)
        return updates, ScaleByScheduleState(count=safe_int32_increment(state.count))

    return GradientTransformation(init_fn, update_fn)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                  mu_dtype=None, *, nesterov: bool = False) -> GradientTransformation:
    """optax/_src/transform.py:246-309 ``scale_by_adam``.

    init: ``count = 0`` (int32), ``mu = nu = zeros_like(params)`` (mu in ``mu_dtype`` if given).
    update:
      ``mu = (1 - b1) * g + b1 * mu``            (tree_update_moment, order 1)
      ``nu = (1 - b2) * g**2 + b2 * nu``         (tree_update_moment_per_elem_norm, order 2)
      ``count_inc = safe_int32_increment(count)``  (incremented BEFORE the bias correction)
      ``mu_hat = mu / (1 - b1**count_inc)``; with nesterov:
      ``mu_hat = b1 * (mu / (1 - b1**(count_inc + 1))) + (1 - b1) * (g / (1 - b1**count_inc))``
      ``nu_hat = nu / (1 - b2**count_inc)``
      ``updates = mu_hat / (sqrt(nu_hat + eps_root) + eps)``
    The state keeps the un-corrected ``mu`` (cast to ``mu_dtype``) and ``nu`` (cast like the old
    ``nu``).
    """

    def init_fn(params):
        mu = _tree_map(lambda p: None if p is None else np.zeros_like(p, dtype=mu_dtype), params)
        nu = _tree_map(lambda p: None if p is None else np.zeros_like(p), params)
        return ScaleByAdamState(count=_zeros_count(), mu=mu, nu=nu)

    def update_fn(updates, state, params=None):
        del params
        mu = tree_update_moment(updates, state.mu, b1, 1)
        nu = tree_update_moment_per_elem_norm(updates, state.nu, b2, 2)
        count_inc = safe_int32_increment(state.count)
        if nesterov:
            mu_hat = _tree_map(
                lambda m, g: None if m is None else b1 * m + (1 - b1) * g,
                tree_bias_correction(mu, b1, safe_int32_increment(count_inc)),
                tree_bias_correction(updates, b1, count_inc))
        else:
            mu_hat = tree_bias_correction(mu, b1, count_inc)
        nu_hat = tree_bias_correction(nu, b2, count_inc)
        updates = _tree_map(
            lambda m, v: None if m is None else m / (np.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
        if mu_dtype is not None:
            mu = _tree_map(lambda m: None if m is None else m.astype(mu_dtype), mu)
        nu = _tree_map(lambda n, old: None if n is None else n.astype(old.dtype), nu, state.nu)
        return updates, ScaleByAdamState(count=count_inc, mu=mu, nu=nu)

    return GradientTransformation(init_fn, update_fn)


def scale_by_rms(decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
                 eps_in_sqrt: bool = True, bias_correction: bool = False) -> GradientTransformation:
    """optax/_src/transform.py:95-150 ``scale_by_rms``.

    init: ``nu = full_like(params, initial_scale)`` (+ ``count = 0`` when bias_correction).
    update:
      ``nu = (1 - decay) * g**2 + decay * nu``   (tree_update_moment_per_elem_norm, order 2)
      ``nu_hat = nu / (1 - decay**count_inc)`` if bias_correction (count incremented first)
      else ``nu``
      ``scaling = rsqrt(nu_hat + eps)`` (eps INSIDE the root, the default) or
      ``1 / (sqrt(nu_hat) + eps)`` when ``eps_in_sqrt=False``
      ``updates = scaling * g``
    """

    def init_fn(params):
        nu = _tree_map(lambda p: None if p is None else np.full_like(p, initial_scale), params)
        if bias_correction:
            return ScaleByRmsWithCountState(count=_zeros_count(), nu=nu)
        return ScaleByRmsState(nu=nu)

    def update_fn(updates, state, params=None):
        del params
        nu = tree_update_moment_per_elem_norm(updates, state.nu, decay, 2)
        if bias_correction:
            count_inc = safe_int32_increment(state.count)
            nu_hat = tree_bias_correction(nu, decay, count_inc)
        else:
            count_inc = None
            nu_hat = nu
        if eps_in_sqrt:
            scaling = _tree_map(lambda n: None if n is None else 1 / np.sqrt(n + eps), nu_hat)
        else:
            scaling = _tree_map(lambda n: None if n is None else 1 / (np.sqrt(n) + eps), nu_hat)
        updates = _tree_map(lambda s, g: None if g is None else s * g, scaling, updates)
        if bias_correction:
            return updates, ScaleByRmsWithCountState(count=count_inc, nu=nu)
        return updates, ScaleByRmsState(nu=nu)

    return GradientTransformation(init_fn, update_fn)


def scale_by_sign() -> GradientTransformation:
    """optax/_src/transform.py:960-973: ``sign(g)`` (0 at 0), empty state."""

    def update_fn(updates, state, params=None):
        del params
        return _tree_map(lambda g: None if g is None else np.sign(g), updates), state

    return GradientTransformation(_init_empty_state, update_fn)


def trace(decay: float, nesterov: bool = False, accumulator_dtype=None) -> GradientTransformation:
    """optax/transforms/_accumulation.py:36-79 ``trace`` (re-exported as
    ``optax._src.transform.trace``).

    ``new_trace = g + decay * trace`` (no ``1 - decay`` factor: not an EMA);
    ``updates = g + decay * new_trace`` with nesterov, else ``new_trace``.
    """

    def init_fn(params):
        return TraceState(trace=_tree_map(
            lambda p: None if p is None else np.zeros_like(p, dtype=accumulator_dtype), params))

    def update_fn(updates, state, params=None):
        del params
        f = lambda g, t: g + decay * t  # noqa: E731
        new_trace = _tree_map(lambda g, t: None if g is None else f(g, t), updates, state.trace)
        updates = _tree_map(lambda g, t: None if g is None else f(g, t), updates, new_trace) \
            if nesterov else new_trace
        if accumulator_dtype is not None:
            new_trace = _tree_map(lambda t: None if t is None else t.astype(accumulator_dtype),
                                  new_trace)
        return updates, TraceState(trace=new_trace)

    return GradientTransformation(init_fn, update_fn)


def _full_mask(mask, tree):
    """Broadcast a mask that has the structure of ``tree`` or of a prefix of it (a bool standing
    for a whole subtree) to one bool per leaf of ``tree``."""
    if isinstance(mask, (bool, np.bool_)):
        return _tree_map(lambda _: bool(mask), tree)
    if isinstance(mask, dict):
        if not isinstance(tree, dict) or sorted(mask) != sorted(tree):
            raise ValueError("mask and tree structures differ")
        return {k: _full_mask(mask[k], tree[k]) for k in sorted(tree)}
    if isinstance(mask, (list, tuple)) and not _is_namedtuple(mask):
        if len(mask) != len(tree):
            raise ValueError("mask and tree structures differ")
        return type(tree)(_full_mask(m, t) for m, t in zip(mask, tree))
    raise TypeError(f"mask leaves must be bools, got {type(mask)}")


def masked(inner: GradientTransformation, mask) -> GradientTransformation:
    """optax/transforms/_masking.py:47-149 ``masked``: ``inner`` sees only the leaves whose mask
    is True (the others become ``None`` leaves here, ``MaskedNode`` in optax, so no state is kept
    for them) and the masked-out updates pass through unchanged. ``mask`` is a tree of bools with
    the params' structure (or a prefix), or a callable returning one from the params / updates."""

    def _mask_of(tree):
        return _full_mask(mask(tree) if callable(mask) else mask, tree)

    def _select(m, tree):
        return _tree_map(lambda x, keep: x if keep else None, tree, m)

    def init_fn(params):
        return MaskedState(inner_state=inner.init(_select(_mask_of(params), params)))

    def update_fn(updates, state, params=None):
        m = _mask_of(updates)
        masked_params = None if params is None else _select(m, params)
        new_masked, new_inner = inner.update(_select(m, updates), state.inner_state,
                                             masked_params)
        merged = _tree_map(lambda old, new, keep: new if keep else old, updates, new_masked, m)
        return merged, MaskedState(inner_state=new_inner)

    return GradientTransformation(init_fn, update_fn)


def add_decayed_weights(weight_decay=0.0, mask=None) -> GradientTransformation:
    """optax/transforms/_adding.py:35-86 ``add_decayed_weights`` (re-exported as
    ``optax._src.transform.add_decayed_weights``).

    ``updates = g + s * p`` with the CURRENT params ``p`` (those passed to ``update``, i.e. before
    this step's update is applied); skipped when ``weight_decay`` is the constant 0. A callable
    ``weight_decay`` is a schedule evaluated at the count before it is incremented (state
    ``WeightDecaySchedule(count)``), else the state is empty. ``mask`` wraps it in ``masked``.
    ``params`` is required (optax raises ``ValueError(base.NO_PARAMS_MSG)``).
    """

    def init_fn(params):
        del params
        if callable(weight_decay):
            return WeightDecaySchedule(count=_zeros_count())
        return EmptyState()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("You are using a transformation that requires the current value of "
                             "parameters, but you are not passing `params` when calling `update`.")
        if callable(weight_decay):
            new_state = WeightDecaySchedule(safe_int32_increment(state.count))
        else:
            new_state = state
        if isinstance(weight_decay, (int, float)) and weight_decay == 0.0:
            return updates, new_state
        s = weight_decay(state.count) if callable(weight_decay) else weight_decay
        updates = _tree_map(lambda g, p: None if g is None else g + s * p, updates, params)
        return updates, new_state

    tx = GradientTransformation(init_fn, update_fn)
    return masked(tx, mask) if mask is not None else tx


def scale_by_learning_rate(learning_rate, *, flip_sign: bool = True) -> GradientTransformation:
    """optax/_src/transform.py:982-1005: ``m = -1 if flip_sign else 1``; ``None`` -> identity;
    a callable -> ``scale_by_schedule(lambda count: m * learning_rate(count))``; a scalar ->
    ``scale(m * learning_rate)``, i.e. ``updates = (-lr) * g`` (NEGATIVE by default, so that
    ``apply_updates`` adds it)."""
    if learning_rate is None:
        return identity()
    m = -1 if flip_sign else 1
    if callable(learning_rate):
        return scale_by_schedule(lambda count: m * learning_rate(count))
    return scale(m * learning_rate)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """optax/transforms/_clipping.py:78-110 ``clip_by_global_norm``.

    ``g_norm = tree_norm(updates)`` (sqrt of the sum over every leaf of ``real**2 + imag**2``);
    if ``g_norm < max_norm`` the updates are unchanged, else each leaf becomes
    ``(t / g_norm) * max_norm`` (divide first, then multiply). Empty state.
    """

    def update_fn(updates, state, params=None):
        del params
        g_norm = tree_norm(updates)
        trigger = bool(g_norm < max_norm)

        def clip_fn(t):
            if t is None:
                return None
            return t if trigger else (t / g_norm.astype(t.dtype)) * max_norm

        return _tree_map(clip_fn, updates), state

    return GradientTransformation(_init_empty_state, update_fn)


def chain(*args: GradientTransformation) -> GradientTransformation:
    """optax/transforms/_combining.py:26-99 ``chain`` (``optax._src.combine.chain``): the state is
    the tuple of the transforms' states; ``update`` threads the updates through them in order,
    passing the same ``params`` to each."""
    init_fns, update_fns = zip(*args) if args else ((), ())

    def init_fn(params):
        return tuple(fn(params) for fn in init_fns)

    def update_fn(updates, state, params=None):
        if len(update_fns) != len(state):
            raise ValueError("The number of updates and states has to be the same in chain! "
                             "Make sure you have called init first!")
        new_state = []
        for s, fn in zip(state, update_fns):
            updates, new_s = fn(updates, s, params)
            new_state.append(new_s)
        return updates, tuple(new_state)

    return GradientTransformation(init_fn, update_fn)


def apply_updates(params, updates):
    """optax/_src/update.py:22-47: ``asarray(p + u).astype(p.dtype)`` per leaf."""
    return _tree_map(
        lambda p, u: None if p is None else np.asarray(p + u).astype(np.asarray(p).dtype),
        params, updates)


# ---------------------------------------------------------------------------------------------
# optax 0.2.8: aliases
# ---------------------------------------------------------------------------------------------


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype=None, weight_decay=1e-4, mask=None, *,
          nesterov: bool = False) -> GradientTransformation:
    """optax/_src/alias.py:598-727 ``adamw``: exactly

    ``chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))``

    Defaults: weight_decay=1e-4 (torch.optim.AdamW's is 1e-2), mask=None (decay every leaf),
    eps=1e-8 outside the root, eps_root=0. The resulting update is
    ``u = -lr * (mu_hat / (sqrt(nu_hat + eps_root) + eps) + wd * p)`` with the pre-step ``p``.
    """
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                      nesterov=nesterov),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype=None, *, nesterov: bool = False
         ) -> GradientTransformation:
    """optax/_src/alias.py:414-530 ``adam``: ``chain(scale_by_adam(...),
    scale_by_learning_rate(learning_rate))``."""
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                      nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    )


def sgd(learning_rate, momentum=None, nesterov: bool = False, accumulator_dtype=None
        ) -> GradientTransformation:
    """optax/_src/alias.py:2049-2136 ``sgd``: ``chain(trace(momentum, nesterov) if momentum is
    not None else identity(), scale_by_learning_rate(learning_rate))``: the momentum trace is
    taken BEFORE the learning-rate scaling."""
    opt = (trace(decay=momentum, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
           if momentum is not None else identity())
    return chain(opt, scale_by_learning_rate(learning_rate))


def run_transform(tx: GradientTransformation, params, grads_per_step):
    """Drive ``tx`` like an optax training loop: ``state = tx.init(params)``, then per step
    ``updates, state = tx.update(grads, state, params)``;
    ``params = apply_updates(params, updates)``. Returns the params after each step (a list of
    trees) and the final state."""
    params = _tree_map(lambda p: None if p is None else np.array(p, copy=True), params)
    state = tx.init(params)
    out = []
    for grads in grads_per_step:
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
        out.append(params)
    return out, state
