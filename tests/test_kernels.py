"""The CPU kernels: the chunk table, no recompilation, float32 kept in float32, and the
parallel chunk walk equal to the serial one, for every registered optimizer."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flatopt
from flatopt._layout import CHUNK_ELEMENTS, chunk_table
from flatopt.kernels import cpu, threads
from optimizers import cases
from walks import SHAPES, serial_and_chunked


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------- the chunk table
def test_chunks_split_one_huge_tensor_and_many_small_ones_evenly():
    sizes = np.array([3 * CHUNK_ELEMENTS + 5], dtype=np.int64)
    first = chunk_table(np.array([0]), sizes, int(sizes[0]))
    assert len(first) == 4 and (first == 0).all()
    offsets = np.arange(0, 100 * 1024, 1024, dtype=np.int64)
    sizes = np.full(100, 1000, dtype=np.int64)
    first = chunk_table(offsets, sizes, 100 * 1024)
    chunk_starts = np.arange(len(first)) * CHUNK_ELEMENTS
    # each chunk starts at the first parameter ending after the chunk's start
    assert (offsets[first] + sizes[first] > chunk_starts).all()
    assert (first == 0).sum() == 1 and first[1] == CHUNK_ELEMENTS // 1024


# ---------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("name", flatopt.registry.names())
def test_a_second_step_does_not_recompile(name):
    from optimizers import build, fit_params
    cls = flatopt.registry.lookup(name)
    opt = build(name, {"a": f32(5), "b": f32(40_000)})
    grads = fit_params(name, {"a": f32(5), "b": f32(40_000)})
    opt.step(grads, max_grad_norm=1.0)
    opt.step(grads)
    compiled = cpu.compile_rule(cls.schema.rule)
    kernels = [k for k in (compiled.prepare_kernel, compiled.finalize_kernel,
                           *(way for t in threads.ALL for way in (t.serial, t.parallel)))
               if k is not None and k.signatures]
    assert compiled.prepare_kernel in kernels  # (a rule over whole matrices has no step kernel)
    counts = {k: len(k.signatures) for k in kernels}
    opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * 0.5
    for _ in range(3):
        opt.step(grads, max_grad_norm=1.0)
        opt.step(grads)
    assert {k: len(k.signatures) for k in kernels} == counts


@pytest.mark.parametrize("name", cases("test_float32_kernels_stay_in_float32",
                                       slow_beyond_representatives=4))
def test_float32_kernels_stay_in_float32(name):
    from optimizers import build, fit_params
    cls = flatopt.registry.lookup(name)
    opt = build(name, {"a": f32(100)})
    opt.step(fit_params(name, {"a": f32(100)}))
    # 100 elements: the serial kernel ran (it may have come from the disk cache); the step
    # walk for these settings' flags (a rule with variants has one per variant)
    buf = opt.buffers[0]
    flags = opt.plan(buf, opt.settings()[buf.group]).flags
    walk = cpu.compile_rule(cls.schema.rule).step_kernel(flags)
    kernel = walk.uncached().serial
    for signature in walk.serial.signatures:
        kernel.compile(signature)
    ir = [text for sig, text in kernel.inspect_llvm().items() if sig[1].dtype.name == "float32"]
    assert ir and ("fmul float" in ir[0] or "fmul <" in ir[0])
    # the Python wrapper unboxes the scalar arguments through a C double, once per call; the
    # compiled kernel itself must not widen anything
    functions = ir[0].split("\ndefine ")
    kernel_code = "\n".join(line for f in functions[1:] if "7cpython" not in f.split("(")[0]
                             for line in f.splitlines() if not line.startswith("declare"))
    assert kernel_code and "fpext" not in kernel_code and "double" not in kernel_code


@pytest.mark.parametrize("name", cases("test_parallel_chunk_walk_equals_serial_walk",
                                       slow_beyond_representatives=4))
def test_parallel_chunk_walk_equals_serial_walk(name, monkeypatch):
    """The chunk walk (chunks of 64 elements spanning parameters, several per parameter)
    gives the serial walk's bits, missing gradients skipped in both."""
    from optimizers import fit_shape, random_settings
    settings = random_settings(name, np.random.default_rng(5))
    cls = flatopt.registry.lookup(name)
    serial_and_chunked(lambda params: cls(params, **settings), monkeypatch,
                       {k: fit_shape(name, s) for k, s in SHAPES.items()})


