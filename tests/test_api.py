"""The optimizer's API: packing, the index and views, parameter errors, gradients and
their presence, state dicts, and the error messages."""

from __future__ import annotations

import numpy as np
import pytest

import flatopt
from flatopt import GradientError, ParamError, StateDictError
from flatopt._layout import ALIGN_BYTES


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------- the seeds' fixtures
def test_seed_momentum_continuation_restored_versus_weights_only():
    """Restored buffer 2.0 then gradient -4 gives 1.22 (buffer -2.2); without it, 1.4 (-4)."""
    restored = flatopt.SGD({"p": np.array(1.0)}, lr=0.1, momentum=0.9)
    snapshot = restored.state_dict()
    snapshot["state"]["p"] = {"momentum_buffer": np.array(2.0)}
    restored.load_state_dict(snapshot)
    restored.step({"p": np.array(-4.0)})
    assert f"{float(restored.params['p']):.6f}" == "1.220000"
    assert float(restored.state_of("p").momentum_buffer) == pytest.approx(-2.2)

    weights_only = flatopt.SGD({"p": np.array(1.0)}, lr=0.1, momentum=0.9)
    weights_only.step({"p": np.array(-4.0)})
    assert f"{float(weights_only.params['p']):.6f}" == "1.400000"
    assert float(weights_only.state_of("p").momentum_buffer) == -4.0


# ---------------------------------------------------------------------------- packing and index
def test_one_aligned_buffer_per_group_and_dtype_and_a_complete_index():
    params = [{"params": {"a": f32(3, 5), "b": np.zeros(7), "c": f32(2)}, "lr": 0.1},
              {"params": {"d": f32(4)}, "label": "second"}]
    opt = flatopt.Adam(params)
    assert [(b.group, b.dtype) for b in opt.buffers] == [
        (0, np.float32), (0, np.float64), (1, np.float32)]
    assert [i.path for i in opt.index] == ["a", "b", "c", "d"]
    assert [i.id for i in opt.index] == [0, 1, 2, 3]
    c = opt.index["c"]
    assert (c.shape, c.dtype, c.group, c.buffer, c.size) == ((2,), np.float32, 0, 0, 2)
    assert c.offset == 16  # a's 15 elements padded to 64 bytes
    for buf in opt.buffers:
        for flat in (buf.params, buf.grads):
            assert flat.ndim == 1 and flat.flags.c_contiguous
            assert flat.ctypes.data % ALIGN_BYTES == 0
    for info in opt.index:
        assert info.offset * info.dtype.itemsize % ALIGN_BYTES == 0


def test_views_share_memory_with_the_flat_buffer_and_see_steps_immediately():
    original = f32(4, 3)
    opt = flatopt.SGD({"w": original}, lr=0.5)
    view = opt.params["w"]
    assert view.shape == (4, 3) and view.dtype == np.float32 and view.flags.writeable
    assert np.shares_memory(view, opt.buffers[0].params)
    assert not np.shares_memory(view, original)  # copied once at construction
    before = view.copy()
    grad = f32(4, 3, seed=1)
    opt.step({"w": grad})
    np.testing.assert_allclose(view, before - np.float32(0.5) * grad, rtol=1e-6)
    np.testing.assert_array_equal(original, before)  # the caller's array is not the parameter
    view[...] = 7.0  # writes through to the buffer used by the next step
    opt.step({"w": np.zeros((4, 3), np.float32)})
    np.testing.assert_array_equal(opt.params["w"], 7.0)


def test_zero_dim_and_zero_size_parameters():
    opt = flatopt.Adam({"scalar": np.array(2.0, np.float32), "empty": np.zeros((0, 3), np.float32),
                        "v": f32(5)}, lr=0.1)
    assert opt.params["scalar"].shape == () and opt.params["empty"].shape == (0, 3)
    opt.step({"scalar": np.array(1.0, np.float32), "empty": np.zeros((0, 3), np.float32),
              "v": f32(5)})
    assert float(opt.params["scalar"]) == pytest.approx(1.9, rel=1e-6)
    assert opt.state_of("empty").step == 1
    assert opt.state_dict()["state"]["empty"]["exp_avg"].shape == (0, 3)


