"""What a backend needs to know about one update rule, declared once in the rule's module.

An update rule is a few plain Python functions (``kernels/rules/<name>.py``):

- ``span(arrays, scalars, columns, flags, k, start, stop, stride)``: updates elements
  ``start, start + stride, ... < stop`` of parameter ``k``. ``arrays`` is
  ``(params, grads, *slots)`` in the order of ``Rule.slots``. A span only indexes them
  (``a[i]``, ``a[i] = x``: no ``.size``, slicing or array expressions), reads an element
  before it writes it, writes it at most once, and writes every element of ``params`` and
  of each slot it uses: for reduced-precision buffers the CPU hands it views whose writes
  round (``kernels/coded_views.py``), so a value read back after a write, or written twice,
  would differ from the float32 walk's; ``scalars`` is a 1-D array in the
  buffer's dtype laid out as ``Rule.scalars``; ``columns`` holds the per-parameter arrays of
  ``Rule.columns``; ``flags`` is a tuple of booleans laid out as ``Rule.flags``.
- ``prepare(present, columns, scalars, flags, start, stop, stride)``: the per-parameter
  bookkeeping (step counts, bias corrections, first-step flags) of parameters ``start,
  start + stride, ... < stop`` that have a gradient this step (``present[k] != 0``), run before
  ``span``: the CPU hands it every parameter in one call, CUDA one parameter per thread.
  ``scalars`` are float64, laid out as ``Rule.prepare_scalars``.
- helpers they call (the element-wise rule body itself, shared by every backend).

Rules whose update needs per-parameter totals (LAMB's trust ratio ||p|| / ||update||) add:

- ``reduce(arrays, scalars, columns, flags, k, start, stop, stride)``: run over every segment
  of a present parameter before ``span``; returns a tuple of ``len(Rule.reductions)`` float64
  partial sums, which the backend adds up per parameter. It stores nothing (``span`` updates
  the state): the CPU compiles it with reassociation allowed, so that its sums vectorize;
  their order inside a segment is then the compiler's, fixed for a given build and machine,
  and the totals still do not depend on the thread count;
- ``finalize(present, columns, scalars, flags, start, stop, stride, sums)``: like prepare, with
  ``sums[k, j]`` the totals of parameter ``k``; it stores what ``span`` needs in columns.

``Rule.reduce_flag`` names the flag that turns these two passes on (cautious updates, a mask's
mean per parameter, are an option of Adam's rule: with the flag off its step is one pass,
exactly as without the option); None runs them at every step.

Helpers may come from a shared module of rule helpers (``kernels/rules/caution.py``): each
function is compiled over its own module's names, with the rule's functions bound in.
Rules whose update needs totals over *every* parameter of every group (Prodigy's d estimate)
set ``global_reductions``: the per-parameter totals of ``reduce`` are added up per group (in
slot order, buffer by buffer) and handed to the optimizer's ``combine``, which turns them into
the scalars of the step pass (and new group state); such a rule has no ``finalize``, and its
scalars come from ``combine`` at every step, for the reduce pass too.

Rules that work on whole matrices (Muon's Newton-Schulz iteration, Adafactor's factored
moments) give ``per_parameter``, a function ``(param, grad, state, settings, columns)`` called
for each present parameter after ``prepare``, with views shaped like the parameter (a shaped
slot's entry has its own shape), the group's settings and the parameter's column values by
name; their ``span`` does nothing.

Backends (``kernels.cpu``, ``kernels.cuda``) compile those functions for their target and plug
``span`` and ``prepare`` into their one chunk walk. The layouts are NamedTuple classes: the
optimizer builds values by name, the kernel reads them by name through
:func:`kernels.layouts.positions`, and no code anywhere unpacks them by position.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from . import elementwise

_MADE: dict[str, "Rule"] = {}
"""Rules made at run time with an ``origin``, by key (the latest made under each)."""


class NoScalars(NamedTuple):
    """The layout of a rule that needs no scalars (an empty array)."""


@dataclass(frozen=True)
class Rule:
    """One update rule's kernel interface: its functions and the layouts of its arguments."""

    name: str
    span: Callable
    prepare: Callable
    helpers: tuple[Callable, ...]
    """Functions ``span`` and ``prepare`` call by their global names; compiled alongside."""
    slots: tuple[str, ...]
    """State arrays after params and grads in ``arrays``, in this order."""
    columns: dict[str, str]
    """Per-parameter arrays in ``columns`` order -> dtype: a NumPy dtype name, or "param" for
    the buffer's own dtype."""
    scalars: type = NoScalars
    prepare_scalars: type = NoScalars
    flags: type = NoScalars
    reduce: Callable | None = None
    finalize: Callable | None = None
    reductions: tuple[str, ...] = ()
    """Names of the per-parameter totals ``reduce`` returns, in order."""
    reduce_flag: str | None = None
    """The flag that turns ``reduce`` and ``finalize`` on (None: they always run)."""
    global_reductions: bool = False
    """The totals are combined over every buffer by ``Optimizer.combine`` (no finalize)."""
    variants: tuple[str, ...] = ()
    """Flags that choose which loop the span runs (a state array read or not: AMSGrad's
    ``max_exp_avg_sq``; an extra pass: caution). The span branches on each as
    ``flags[F.<name>]`` written in the condition itself; the CPU compiles one step walk per
    combination of their values a step uses, with those reads replaced by the values, so a
    kernel holds only the loop it runs (``kernels/variants.py``). Other backends read them at
    run time like any flag."""
    per_parameter: Callable | None = None
    generated: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    """The source of functions made at run time (``flatopt.custom``: a user rule's span and
    prepare), by function name; the others' is read from their files."""
    origin: str | None = None
    """For a rule made at run time, the module whose import makes it again: such a rule
    pickles as (origin, name and fingerprint), so that another process (a CUDA compile
    worker, ``bench/cuda_static.py``) gets the same rule by importing that module."""
    fingerprint: str = field(init=False)
    """A digest of the rule's source: compiled kernels are cached under it, so editing a
    rule can never load a stale kernel from Numba's on-disk cache."""
    sources: dict[str, str] = field(init=False, repr=False, compare=False)
    """The source of each function, as the fingerprint read it (a kernel compiled from
    source, ``kernels/variants.py``, is then the code its name's fingerprint stands for)."""

    def __post_init__(self) -> None:
        needs_finalize = self.reduce is not None and not self.global_reductions
        if needs_finalize != (self.finalize is not None) or \
                (self.reduce is not None) != bool(self.reductions):
            raise TypeError(f"rule {self.name!r}: reduce, finalize and reductions go together "
                            "(a rule with global_reductions has no finalize)")
        if not set(self.variants) <= set(self.flags._fields):
            raise TypeError(f"rule {self.name!r}: variants {self.variants!r} must be among its "
                            f"flags {self.flags._fields!r}")
        if self.reduce_flag is not None and (self.reduce is None
                                             or self.reduce_flag not in self.flags._fields):
            raise TypeError(f"rule {self.name!r}: reduce_flag {self.reduce_flag!r} must be "
                            "one of its flags, and the rule must have a reduce")
        digest = hashlib.sha256()
        sources = {}
        for function in (*self.functions, *filter(None, [self.per_parameter])):
            sources[function.__name__] = (self.generated.get(function.__name__)
                                          or elementwise.source(function))
            digest.update(sources[function.__name__].encode())
        object.__setattr__(self, "sources", sources)
        for layout in (self.scalars, self.prepare_scalars, self.flags):
            digest.update(repr(layout._fields).encode())
        digest.update(repr((self.slots, sorted(self.columns.items()))).encode())
        if self.global_reductions:  # (only then: other rules keep their cached kernels)
            digest.update(b"global_reductions")
        object.__setattr__(self, "fingerprint", digest.hexdigest()[:16])
        if self.origin is not None:
            _MADE[self.key] = self

    @property
    def key(self) -> str:
        """The rule's name and fingerprint: its kernels' names (and Numba cache keys)."""
        return f"{self.name}_{self.fingerprint}"

    def __reduce__(self):
        if self.origin is None:
            return super().__reduce__()
        return made_rule, (self.origin, self.key)

    @property
    def functions(self) -> tuple[Callable, ...]:
        """The functions a backend compiles."""
        return (self.span, self.prepare, *filter(None, [self.reduce, self.finalize]),
                *self.helpers)

    def reduces(self, flags: tuple) -> bool:
        """Whether a step with these flags (a tuple laid out as ``Rule.flags``) runs the
        ``reduce`` and ``finalize`` passes."""
        if self.reduce is None:
            return False
        return self.reduce_flag is None or bool(flags[self.flags._fields.index(self.reduce_flag)])

    def column_dtype(self, name: str, param_dtype: np.dtype) -> np.dtype:
        kind = self.columns[name]
        return np.dtype(param_dtype) if kind == "param" else np.dtype(kind)


def made_rule(origin: str, key: str) -> Rule:
    """The rule made at run time under ``key``, importing ``origin`` (which makes it) first
    when this process has not made it yet (how such a rule unpickles)."""
    if key not in _MADE:
        importlib.import_module(origin)
    if key not in _MADE:
        raise LookupError(f"importing {origin!r} did not make rule {key} (its source changed?)")
    return _MADE[key]