# ---------------------------------------------------------------------------- variants
def test_a_variant_walk_holds_only_the_loop_its_flags_choose():
    """Rule.variants: the CPU's span for amsgrad off and caution off is compiled from source
    in which Python dropped the other branches, so Numba never sees their loops; a flag that
    is not a variant stays a run-time value."""
    import dis
    from flatopt.kernels._bind import bind
    from flatopt.kernels.rules.adam import RULE, adam_span

    def globals_read(function):
        return [i.argval for i in dis.get_instructions(function) if i.opname == "LOAD_GLOBAL"]

    assert globals_read(adam_span).count("adam_rule") == 4  # a loop per amsgrad x caution
    for amsgrad in (False, True):
        functions = bind(RULE, lambda f: f,
                         constant_flags={"amsgrad": amsgrad, "caution": False})
        read = globals_read(functions["adam_span"])
        assert read.count("adam_rule") == 1
        assert "_Flags_positions" in read  # maximize, decoupled...: still read from the tuple
        assert functions["adam_span"].__code__.co_filename == adam_span.__code__.co_filename
        # the functions that read no variant flag are the rule's own code
        rule_body = next(h for h in RULE.helpers if h.__name__ == "adam_rule")
        assert functions["adam_rule"].__code__ is rule_body.__code__


def test_a_span_leaves_the_slots_of_a_switch_that_is_off_alone():
    """element_span's branches: with amsgrad off, max_exp_avg_sq is neither read nor stored
    (the gradient stands in for it, its result is dropped), so that loop touches one array
    fewer; caution changes no slot, only the constant the body gets."""
    from flatopt.kernels.elementwise import source
    from flatopt.kernels.rules.adam import adam_span
    loops = [line.strip() for line in source(adam_span).splitlines() if "adam_rule(" in line]
    assert len(loops) == 4
    on, off = loops[:2], loops[2:]  # amsgrad on (caution on, off), then amsgrad off
    assert all(line.startswith("_p[i], _s0[i], _s1[i], _s2[i] =") for line in on)
    assert all(line.startswith("_p[i], _s0[i], _s1[i], _ =") and "_s2" not in line
               for line in off)
    assert [", True, caution_scale)" in line for line in loops] == [True, False] * 2


def test_element_span_refuses_branches_it_cannot_honour():
    """A switch the body does not read, or a slot name that is not one of the body's slots,
    is a TypeError naming the span (not a span that touches an array it was told to leave)."""
    from flatopt.kernels.elementwise import Off, element_span
    from flatopt.kernels.rules import adam
    with pytest.raises(TypeError, match=r"bad_span: branches \['nesterov'\]"):
        element_span("bad_span", adam.adam_rule, 3, adam.Scalars, adam.Columns, adam.Flags,
                     branches={"nesterov": Off()})
    with pytest.raises(TypeError, match=r"bad_span: branches name \['vmax'\]"):
        element_span("bad_span", adam.adam_rule, 3, adam.Scalars, adam.Columns, adam.Flags,
                     branches={"amsgrad": Off(unread=("vmax",))})


_BOUND_SPANS: dict = {}