def test_params_as_a_list_of_pairs_keep_their_order():
    opt = flatopt.SGD([("z", f32(2)), ("a", f32(3))])
    assert opt.index.paths == ["z", "a"]


# ---------------------------------------------------------------------------- parameter errors
@pytest.mark.parametrize("params, words", [
    ({}, "empty"),
    ([], "empty"),
    ({"a": np.arange(3)}, "int64"),
    ({"a": np.zeros(3, np.complex64)}, "complex64"),
    ({"a": np.array(["x"])}, "<U1"),
    ({"a": np.array([object()])}, "object"),
    ({"a": [1.0, 2.0]}, "list"),
    ({"": f32(2)}, "non-empty string"),
    ({"params": {"a": f32(2)}, "lr": 0.1}, "one group dict"),
    (f32(3), "bare array"),
], ids=["empty-dict", "empty-list", "int", "complex", "str", "object", "list", "empty-path",
        "single-group", "bare-array"])
def test_unusable_parameters_raise_param_error(params, words):
    with pytest.raises(ParamError, match=words):
        flatopt.SGD(params)


def test_a_set_of_parameters_is_refused_top_level_and_in_groups():
    with pytest.raises(ParamError, match="set"):
        flatopt.SGD({("a", 1)})
    with pytest.raises(ParamError, match="set"):
        flatopt.SGD([{"params": {("a", 1)}}])


def test_duplicate_paths_across_groups_name_the_path():
    with pytest.raises(ParamError, match="'a' appears more than once"):
        flatopt.SGD([{"params": {"a": f32(2)}}, {"params": {"a": f32(2)}}])


def test_tied_weights_are_refused_with_both_paths():
    shared = f32(4)
    with pytest.raises(ParamError, match="'enc.w' and 'dec.w' are the same array"):
        flatopt.SGD({"enc.w": shared, "dec.w": shared})
    matrix = f32(4, 4)
    with pytest.raises(ParamError, match="sharing memory"):
        flatopt.SGD({"w": matrix, "w_t": matrix.T})
    opt = flatopt.SGD({"w": matrix})
    with pytest.raises(ParamError, match="view of this optimizer's own buffer"):
        opt.add_param_group({"params": {"again": opt.params["w"]}})


def test_memory_sharing_is_found_between_any_two_parameters():
    x = np.zeros(10)
    with pytest.raises(ParamError, match="'even' and 'one'"):
        flatopt.SGD({"even": x[0::2], "odd": x[1::2], "one": x[2:3]})
    flatopt.SGD({"even": x[0::2], "odd": x[1::2]})  # interleaved, yet disjoint: accepted


def test_every_problem_is_listed_in_one_error():
    with pytest.raises(ParamError) as info:
        flatopt.SGD({"a": np.arange(3), "b": np.zeros(2, np.int8), "c": f32(2)})
    assert "'a'" in str(info.value) and "'b'" in str(info.value)


# ---------------------------------------------------------------------------- gradients
def test_missing_gradient_skips_the_parameter_entirely():
    opt = flatopt.AdamW({"used": f32(3), "frozen": f32(3, seed=1)}, lr=0.1, weight_decay=0.5)
    frozen = opt.params["frozen"].copy()
    for _ in range(3):
        opt.step({"used": f32(3, seed=2)})
    np.testing.assert_array_equal(opt.params["frozen"], frozen)  # no decoupled decay either
    assert opt.state_of("frozen") is None and opt.state_of("used").step == 3
    # unfrozen later: its own step count starts at 1 (its own bias correction)
    opt.step({"used": f32(3, seed=2), "frozen": f32(3, seed=3)})
    assert opt.state_of("frozen").step == 1 and opt.state_of("used").step == 4


def test_zero_gradient_is_a_real_step():
    opt = flatopt.AdamW({"a": np.ones(3, np.float32)}, lr=0.1, weight_decay=0.5)
    opt.step({"a": np.zeros(3, np.float32)})
    np.testing.assert_allclose(opt.params["a"], 1 - 0.1 * 0.5)
    assert opt.state_of("a").step == 1
    sgd = flatopt.SGD({"a": np.ones(2)}, lr=0.1, momentum=0.9, weight_decay=0.1)
    sgd.step({"a": np.zeros(2)})
    np.testing.assert_allclose(sgd.state_of("a").momentum_buffer, 0.1)


