"""Learning-rate schedulers for flatopt optimizers, with torch.optim.lr_scheduler's semantics.

What is here (torch 2.13's names, signatures, defaults and lr sequences):

=============================== ==========================================================
``LRScheduler``                  base class: ``step()``, ``get_last_lr()``, ``state_dict()``,
                                 ``load_state_dict()``, ``owned_hyperparameters``
``StepLR``                       ``lr *= gamma`` every ``step_size`` steps
``MultiStepLR``                  ``lr *= gamma`` at each milestone
``ExponentialLR``                ``lr *= gamma`` every step
``CosineAnnealingLR``            cosine from the initial lr to ``eta_min`` over ``T_max``
``CosineAnnealingWarmRestarts``  cosine with restarts every ``T_0 * T_mult**k`` steps
``LinearLR``                     linear factor ``start_factor -> end_factor`` over ``total_iters``
``ConstantLR``                   ``factor * lr`` for ``total_iters`` steps
``PolynomialLR``                 ``(1 - t/total_iters) ** power`` decay
``OneCycleLR``                   1cycle (cos/linear, two or three phases), cycles ``momentum``
                                 (SGD-like groups) or ``betas[0]`` (Adam-like groups)
``SequentialLR``                 children one after another, switching at milestones
``ChainedScheduler``             every child at every step, each on the previous one's lrs
``CyclicLR``                     lr cycling between ``base_lr`` and ``max_lr`` (triangular,
                                 triangular2, exp_range or ``scale_fn``), momentum inversely
``ReduceLROnPlateau``            ``step(metrics)``: ``lr *= factor`` after ``patience`` bad steps
``LambdaLR``                     ``initial_lr * lr_lambda(t)`` (functions are not saved: a
                                 callable object's attributes are, as in torch)
``MultiplicativeLR``             ``lr *= lr_lambda(t)`` after the first step
=============================== ==========================================================

Every scheduler computes its values with the same Python expressions, in the same order, as
torch's (chainable/recursive forms where torch uses them, closed forms where torch does, for
example when ``SequentialLR`` switches to the next child), so with float learning rates the
sequences are bit-identical to torch's, but for one thing: an lr that rounds below zero (torch's
chained ``LinearLR`` ending at 0 gives -1.48e-18 times the initial lr) is written as 0.0, since
the optimizer refuses a negative lr and torch's does not. As in torch: building a scheduler sets
``group.setdefault("initial_lr", group["lr"])`` (``OneCycleLR`` sets ``initial_lr`` to
``max_lr / div_factor``), a non-default ``last_epoch`` without ``initial_lr`` in the groups is
a ``KeyError``, and the constructor makes the initial step (``last_epoch`` -1 -> 0), which
writes ``group["lr"]`` (``LinearLR``, ``ConstantLR``, ``OneCycleLR`` change it).

Resuming. Build the optimizer, build the scheduler(s), then load both::

    opt = flatopt.AdamW(groups, lr=1e-3)
    sched = flatopt.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10_000)
    flatopt.load("run/ckpt.h5", opt, scheduler=sched)   # or: opt.load_state_dict(o);
                                                        #     sched.load_state_dict(s)

Building the scheduler after loading would overwrite the loaded learning rates (the
constructor's initial step), exactly as in torch. ``load_state_dict`` never writes the groups:
their values come from the optimizer's state (the checkpoint); ``owned_hyperparameters``
names the group keys a scheduler writes, so a checkpoint load can take those from the file.

How this differs from torch (deliberately):

- **State dicts are data.** ``state_dict()`` is JSON text's types only (dicts with string
  keys, lists, floats, ints, bools, strings, None) plus a ``"scheduler"`` tag naming the class;
  ``load_state_dict(json.loads(json.dumps(sd)))`` restores exactly (``ReduceLROnPlateau``'s
  infinite ``best`` needs ``allow_nan=True``, which flatopt checkpoints use). Keys are torch's
  attribute names, except: transient flags (``_is_initial``,
  ``_get_lr_called_within_step``) are left out; ``MultiStepLR.milestones`` is a sorted list
  with repeats (torch: a ``Counter``); ``OneCycleLR`` keeps its configuration (``total_steps``,
  ``pct_start``, ``three_phase``, ...) instead of ``_schedule_phases``;
  ``ReduceLROnPlateau`` leaves out ``mode_worse`` (derived from ``mode``). ``load_state_dict``
  checks the whole dict (class, keys, types, ranges, group count) before changing anything,
  and raises :class:`~flatopt.errors.StateDictError`; torch does ``__dict__.update``. As in
  torch, the saved configuration (``gamma``, ``T_max``, ...) replaces the constructor's.
- **Scheduler values stay out of the groups.** flatopt refuses unknown keys in a param group,
  so ``OneCycleLR`` keeps ``max_lr``, ``min_lr``, ``max_momentum`` and ``base_momentum`` per
  group in its own state (``max_lrs``, ``min_lrs``, ``max_momentums``, ``base_momentums``;
  torch writes them into the groups) and reads its initial lr from ``base_lrs``. With
  ``last_epoch >= 0`` they come from the constructor's arguments (torch reads them from the
  groups a loaded optimizer state put there). Only ``lr``, ``momentum``/``betas`` and
  ``initial_lr`` are ever written into a group.
- **No call-order warning.** torch wraps ``optimizer.step`` to warn when ``scheduler.step()``
  comes first; flatopt never wraps or patches the optimizer, so there is no such warning.
  Call ``opt.step()`` before ``sched.step()``.
- **Stricter arguments**, checked before anything is changed: ``step_size``, ``T_max``,
  ``total_iters`` (``LinearLR``/``PolynomialLR``: >= 1, torch divides by them) are integers;
  ``gamma``, ``eta_min``, ``power``, ``div_factor``... are finite and non-negative (a negative
  lr would be refused by the optimizer anyway); ``ConstantLR`` refuses ``factor=0`` (torch
  raises ``ZeroDivisionError`` at ``total_iters``); ``OneCycleLR`` refuses a schedule with a
  zero-length phase that a step falls in (torch: ``ZeroDivisionError``) and momentum values the
  optimizer would refuse; ``SequentialLR`` milestones are strictly increasing integers >= 1,
  and a ``SequentialLR`` inside a ``SequentialLR`` is refused (torch fails when switching to
  one). Where torch checks an argument, the exception type and message are torch's.
- **Group count.** A scheduler built for N groups refuses to step an optimizer that now has
  another number (``add_param_group`` after building it): build the scheduler after the last
  group is added. ``ReduceLROnPlateau`` follows torch (a scalar ``min_lr`` covers new groups;
  with a list, ``step()`` raises torch's ``RuntimeError`` at once, torch at the first
  reduction, after it has already counted the step).
- **A failed step changes nothing** (``OneCycleLR`` stepped past ``total_steps``: torch has
  already advanced ``last_epoch`` when it raises). ``get_last_lr()`` returns a copy.
- ``step(epoch)`` (deprecated in torch) works as in torch: a ``UserWarning`` and the closed
  form where there is one; ``epoch`` must be an integer >= 0 (``CosineAnnealingWarmRestarts``:
  a real number >= 0, as in torch).
- ``CyclicLR``, like ``OneCycleLR``, keeps ``max_momentum``/``base_momentum`` in its state.

A subclass of :class:`LRScheduler` implements ``get_lr()`` (and optionally
``_get_closed_form_lr()``), and lists its own state attributes in ``extra_state``; their
values must be JSON data (override ``_checked_extra`` to validate them on load).
"""

from __future__ import annotations

from ._checks import EPOCH_DEPRECATION_WARNING
from .base import LRScheduler
from .cyclic import CyclicLR
from .lambdas import LambdaLR, MultiplicativeLR
from .onecycle import OneCycleLR
from .plateau import ReduceLROnPlateau
from .schedules import (ConstantLR, CosineAnnealingLR, CosineAnnealingWarmRestarts,
                        ExponentialLR, LinearLR, MultiStepLR, PolynomialLR, StepLR)
from .sequential import ChainedScheduler, SequentialLR

__all__ = [
    "LRScheduler", "StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts", "LinearLR", "ConstantLR", "PolynomialLR", "OneCycleLR",
    "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau", "LambdaLR", "MultiplicativeLR",
    "CyclicLR",
    "EPOCH_DEPRECATION_WARNING",
]
