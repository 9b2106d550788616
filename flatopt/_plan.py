"""A buffer's kernel arguments for one validated settings dict: the rule's scalars (an array
in the buffer's dtype), its prepare scalars (float64) and flags, the state slots the settings
use, and the arrays and per-parameter totals kept from the previous plan when they fit."""

from __future__ import annotations

import numpy as np

from ._layout import FlatBuffer


class Plan:
    """A buffer's kernel arguments for one validated settings dict (rebuilt when it changes)."""

    __slots__ = ("settings", "scalars", "prepare_scalars", "flags", "used", "arrays", "one",
                 "sums", "schema")

    def __init__(self, settings, scalars, prepare_scalars, flags, used, schema):
        self.settings = settings
        self.scalars = scalars
        self.one = scalars.dtype.type(1)  # the gradient multiplier of a plain step
        self.prepare_scalars = prepare_scalars
        self.flags = flags
        self.used = used
        self.schema = schema
        self.arrays = None  # (params, grads, *slots), once the used slots are allocated
        self.sums = None  # per-parameter totals of a rule with a reduce pass

    def initial(self, name: str) -> float:
        """The initial value of state slot ``name`` under these settings."""
        return self.schema.initial_value(name, self.settings)


def make_plan(opt, buf: FlatBuffer, settings: dict, previous: Plan | None) -> Plan:
    """The plan of ``buf`` for ``settings`` from ``opt``'s ``kernel_scalars``,
    ``prepare_scalars`` and ``kernel_flags`` (each checked to be the rule's layout); a
    ``previous`` plan's arrays and sums are kept when it uses the same slots."""
    schema = opt.schema
    rule = schema.rule
    # with global reductions, combine() writes the scalars at every step
    scalars = (rule.scalars(*[0.0] * len(rule.scalars._fields)) if rule.global_reductions
               else opt.kernel_scalars(settings, buf.dtype))
    prepare = opt.prepare_scalars(settings)
    flags = opt.kernel_flags(settings)
    for value, layout in ((scalars, rule.scalars), (prepare, rule.prepare_scalars),
                          (flags, rule.flags)):
        if type(value) is not layout:
            raise TypeError(f"{type(opt).__name__} gave a {type(value).__name__} where "
                            f"rule {rule.name!r} takes its {layout.__name__}")
    plan = Plan(settings, np.array(scalars, dtype=buf.dtype),
                np.array(prepare, dtype=np.float64), tuple(map(bool, flags)),
                schema.used_slots(settings), schema)
    if previous is not None and previous.used == plan.used:  # the same slots: keep them
        plan.arrays, plan.sums = previous.arrays, previous.sums
    elif rule.reductions:
        plan.sums = np.zeros((len(buf), len(rule.reductions)))
    return plan


def update_all(opt, settings: list, multiplier: float, layer) -> bool:
    """``Optimizer.update_buffers``: per buffer its plan, ``layer.arrays``,
    ``layer.prepare`` and ``layer.update`` (or, with global reductions, the passes of
    :func:`update_together` over every prepared buffer). Whether some parameter was stepped."""
    scale = multiplier != 1.0
    together = opt.schema.rule.global_reductions
    stepped = False
    staged = []
    for buf in opt.buffers:
        plan = opt.plan(buf, settings[buf.group])
        arrays = layer.arrays(buf, plan)
        if arrays is None:
            continue  # nothing to step: no state is allocated
        if layer.prepare(buf, plan):
            stepped = True
            if buf.coded:  # the stochastic rounding stream of this step (a plain
                buf.draws += 1  # buffer draws nothing, and saves no count)
            if together:
                staged.append((buf, plan, arrays))
            else:
                layer.update(buf, plan, arrays, buf.dtype.type(multiplier) if scale
                             else plan.one, scale)
    if staged:
        update_together(opt, settings, staged, layer, multiplier)
    return stepped


def update_together(opt, settings: list, staged: list, layer, multiplier: float) -> None:
    """One step of a rule with global reductions over the ``staged`` (buffer, plan,
    arrays) items (prepared buffers): ``combine`` gives the reduce pass's scalars;
    ``layer.reduce_pass`` fills each ``plan.sums``; the totals per group are the sums of
    those rows, buffer by buffer (the per-parameter totals do not depend on the thread
    count or world size, nor then does anything added from them); ``combine`` turns them
    into the step pass's scalars and new group state; then ``layer.step_pass`` for every
    buffer. Single-process, CUDA and ZeRO-1 steps all come through here with their own
    passes."""
    rule = opt.schema.rule
    scale = multiplier != 1.0
    _write_scalars(opt, staged, opt.combine(settings, None)[0])
    for buf, plan, arrays in staged:
        layer.reduce_pass(buf, plan, arrays, buf.dtype.type(multiplier) if scale
                          else plan.one, scale)
    layer.read_sums(staged)
    totals = np.zeros((len(settings), len(rule.reductions)))
    for buf, plan, _ in staged:  # rows of absent parameters are zero
        totals[buf.group] += plan.sums.sum(axis=0)
    scalars, changes = opt.combine(settings, totals)
    _write_scalars(opt, staged, scalars)
    if changes is not None:
        opt.set_group_state(changes)
    for buf, plan, arrays in staged:
        layer.step_pass(buf, plan, arrays)


def _write_scalars(opt, staged: list, scalars: list) -> None:
    layout = opt.schema.rule.scalars
    for buf, plan, _ in staged:
        value = scalars[buf.group]
        if type(value) is not layout:
            raise TypeError(f"{type(opt).__name__}.combine gave a {type(value).__name__} "
                            f"where rule {opt.schema.rule.name!r} takes its "
                            f"{layout.__name__}")
        plan.scalars[...] = value