def test_zero_copy_gradients_with_explicit_presence():
    opt = flatopt.SGD({"a": np.ones(3), "b": np.ones(2)}, lr=0.5)
    g = opt.grads
    g["a"][...] = 1.0
    np.multiply(np.ones(2), 2.0, out=g["b"])
    assert np.shares_memory(g["a"], opt.buffers[0].grads)
    opt.step()  # nothing marked present: nothing moves
    np.testing.assert_array_equal(opt.params["a"], 1.0)
    g.mark_present(["a"])
    assert g.present_paths() == ["a"] and g.is_present("a") and not g.is_present("b")
    opt.step()
    np.testing.assert_array_equal(opt.params["a"], 0.5)
    np.testing.assert_array_equal(opt.params["b"], 1.0)
    g.mark_present()
    opt.step()
    np.testing.assert_array_equal(opt.params["b"], 0.0)
    g.mark_missing("a")
    assert g.present_paths() == ["b"]
    g["a"] = np.full(3, 2.0)  # assignment copies and marks present
    assert g.is_present("a")


def test_accumulating_after_zero_grad_starts_from_zeros_not_the_old_gradient():
    """The stale-gradient trap: after zero_grad(), opt.grads[k] += v steps on v (torch's
    .grad starts from nothing), not on the previous step's gradient plus v."""
    opt = flatopt.SGD({"a": np.zeros(3), "b": np.zeros(2)}, lr=1.0)
    opt.step({"a": np.full(3, 5.0), "b": np.full(2, 5.0)})
    opt.zero_grad()
    opt.grads["a"] += np.ones(3)  # getitem, in-place add, setitem (marks present)
    g = opt.grads["b"]
    g += 2.0
    opt.grads.mark_present(["b"])
    opt.step()
    np.testing.assert_array_equal(opt.params["a"], -6.0)  # -5 - 1
    np.testing.assert_array_equal(opt.params["b"], -7.0)  # -5 - 2


def test_a_missing_gradient_is_zeroed_once_so_writes_through_views_survive():
    opt = flatopt.SGD({"w": np.zeros((2, 2)), "b": np.zeros(2)}, lr=1.0)
    opt.step({"w": np.ones((2, 2)), "b": np.ones(2)})
    opt.zero_grad()
    np.matmul(np.eye(2), np.full((2, 2), 3.0), out=opt.grads["w"])  # zero-copy backprop
    opt.grads["w"] *= 0.5  # the view taken again: what was written stays
    stale = opt.grads["b"]  # taken and zeroed, then marked missing again below
    opt.grads.mark_present()
    np.testing.assert_array_equal(opt.grads["w"], 1.5)
    opt.step()
    np.testing.assert_array_equal(opt.params["w"], -2.5)
    stale[...] = 9.0
    opt.grads.mark_missing(["b"])
    np.testing.assert_array_equal(opt.grads["b"], 0.0)  # missing: its view reads zeros
    np.testing.assert_array_equal(stale, 0.0)  # (the same memory)
    early = opt.grads["w"]  # taken while present: zero_grad() does not touch the buffer
    opt.zero_grad()
    np.testing.assert_array_equal(early, 1.5)
    opt.zero_grad(set_to_none=False)  # torch: existing gradients zeroed
    np.testing.assert_array_equal(early, 0.0)


def test_assigning_a_parameter_copies_it_in_after_the_same_checks_as_gradients():
    opt = flatopt.Adam({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)})
    view = opt.params["w"]
    opt.params["w"] = np.full((2, 3), 2.0, np.float32)
    assert view is opt.params["w"] and np.shares_memory(view, opt.buffers[0].params)
    np.testing.assert_array_equal(view, 2.0)
    for bad, match in ((np.zeros((3, 2), np.float32), r"value for 'w' has shape \(3, 2\)"),
                       (np.zeros((2, 3)), "value for 'w' has dtype float64"),
                       ([[0.0] * 3] * 2, "value for 'w' is a list")):
        with pytest.raises(ParamError, match=match):
            opt.params["w"] = bad
    with pytest.raises(flatopt.UnknownPathError, match="no parameter 'v'"):
        opt.params["v"] = np.zeros(3, np.float32)
    np.testing.assert_array_equal(view, 2.0)


