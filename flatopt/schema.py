"""An optimizer's schema: everything flatopt needs to know about it besides its kernels.

One :class:`Schema` per optimizer declares its hyperparameters (defaults, checks, example
values for tests), the per-parameter columns that persist (such as Adam's ``step``), its state
slots (flat buffers parallel to the parameters) and when each is needed, and the update rule
that steps it. The base class, state dicts, checkpoints, the CLI, the tests and the benchmark
all read the schema; nothing else describes an optimizer's state.

:meth:`Schema.check_group` is the one validation of a parameter group, used at construction,
at every step, by ``load_state_dict`` and by checkpoint ``load`` and ``save``; and
:meth:`Schema.state_problems` the one validation of a parameter's saved state.
"""

from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from ._storage import KEYS as STORAGE_KEYS
from .kernels.checks import count_negative_or_nonfinite, first_nonzero_segment
from .kernels.rule import Rule

MAX_STEP = 1 << 53
"""Largest step count accepted: float64 represents every count up to it exactly (so bias
corrections such as ``beta ** t`` are exact in ``t``), and an int64 count cannot overflow."""

MAX_COUNT = (1 << 63) - 1
"""Largest count the training tools accept in a state dict (an EMA's updates, a GradScaler's
and a Lookahead's counters): what the int64 arrays of a checkpoint hold, so that what loads
also saves."""

GROUP_EXTRAS = ("params", "label", "initial_lr")
"""Keys a group may hold besides hyperparameters: its parameters, a free-form label, and the
``initial_lr`` that learning-rate schedulers record (as in torch)."""


class Invalid(Exception):
    """Raised by a checker with the reason a value is refused."""