@pytest.mark.parametrize("name", ["adam", "rmsprop", "sgd", "lion", "asgd"])
@settings(max_examples=15, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_span_never_touches_what_a_switch_that_is_off_leaves_alone(name, data):
    """For generated flags and switch columns: the slots a switch that is off does not read
    do not change the results (NaN there or numbers, the same bits), and the slots it does
    not store keep their bytes: the generated loop stands the gradient in for them and drops
    their results, so a configuration's loop touches no array it does not use."""
    from numba import njit
    from flatopt.kernels._bind import bind
    rule = importlib.import_module(f"flatopt.kernels.rules.{name}").RULE
    span = _BOUND_SPANS.get(name)
    if span is None:
        span = _BOUND_SPANS[name] = bind(rule, njit(error_model="numpy"))[rule.span.__name__]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    flags = tuple(data.draw(st.booleans()) for _ in rule.flags._fields)
    columns = {}
    for column, kind in rule.columns.items():
        if column == "step":
            columns[column] = np.array([data.draw(st.integers(1, 5))], np.int64)
        elif kind == "uint8":
            columns[column] = np.array([data.draw(st.integers(0, 1))], np.uint8)
        else:
            columns[column] = rng.uniform(0.1, 1.0, 1).astype(rule.column_dtype(column,
                                                                               np.float64))
    scalars = rng.uniform(0.01, 0.9, len(rule.scalars._fields))
    off = [switch for switch in rule.span.branches
           if not (flags[rule.flags._fields.index(switch)] if switch in rule.flags._fields
                   else columns[switch][0] != 0)]
    names = rule.span.slot_names
    unread = {names.index(s) for switch in off for s in rule.span.branches[switch].unread}
    unwritten = {names.index(s) for switch in off for s in rule.span.branches[switch].unwritten}
    n = 9
    p, g = rng.standard_normal(n), rng.standard_normal(n)
    slots = [np.abs(rng.standard_normal(n)) for _ in rule.slots]
    results = []
    for fill in (np.nan, 0.5):
        arrays = [p.copy(), g.copy(), *[np.full(n, fill) if j in unread else s.copy()
                                        for j, s in enumerate(slots)]]
        before = [a.copy() for a in arrays]
        span(tuple(arrays), scalars, tuple(columns[c] for c in rule.columns), flags, 0, 0, n,
             1)
        for j in unwritten:
            assert arrays[2 + j].tobytes() == before[2 + j].tobytes()
        results.append([a for j, a in enumerate(arrays) if j < 2 or j - 2 not in unread])
    for with_nan, with_numbers in zip(*results):
        np.testing.assert_array_equal(with_nan, with_numbers)


def test_flags_that_are_not_variants_share_one_walk():
    compiled = cpu.compile_rule(flatopt.registry.lookup("AdamW").schema.rule)
    walks = {}
    for weight_decay in (0.0, 0.1):
        for amsgrad in (False, True):
            opt = flatopt.AdamW({"a": f32(10)}, weight_decay=weight_decay, amsgrad=amsgrad)
            buf = opt.buffers[0]
            walks[weight_decay, amsgrad] = compiled.step_kernel(
                opt.plan(buf, opt.settings()[buf.group]).flags)
    assert walks[0.0, False] is walks[0.1, False] and walks[0.0, True] is walks[0.1, True]
    assert walks[0.0, False] is not walks[0.0, True]
    assert walks[0.0, True].name.endswith("_amsgrad1_caution0")


def test_reduced_precision_walks_read_every_flag_as_a_constant():
    """The coded (reduced-precision) step walk is made per combination of every flag: its loop
    is bound by arithmetic, and a flag read in it (weight decay, maximize) left a branch that
    kept it from vectorizing at full width. The plain walk above still shares one walk across
    them."""
    from flatopt import _codec
    from flatopt.kernels import coded
    rule = flatopt.registry.lookup("AdamW").schema.rule
    walks = {}
    for weight_decay in (0.0, 0.1):
        for maximize in (False, True):
            opt = flatopt.AdamW({"a": f32(5000)}, weight_decay=weight_decay, maximize=maximize,
                                state_dtype="bfloat16")
            opt.step({"a": f32(5000, seed=1)})  # the walk runs (and the state exists)
            buf = opt.buffers[0]
            layout = _codec.coded_plan(buf, opt.schema, set(buf.state)).layout
            kernels = coded.compile_coded(rule, layout, cpu.compile_rule(rule))
            assert kernels.step_kernel.names == rule.flags._fields
            walks[weight_decay, maximize] = kernels.step_kernel(
                opt.plan(buf, opt.settings()[buf.group]).flags)
    assert len({id(w) for w in walks.values()}) == 4
    flags = opt.plan(buf, opt.settings()[buf.group]).flags
    assert walks[0.1, True].name.endswith("_f" + "".join(str(int(bool(f))) for f in flags))


def test_variants_must_be_flags():
    from flatopt.kernels.rules.adam import RULE
    import dataclasses
    fields = {f.name: getattr(RULE, f.name) for f in dataclasses.fields(RULE) if f.init}
    with pytest.raises(TypeError, match="variants"):
        type(RULE)(**{**fields, "variants": ("betas",)})


# ---------------------------------------------------------------------------- gradient totals
def test_each_gradient_reduction_mode_is_a_kernel_of_its_own():
    """An L2 clip compiles the sum of squares alone: each mode is its own threaded kernel
    (MODE a constant of it), and each gives that mode's value over the present gradients."""
    opt = flatopt.SGD({"a": f32(300), "b": f32(7), "c": f32(40)}, lr=0.1)
    grads = {"a": f32(300, seed=1), "b": f32(7, seed=2)}  # c missing: not counted
    grads["b"][3] = np.inf
    opt.stage_gradients(grads)
    buf = opt.buffers[0]

    def total(mode, power):
        return cpu.reduce_gradients(buf.length, buf.grads, buf.present, buf.offsets, buf.sizes,
                                    buf.chunk_first, buf.chunk_size, power, mode)

    present = np.concatenate([grads["a"], grads["b"]]).astype(np.float64)
    assert total(cpu.COUNT_NONFINITE, 0.0) == (0.0, 1)
    grads["b"][3] = 0.5
    opt.stage_gradients(grads)
    present[np.isinf(present)] = 0.5
    # (reassociation lets LLVM square float32 values in float32 before adding in float64)
    value, bad = total(cpu.SUM_SQUARES, 2.0)
    assert bad == 0 and value == pytest.approx(np.sum(present ** 2), rel=1e-6)
    assert total(cpu.SUM_POWERS, 3.0)[0] == pytest.approx(np.sum(np.abs(present) ** 3), rel=1e-6)
    assert total(cpu.MAX_ABS, np.inf)[0] == np.max(np.abs(present))
    kernels = {mode: cpu._by_mode(cpu._reduce_gradients, mode) for mode in cpu.MODE_NAMES}
    assert len(set(map(id, kernels.values()))) == len(cpu.MODE_NAMES)
    for mode, kernel in kernels.items():
        assert kernel.name == f"cpu.reduce_gradients_{cpu.MODE_NAMES[mode]}"
        assert kernel.serial.py_func.__globals__["MODE"] == mode
    with pytest.raises(ValueError, match="mode"):
        total(7, 2.0)