def test_zero_grad_set_to_none_marks_missing_and_false_zeroes_existing_gradients():
    opt = flatopt.SGD({"a": np.ones(3), "b": np.ones(2)}, lr=0.5, weight_decay=1.0)
    opt.grads["a"] = np.ones(3)
    opt.zero_grad()
    assert not opt.grads.is_present("a")
    opt.step()
    np.testing.assert_array_equal(opt.params["a"], 1.0)
    opt.grads["a"] = np.ones(3)
    opt.zero_grad(set_to_none=False)  # torch: existing gradients zeroed, None stays None
    assert opt.grads.present_paths() == ["a"]
    np.testing.assert_array_equal(opt.grads["a"], 0.0)
    opt.step()  # a real step for a: weight decay acts on a zero gradient; b is skipped
    np.testing.assert_array_equal(opt.params["a"], 0.5)
    np.testing.assert_array_equal(opt.params["b"], 1.0)


@pytest.mark.parametrize("grads, words", [
    ({"a": np.ones(4)}, "'a' has shape \\(4,\\)"),
    ({"a": np.ones(3, np.float32)}, "'a' has dtype float32"),
    ({"ab": np.ones(3)}, "unknown parameter 'ab'.*did you mean"),
    ({"a": [1.0, 1.0, 1.0]}, "list"),
])
def test_bad_gradients_raise_gradient_error_and_change_nothing(grads, words):
    opt = flatopt.SGD({"a": np.ones(3), "b": np.ones(2)}, lr=0.5)
    opt.grads["b"] = np.full(2, 3.0)
    with pytest.raises(GradientError, match=words):
        opt.step({"b": np.ones(2), **grads})
    np.testing.assert_array_equal(opt.grads["b"], 3.0)
    assert opt.grads.present_paths() == ["b"]
    np.testing.assert_array_equal(opt.params["b"], 1.0)


def test_marking_an_unknown_path_changes_no_flag():
    opt = flatopt.SGD({"a": np.ones(3), "b": np.ones(2)})
    with pytest.raises(GradientError, match="'c'"):
        opt.grads.mark_present(["a", "c"])
    assert opt.grads.present_paths() == []


# ---------------------------------------------------------------------------- state dicts
def test_state_dict_returns_copies_and_optimizers_never_share_state():
    a = flatopt.Adam({"w": f32(3)}, lr=0.1)
    a.step({"w": f32(3, seed=1)})
    snapshot = a.state_dict()
    snapshot["state"]["w"]["exp_avg"][...] = 99.0
    assert (a.state_of("w").exp_avg != 99.0).all()
    b = flatopt.Adam({"w": f32(3)}, lr=0.1)
    b.load_state_dict(a.state_dict())
    b.step({"w": f32(3, seed=2)})
    assert a.state_of("w").step == 1 and b.state_of("w").step == 2
    assert not np.shares_memory(a.state_of("w").exp_avg, b.state_of("w").exp_avg)


def test_load_state_dict_matches_by_path_not_position():
    a = flatopt.SGD({"x": np.ones(2), "y": np.ones(2)}, momentum=0.9)
    a.step({"x": np.full(2, 1.0), "y": np.full(2, 5.0)})
    b = flatopt.SGD({"y": np.ones(2), "x": np.ones(2)}, momentum=0.9)  # same shapes, swapped
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(b.state_of("x").momentum_buffer, 1.0)
    np.testing.assert_array_equal(b.state_of("y").momentum_buffer, 5.0)


def test_load_state_dict_reports_every_mismatch_and_changes_nothing():
    a = flatopt.Adam({"x": f32(2), "y": f32(3), "gone": f32(1)}, lr=0.1)
    a.step({"x": f32(2), "y": f32(3), "gone": f32(1)})
    b = flatopt.Adam({"x": f32(2), "y": f32(4)}, lr=0.5)
    b.step({"x": f32(2, seed=4), "y": f32(4, seed=4)})
    before = b.state_dict()
    with pytest.raises(StateDictError) as info:
        b.load_state_dict(a.state_dict())
    message = str(info.value)
    assert "'gone'" in message and "'y'" in message and "shape (3,)" in message
    assert "grouping changed" in message
    after = b.state_dict()
    assert after["param_groups"] == before["param_groups"]
    np.testing.assert_array_equal(after["state"]["x"]["exp_avg"], before["state"]["x"]["exp_avg"])
    with pytest.raises(StateDictError, match="from Adam"):
        flatopt.SGD({"x": f32(2)}).load_state_dict(a.state_dict())