# ----------------------------------------------------------------------------- checkers
def python_number(value: Any) -> Any:
    """A NumPy scalar as the Python number it holds (bool, int or float), for JSON; any other
    value as it is."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def real(value: Any) -> float:
    """A real number, not NaN (infinities pass: callers bound them)."""
    if type(value) is float:  # the common case, without the ABC check (every scheduled step)
        if value != value:
            raise Invalid("must not be NaN")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise Invalid(f"must be a real number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise Invalid(f"is too large for a float64: {value!r}") from None
    if math.isnan(number):
        raise Invalid("must not be NaN")
    return number


def non_negative(value: Any) -> float:
    """A finite number >= 0."""
    number = real(value)
    if number < 0 or math.isinf(number):
        raise Invalid(f"must be a finite number >= 0, got {value!r}")
    return number


def unit_fraction(value: Any) -> float:
    """A number in [0, 1]."""
    number = real(value)
    if not 0.0 <= number <= 1.0:
        raise Invalid(f"must be in [0, 1], got {value!r}")
    return number


def flag(value: Any) -> bool:
    """True or False (not 0 or 1: a typo such as ``amsgrad=0.9`` should not pass)."""
    if not isinstance(value, (bool, np.bool_)):
        raise Invalid(f"must be True or False, got {value!r}")
    return bool(value)


def step_count(value: Any) -> int:
    """A step count: a whole number in [0, 2**53] (a group's count, group state)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or not 0 <= value <= MAX_STEP:
        raise Invalid(f"must be a whole number in [0, {MAX_STEP}], got {value!r}")
    return int(value)


def betas(value: Any) -> tuple[float, float]:
    """A pair (beta1, beta2), each in [0, 1)."""
    return beta_tuple(value, 2)


def beta_tuple(value: Any, count: int) -> tuple[float, ...]:
    """``count`` betas (beta1, beta2, ...), each in [0, 1)."""
    names = ", ".join(f"beta{position + 1}" for position in range(count))
    if not isinstance(value, (tuple, list, np.ndarray)) or len(value) != count:
        raise Invalid(f"must be a {'pair' if count == 2 else 'triple'} ({names}), "
                      f"got {value!r}")
    numbers_ = []
    for position, beta in enumerate(value):
        try:
            number = real(beta)
        except Invalid as exc:
            raise Invalid(f"beta{position + 1} {exc}") from None
        if not 0.0 <= number < 1.0:
            raise Invalid(f"beta{position + 1} must be in [0, 1), got {beta!r}")
        numbers_.append(number)
    return tuple(numbers_)


def text(value: Any, what: str) -> str:
    """A string a checkpoint can store: no NUL character, encodable as UTF-8."""
    if not isinstance(value, str):
        raise Invalid(f"{what} must be a string, got {type(value).__name__} {value!r}")
    if "\x00" in value:
        raise Invalid(f"{what} {value!r} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Invalid(f"{what} {value!r} is not valid Unicode (a lone surrogate?)") from None
    return value


def near(word: Any, choices) -> str:
    """' (did you mean 'x'?)' for the closest choice, or ''."""
    found = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {found[0]!r}?)" if found else ""


def describe_group(number: int | None, group: Mapping[str, Any] | None = None) -> str:
    if number is None:
        return "constructor arguments"
    name = group.get("label") if isinstance(group, Mapping) else None
    return f"param group {number}" + (f" ({name!r})" if isinstance(name, str) and name else "")


# ----------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Hyperparameter:
    """One hyperparameter: its default, the check that normalises it, and values that random
    test configurations draw from (the defaults' neighbourhood where a user would go).

    ``since``: the schema version that added it. Files of an older schema version lack it, and
    their groups mean its default (which must keep the older behaviour)."""

    default: Any
    check: Callable[[Any], Any]
    examples: tuple = ()
    since: int = 1
    state: bool = False
    """Group state, not a setting: a value the optimizer itself updates as it steps
    (schedule-free's per-group step count ``k``, ``weight_sum``, ``train_mode``; Prodigy's
    ``d``; AdEMAMix's group ``step``), kept in the group dict as torch keeps it and saved with
    the hyperparameters. State dicts and checkpoints restore it with the parameters' state
    whatever their ``hyperparameters=`` option says (``"live"`` too), and never report it as a
    difference."""

    @property
    def is_flag(self) -> bool:
        return self.check is flag


@dataclass(frozen=True)
class Column:
    """A per-parameter value that persists (saved in state dicts and checkpoints): an integer
    (``dtype`` "int64", "uint8") or a float ("float64", finite) in ``[low, high]``.

    ``marker=True`` marks the column that is non-zero exactly when the parameter has state
    (then at least 1 in a state-dict entry); ``in_state_dict=False`` leaves it out of
    state-dict entries, where an entry's presence says the same (SGD's
    ``momentum_initialized``).
    """

    dtype: str
    high: float
    marker: bool = False
    in_state_dict: bool = True
    low: float = 0

    @property
    def is_float(self) -> bool:
        return np.dtype(self.dtype).kind == "f"

    def problem(self, value: Any, in_entry: bool = False) -> str | None:
        """Why ``value`` cannot be this column's value, or None."""
        low = 1 if self.marker and in_entry else self.low
        kind = "a finite number" if self.is_float else "an integer"
        if isinstance(value, (bool, np.bool_)) or not isinstance(
                value, (numbers.Real if self.is_float else (int, np.integer))) \
                or not low <= value <= self.high:
            return f"must be {kind} in [{low}, {self.high}], got {value!r}"
        return None

    def values_problem(self, values: Any, count: int) -> str | None:
        """Why ``values`` cannot be this column for ``count`` parameters, or None."""
        kinds = "f" if self.is_float else "iu"
        if (not isinstance(values, np.ndarray) or values.shape != (count,)
                or values.dtype.kind not in kinds
                or (values.size and not (values.min() >= self.low
                                         and values.max() <= self.high))):
            kind = "finite numbers" if self.is_float else "integers"
            return f"must hold {count} {kind} in [{self.low}, {self.high}]"
        return None


@dataclass(frozen=True)
class Slot:
    """A state buffer parallel to the parameters. ``when(settings)`` says whether a group's
    settings use it (allocated at the first step that needs it, required in saved state);
    ``nonnegative`` slots (second moments) must hold finite values >= 0. ``initial(settings)``
    is the value fresh state starts from (only for schemas whose state is ``eager``; lazy
    state starts from zero).

    ``shape(param_shape)`` makes it a *shaped* slot: each parameter's entry has that shape
    (Adafactor's row factor ``(..., R, 1)`` of an ``(..., R, C)`` matrix), or none at all when
    it returns None; the slot's flat buffer then has its own aligned packing of those entries
    (:class:`flatopt._layout.SlotLayout`), in the parameters' order."""

    when: Callable[[Mapping[str, Any]], bool] | None = None
    nonnegative: bool = False
    initial: Callable[[Mapping[str, Any]], float] | None = None
    shape: Callable[[tuple], tuple | None] | None = None

    def used(self, settings: Mapping[str, Any]) -> bool:
        return self.when is None or bool(self.when(settings))

    def entry_shape(self, param_shape: tuple) -> tuple | None:
        """The shape of one parameter's entry (None: the parameter has none)."""
        return tuple(param_shape) if self.shape is None else self.shape(tuple(param_shape))


# ----------------------------------------------------------------------------- the vocabulary
# what many rules declare alike (the built-in rules and flatopt.define_optimizer's)
def switch(default: bool = False, *, since: int = 1) -> Hyperparameter:
    """A boolean hyperparameter (``maximize``, ``amsgrad``, ...), both values among the test
    configurations' examples."""
    return Hyperparameter(bool(default), flag, (bool(default), not default), since=since)


STEP_COUNT = Column("int64", MAX_STEP, marker=True)
"""A parameter's own step count (torch's ``state["step"]``), the marker of which parameters
have state."""

ADAM_MOMENTS = {"exp_avg": Slot(), "exp_avg_sq": Slot(nonnegative=True)}
"""Adam's two moment estimates, as torch names them (the second one >= 0)."""


def state_record(name: str, columns: Mapping[str, Column], slots: Mapping[str, Slot]) -> type:
    """``{name}ParamState``, the record ``opt.state_of(path)`` returns: the columns saved in
    state dicts (a step count...), then the state slots (views into the flat state buffers;
    None where the group's settings or the parameter's shape leave a slot out, the default
    of the trailing ones)."""
    optional = {s for s, slot in slots.items() if slot.when is not None or slot.shape is not None}
    fields = [(c, float if column.is_float else int) for c, column in columns.items()
              if column.in_state_dict]
    fields += [(s, np.ndarray | None if s in optional else np.ndarray) for s in slots]
    record = NamedTuple(f"{identifier_of(name)}ParamState", fields)
    trailing = 0
    for field_name, _ in reversed(fields):
        if field_name not in optional:
            break
        trailing += 1
    record.__new__.__defaults__ = (None,) * trailing or None
    record._field_defaults = {n: None for n, _ in fields[len(fields) - trailing:]}
    record.__doc__ = (f"One parameter's {name} state (``opt.state_of(path)``): "
                      f"{', '.join(n for n, _ in fields)}; arrays are views into the flat "
                      "state buffers.")
    record.__module__ = "flatopt"  # (exported there by the built-in rules' modules)
    return record


def identifier_of(name: str) -> str:
    """``name`` as a Python identifier (a user rule's name may hold other characters)."""
    cleaned = "".join(c if c.isalnum() else "_" for c in name)
    return cleaned if cleaned[:1].isalpha() else f"rule_{cleaned}"


def _no_cross_check(values: Mapping[str, Any]) -> list[str]:
    return []


@dataclass(frozen=True)
class Schema:
    """Everything about one optimizer but its kernel arithmetic (see the module docstring)."""

    name: str
    """The registry name, stored in checkpoints and state dicts."""
    rule: Rule
    hyperparameters: dict[str, Hyperparameter]
    columns: dict[str, Column]
    slots: dict[str, Slot]
    record: type | None = None
    """The typed record ``state_of(path)`` returns: in-state-dict columns and slots
    (:func:`state_record`'s, made from them when not given)."""
    cross_check: Callable[[Mapping[str, Any]], list[str]] = _no_cross_check
    """Problems with a complete set of values that no single check sees (messages)."""
    version: int = 1
    """The schema's version: a checkpoint written with a newer one is refused as newer."""
    torch_name: str | None = None
    """The torch.optim class with the same semantics, for conformance tests and benchmarks."""
    benchmark: dict[str, Any] = field(default_factory=dict)
    """Hyperparameters the benchmark sets besides the defaults, so that the rule does its
    usual work (SGD: momentum)."""
    param_problem: Callable[[tuple], str | None] | None = None
    """Why a parameter of this shape cannot be optimized (Muon: not 2-D), or None."""
    eager: bool = False
    """State exists for every parameter from construction (torch's Adagrad): slots start
    from their ``initial`` value, and every parameter has a state-dict entry."""
    int8_state: bool = False
    reduced_precision: bool = True
    """Its buffers may be stored in reduced precision; False for rules with tools that run on
    the stored arrays themselves (schedule-free's ``train()``/``eval()`` switch)."""
    """Its slots are moment estimates that bitsandbytes' 8-bit blockwise format holds
    (``state_dtype="int8"``: signed codes, unsigned for ``nonnegative`` slots)."""
    marker: str | None = field(init=False)
    """The column that says whether a parameter has state (None when ``eager``)."""

    def __post_init__(self) -> None:
        if self.record is None:
            object.__setattr__(self, "record", state_record(self.name, self.columns,
                                                            self.slots))
        markers = [name for name, column in self.columns.items() if column.marker]
        if len(markers) != (0 if self.eager else 1):
            raise TypeError(f"schema {self.name!r}: {'no' if self.eager else 'exactly one'} "
                            f"column must be the state marker, found {markers}")
        lazy_initial = [name for name, slot in self.slots.items()
                        if slot.initial is not None and not self.eager]
        if lazy_initial:
            raise TypeError(f"schema {self.name!r}: slots {lazy_initial} have initial values, "
                            "which only eager state uses")
        if self.shaped_slots and self.rule.per_parameter is None:
            raise TypeError(f"schema {self.name!r}: shaped slots {sorted(self.shaped_slots)} "
                            "need a rule over whole parameters (Rule.per_parameter); the "
                            "element-wise walk assumes slots parallel to the parameters")
        newer = [name for name, h in self.hyperparameters.items() if h.since > self.version]
        if newer:
            raise TypeError(f"schema {self.name!r} (version {self.version}): hyperparameters "
                            f"{newer} are of a later version")
        object.__setattr__(self, "marker", markers[0] if markers else None)

    def stateful(self, columns: Mapping[str, Any]) -> Any:
        """Whether parameters have state, from their persisted ``columns`` (arrays: a boolean
        array; scalars: a bool)."""
        if self.marker is None:
            values = next(iter(columns.values()), None)
            return np.ones(len(values), bool) if isinstance(values, np.ndarray) else True
        values = columns[self.marker]
        return values != 0 if isinstance(values, np.ndarray) else bool(values)

    def initial_value(self, slot: str, settings: Mapping[str, Any]) -> float:
        initial = self.slots[slot].initial
        return 0.0 if initial is None else float(initial(settings))

    # ------------------------------------------------------------------ groups
    def defaults(self, **overrides: Any) -> dict[str, Any]:
        return {**{key: h.default for key, h in self.hyperparameters.items()}, **overrides}

    def upgraded(self, values: Mapping[str, Any], version: int) -> dict[str, Any]:
        """A saved group of schema ``version`` in this version's terms: the hyperparameters
        added since, which it cannot hold, at their defaults."""
        added = {key: h.default for key, h in self.hyperparameters.items()
                 if h.since > version and key not in values}
        return {**values, **added}

    def check_group(self, values: Mapping[str, Any], where: str, *,
                    extras: tuple[str, ...] = GROUP_EXTRAS, complete: bool = True,
                    base: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
        """Normalise one group's values; return (normalised, problems).

        Every key must be a hyperparameter or one of ``extras``; with ``complete`` every
        hyperparameter must be present. ``label`` and ``initial_lr`` are checked too, and the
        schema's cross-check runs when every value passed its own check.

        ``base``: a complete group this method normalised before; ``values`` then holds only
        the keys that changed since (a scheduler's ``lr``), and only those are checked again
        (the cross-check runs on the whole result, as always).
        """
        problems: list[str] = []
        normalised: dict[str, Any] = {} if base is None else dict(base)
        for key in values:
            if key in STORAGE_KEYS and key not in self.hyperparameters:
                problems.append(f"{where}: {key!r} is a storage setting, fixed when the group "
                                "was built (opt.storage); build a new optimizer to change it")
            elif key not in self.hyperparameters and key not in extras:
                known = [*self.hyperparameters, *extras]
                problems.append(f"{where}: unknown hyperparameter {key!r}{near(key, known)}; "
                                f"known: {', '.join(self.hyperparameters)}")
        # in the hyperparameters' order (a base dict keeps its own)
        for key, hyper in self.hyperparameters.items():
            if key not in values:
                continue
            try:
                normalised[key] = hyper.check(values[key])
            except Invalid as exc:
                problems.append(f"{where}: {key}={values[key]!r} is invalid: {exc}")
        missing = [] if base is not None else \
            [key for key in self.hyperparameters if key not in values]
        if complete and missing:
            problems.append(f"{where}: hyperparameters {missing} are missing")
        if "label" in values:
            normalised.pop("label", None)
        if "label" in values and values["label"] is not None:
            try:
                normalised["label"] = text(values["label"], "label")
            except Invalid as exc:
                problems.append(f"{where}: {exc}")
        if "initial_lr" in values:
            try:
                normalised["initial_lr"] = non_negative(values["initial_lr"])
            except Invalid as exc:
                problems.append(f"{where}: initial_lr={values['initial_lr']!r} is invalid: {exc}")
        if not problems and not missing:
            problems += [f"{where}: {message}" for message in self.cross_check(normalised)]
        return normalised, problems

    @property
    def group_state(self) -> tuple[str, ...]:
        """The hyperparameters that are per-group state (``Hyperparameter.state``)."""
        return tuple(name for name, hyper in self.hyperparameters.items() if hyper.state)

    def settings_of(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Only the hyperparameters of a normalised group (no label, no initial_lr)."""
        return {key: values[key] for key in self.hyperparameters}

    # ------------------------------------------------------------------ state
    @property
    def shaped_slots(self) -> dict[str, Callable[[tuple], tuple | None]]:
        """Slot name -> entry shape function, for the slots not parallel to the parameters."""
        return {name: slot.shape for name, slot in self.slots.items() if slot.shape is not None}

    def used_slots(self, settings: Mapping[str, Any]) -> tuple[str, ...]:
        return tuple(name for name, slot in self.slots.items() if slot.used(settings))

    def parallel_slots(self, settings: Mapping[str, Any]) -> tuple[str, ...]:
        """The used slots that are parameter-sized (not shaped): an element apiece."""
        return tuple(name for name in self.used_slots(settings)
                     if self.slots[name].shape is None)

    def bytes_per_element(self, settings: Mapping[str, Any], itemsize: int) -> int:
        """Bytes one step moves per element: params read and written, grads read, each used
        parameter-sized slot read and written (Adam float32: 28; SGD with momentum: 20;
        Adafactor 12, its factors being a vanishing share)."""
        return itemsize * (3 + 2 * len(self.parallel_slots(settings)))

    @property
    def state_dict_columns(self) -> tuple[str, ...]:
        return tuple(name for name, column in self.columns.items() if column.in_state_dict)

    def state_problems(self, path: str, entry: Any, shape: tuple, dtype: np.dtype,
                       settings: Mapping[str, Any]) -> list[str]:
        """Problems with one parameter's saved state ``{column: int, slot: array}`` (an entry
        means the parameter has state): names, required slots, shapes, dtypes, ranges, and
        second moments finite and >= 0."""
        if not isinstance(entry, Mapping):
            return [f"state for {path!r} must be a dict, got {type(entry).__name__}"]
        allowed = (*self.state_dict_columns, *self.slots)
        problems = [f"state for {path!r} has unexpected entry {key!r}{near(key, allowed)} "
                    f"(a {self.name} expects {sorted(allowed)})"
                    for key in entry if key not in allowed]
        for name in self.state_dict_columns:
            problem = self.columns[name].problem(entry.get(name), in_entry=True)
            if problem:
                problems.append(f"state for {path!r}: {name} {problem}")
        for name, slot in self.slots.items():
            value = entry.get(name)
            entry_shape = slot.entry_shape(shape)
            if entry_shape is None:  # a shaped slot without an entry for this parameter
                if value is not None:
                    problems.append(f"state for {path!r} has {name!r}, which a {self.name} "
                                    f"keeps for no parameter of shape {tuple(shape)}")
                continue
            if value is None:
                if slot.used(settings):
                    problems.append(f"state for {path!r} lacks {name!r}")
                continue
            problem = array_problem(value, entry_shape, dtype, nonnegative=slot.nonnegative)
            if problem:
                problems.append(f"state for {path!r}: {name} {problem}")
        return problems


def column_problems(schema: Schema, columns: Mapping[str, Any], count: int,
                    where: str) -> list[str]:
    """Persisted per-parameter columns of ``count`` parameters: every schema column present,
    values of its kind within its range."""
    problems = []
    for name, column in schema.columns.items():
        problem = column.values_problem(columns.get(name), count)
        if problem:
            problems.append(f"{where}: column {name} {problem}")
    return problems


def slot_value_problems(schema: Schema, name: str, flat: np.ndarray, layout,
                        stateful: np.ndarray, paths, bad: int | None = None) -> list[str]:
    """Values no optimizer holds in state slot ``name`` of a flat buffer whose entries lie at
    ``layout.offsets`` / ``layout.sizes`` (a FlatBuffer, or a shaped slot's SlotLayout): a
    second moment negative, NaN or infinite, or a non-zero value for a parameter without
    state (``stateful`` false: its marker column is 0). The one check of saved state values,
    made by save, load, ``flatopt verify`` and ``restore``. ``bad``: the count of negative
    or non-finite values when the caller has made it (a load counts each block as it lands,
    on its reading threads)."""
    problems = []
    if schema.slots[name].nonnegative:
        if bad is None:
            bad = count_negative_or_nonfinite(flat)
        if bad:
            problems.append(f"{name} holds {bad} negative, NaN or infinite value(s); a second "
                            "moment is finite and >= 0 (a NaN or infinite gradient reached the "
                            "optimizer, or the state was damaged)")
    slot = first_nonzero_segment(flat, layout.offsets, layout.sizes,
                                 ~np.asarray(stateful, bool))
    if slot >= 0:
        problems.append(f"{paths[slot]!r} has no state ({schema.marker} is 0) but non-zero "
                        f"{name}")
    return problems


def array_problem(value: Any, shape: tuple, dtype: np.dtype, *,
                  nonnegative: bool = False) -> str | None:
    """Why ``value`` cannot be a state array of this shape and dtype, or None."""
    if not isinstance(value, np.ndarray) or isinstance(value, np.ma.MaskedArray):
        return f"is a {type(value).__name__}, not a numpy array"
    if value.shape != tuple(shape) or value.dtype != dtype:
        return (f"has shape {value.shape} and dtype {value.dtype}, the parameter has shape "
                f"{tuple(shape)} and dtype {np.dtype(dtype)}")
    if nonnegative and value.size and count_negative_or_nonfinite(value.reshape(-1)):
        return ("holds negative, NaN or infinite values; a second moment is finite and >= 0 "
                "(was the state damaged or written by hand?)")
    return None


def same_kind(a: Schema, b: Schema) -> bool:
    """Whether state of schema ``a`` loads into an optimizer of schema ``b``: the same
    schema, or one made again with the same name, kernels (rule fingerprint), version and
    names of hyperparameters, columns and slots (two chains of the same transforms with
    other defaults: ``flatopt.chain``)."""
    return a is b or (a.name == b.name and a.version == b.version
                      and a.rule.key == b.rule.key
                      and list(a.hyperparameters) == list(b.hyperparameters)
                      and list(a.columns) == list(b.columns) and list(a.slots) == list(b.slots))