def test_load_state_dict_saved_hyperparameters_win_unless_live_is_chosen():
    a = flatopt.SGD({"x": np.ones(2)}, lr=0.1, momentum=0.9)
    a.step({"x": np.ones(2)})
    b = flatopt.SGD({"x": np.ones(2)}, lr=0.5, momentum=0.9)
    b.load_state_dict(a.state_dict(), hyperparameters="live")
    assert b.param_groups[0]["lr"] == 0.5 and b.state_of("x") is not None
    b.load_state_dict(a.state_dict())
    assert b.param_groups[0]["lr"] == 0.1


def test_load_state_dict_restores_the_saved_label_and_initial_lr():
    a = flatopt.SGD([{"params": {"x": np.ones(2)}, "label": "saved", "initial_lr": 0.1}], lr=0.1)
    b = flatopt.SGD([{"params": {"x": np.ones(2)}, "label": "live"}], lr=0.5)
    b.load_state_dict(a.state_dict())
    assert b.param_groups[0]["label"] == "saved" and b.param_groups[0]["initial_lr"] == 0.1


@pytest.mark.parametrize("mangle, words", [
    (lambda sd: sd["state"]["x"].update(step=2 ** 63), "step must be an integer"),
    (lambda sd: sd["state"]["x"].update(step=np.uint64(2 ** 64 - 1)), "step must be an integer"),
    (lambda sd: sd.update(state=[1]), "'state' must be a dict"),
    (lambda sd: sd.update(param_groups=[3]), "'param_groups' must be a list of dicts"),
    (lambda sd: sd["param_groups"][0].update(params=5), "'param_groups' must be a list"),
    # an invalid flag the state checks read (amsgrad: which slots are used) was a KeyError
    (lambda sd: sd["param_groups"][0].update(amsgrad=0), "amsgrad=0 is invalid"),
])
def test_malformed_state_dicts_raise_state_dict_error_and_change_nothing(mangle, words):
    a = flatopt.Adam({"x": f32(2), "y": f32(2)}, lr=0.1)
    a.step({"x": f32(2), "y": f32(2)})
    snapshot = a.state_dict()
    mangle(snapshot)
    b = flatopt.Adam({"x": f32(2), "y": f32(2)}, lr=0.5)
    b.step({"x": f32(2, seed=3), "y": f32(2, seed=3)})
    before = b.state_dict()
    with pytest.raises(StateDictError, match=words):
        b.load_state_dict(snapshot)
    after = b.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert {p: s["step"] for p, s in after["state"].items()} == {"x": 1, "y": 1}


def test_loading_state_without_an_entry_resets_that_parameter():
    fresh = flatopt.Adam({"x": f32(2), "y": f32(2)}, lr=0.1)
    fresh.step({"x": f32(2)})
    used = flatopt.Adam({"x": f32(2), "y": f32(2)}, lr=0.1)
    for _ in range(3):
        used.step({"x": f32(2, seed=1), "y": f32(2, seed=1)})
    used.load_state_dict(fresh.state_dict())
    assert used.state_of("y") is None
    used.step({"y": f32(2, seed=1)})
    assert used.state_of("y").step == 1
    np.testing.assert_allclose(used.state_of("y").exp_avg, 0.1 * f32(2, seed=1), rtol=1e-6)


def test_one_mistake_repeated_over_many_parameters_gives_a_short_message():
    params = {f"layer{k}.bias": np.zeros(3, np.float32) for k in range(1000)}
    with pytest.raises(flatopt.ParamError) as caught:
        flatopt.Muon(params)
    lines = str(caught.value).splitlines()
    assert len(lines) == 21 and "'layer0.bias'" in lines[0]
    assert lines[-1] == "... and 980 more problems like these"
