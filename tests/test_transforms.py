"""flatopt.chain: optax-style transforms fused into one rule, against NumPy transcriptions of
optax 0.2.8's own definitions (tests/custom_references.py) for generated chains, and against
flatopt's AdamW (the same update up to rounding)."""

from __future__ import annotations

import copy
from fnmatch import fnmatchcase

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flatopt
import custom_references as optax
from flatopt import registry, transforms as T
from flatopt.errors import RuleDefinitionError
from test_custom import parallel_equals_serial

SHAPES = {"a": (4, 6), "b": (9,)}


@pytest.fixture
def unregister():
    names = []
    yield names
    for name in names:
        registry.unregister(name)


def run_both(ours, theirs, steps: int, dtype=np.float64, seed: int = 0, **options):
    """Parameters after ``steps`` steps of the flatopt chain class ``ours`` and the optax
    reference transform ``theirs``, from the same parameters and gradients."""
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}
    grads = [{k: (3 * rng.standard_normal(s)).astype(dtype) for k, s in SHAPES.items()}
             for _ in range(steps)]
    opt = ours({k: v.copy() for k, v in params.items()})
    for g in grads:
        opt.step(g, **options)
    expected, _ = optax.run_transform(theirs, params, grads)
    return opt, expected[-1]


PIECES = {
    "adam": (st.tuples(st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from([0.9, 0.999]),
                       st.sampled_from([1e-8, 1e-3]), st.sampled_from([0.0, 1e-6])),
             T.scale_by_adam, optax.scale_by_adam),
    "rms": (st.tuples(st.sampled_from([0.5, 0.9, 0.99]), st.sampled_from([1e-8, 1e-2])),
            T.scale_by_rms, optax.scale_by_rms),
    "sign": (st.just(()), T.scale_by_sign, optax.scale_by_sign),
    "trace": (st.tuples(st.sampled_from([0.0, 0.5, 0.9]), st.booleans()), T.trace,
              optax.trace),
    "decay": (st.tuples(st.sampled_from([0.0, 1e-2, 0.3])), T.add_decayed_weights,
              optax.add_decayed_weights),
}


@st.composite
def chains(draw):
    """A sequence of 1 to 4 transforms (repeats allowed: their names get suffixes), each
    maybe masked to some paths, then a learning rate: (flatopt transforms, optax's)."""
    kinds = draw(st.lists(st.sampled_from(sorted(PIECES)), min_size=1, max_size=4))
    ours, theirs = [], []
    for kind in kinds:
        arguments = draw(PIECES[kind][0])
        mine, reference = PIECES[kind][1](*arguments), PIECES[kind][2](*arguments)
        pattern = draw(st.sampled_from([None, "a", "*", "[!a]"]))  # masked to some paths
        if pattern is not None:
            mine = T.masked(mine, pattern)
            reference = optax.masked(reference, {path: fnmatchcase(path, pattern)
                                                 for path in SHAPES})
        ours.append(mine)
        theirs.append(reference)
    lr = draw(st.sampled_from([1e-3, 0.1]))
    return ours + [T.scale_by_learning_rate(lr)], theirs + [optax.scale_by_learning_rate(lr)]


@settings(max_examples=15, deadline=None, derandomize=True)
@given(pair=chains(), steps=st.integers(1, 4))
def test_generated_chains_match_optax(pair, steps):
    ours, theirs = pair
    cls = T.chain(*ours, name="GeneratedChain")
    try:
        opt, expected = run_both(cls, optax.chain(*theirs), steps)
        for path in SHAPES:
            np.testing.assert_allclose(opt.params[path], expected[path], rtol=1e-10,
                                       atol=1e-12, err_msg=path)
    finally:
        registry.unregister("GeneratedChain")


def test_the_adamw_chain_is_adamw_up_to_rounding(unregister):
    cls = T.chain(T.scale_by_adam(), T.add_decayed_weights(1e-2), T.scale_by_learning_rate(1e-3))
    unregister.append(cls.schema.name)
    rng = np.random.default_rng(5)
    # float32: a few units in the last place of parameters of order 1 (the two round
    # sqrt(v / bc2) against sqrt(v) / sqrt(bc2), a lerp against (1 - b1) g + b1 m)
    for dtype, rtol, atol in ((np.float64, 1e-12, 1e-15), (np.float32, 2e-6, 1e-6)):
        p = rng.standard_normal(2000).astype(dtype)
        ours, adamw = cls({"w": p.copy()}), flatopt.AdamW({"w": p.copy()}, lr=1e-3)
        for _ in range(20):
            g = rng.standard_normal(2000).astype(dtype)
            ours.step({"w": g})
            adamw.step({"w": g})
        np.testing.assert_allclose(ours.params["w"], adamw.params["w"], rtol=rtol, atol=atol)
        np.testing.assert_allclose(ours.state_of("w").nu, adamw.state_of("w").exp_avg_sq,
                                   rtol=rtol * 10, atol=atol * 1e-3)
        assert ours.params["w"].dtype == dtype


def test_clipping_first_is_the_steps_clipping(unregister):
    cls = T.chain(T.clip_by_global_norm(1.0), T.trace(0.9), T.scale_by_learning_rate(0.1))
    unregister.append(cls.schema.name)
    theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.trace(0.9),
                         optax.scale_by_learning_rate(0.1))
    opt, expected = run_both(cls, theirs, 3)
    for path in SHAPES:  # torch's 1e-6 in the denominator is the only difference
        np.testing.assert_allclose(opt.params[path], expected[path], rtol=1e-6)
    unclipped, _ = run_both(cls, theirs, 3, max_grad_norm=1e9)
    assert not np.allclose(unclipped.params["a"], opt.params["a"])


def test_a_chain_is_an_optimizer_with_named_state_and_groups(unregister, tmp_path):
    cls = T.chain(T.scale_by_adam(), T.trace(0.5), T.trace(0.9), T.scale_by_learning_rate(0.01))
    unregister.append(cls.schema.name)
    assert tuple(cls.schema.slots) == ("mu", "nu", "trace", "trace_2")
    assert {"decay", "decay_2", "lr", "nesterov", "nesterov_2"} <= set(cls.schema.hyperparameters)
    opt = cls([{"params": {"a": np.ones(3)}}, {"params": {"b": np.ones(2)}, "lr": 0.0}])
    scheduler = flatopt.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
    opt.step({"a": np.ones(3), "b": np.ones(2)})
    scheduler.step()
    np.testing.assert_array_equal(opt.params["b"], np.ones(2))  # lr 0: unchanged
    assert opt.params["a"][0] < 1.0
    flatopt.save(tmp_path / "chain.h5", opt)
    again = cls([{"params": {"a": np.zeros(3)}}, {"params": {"b": np.zeros(2)}, "lr": 0.0}])
    flatopt.load(tmp_path / "chain.h5", again, hyperparameters="saved")  # the scheduled lr
    for o in (opt, again):
        o.step({"a": np.full(3, 0.5), "b": np.ones(2)})
    assert opt.params["a"].tobytes() == again.params["a"].tobytes()


@pytest.mark.parametrize("transforms, message", [
    ((), "one or more"),
    ((T.trace(), T.clip_by_global_norm(1.0)), "must come first"),
    ((T.clip_by_global_norm(1.0),), "besides clipping"),
    (("scale_by_adam",), "one or more"),
])
def test_bad_chains_are_refused(transforms, message):
    with pytest.raises(RuleDefinitionError, match=message):
        T.chain(*transforms)


def test_bad_transform_arguments_are_refused():
    with pytest.raises(RuleDefinitionError, match="max_norm"):
        T.clip_by_global_norm(0.0)
    with pytest.raises(RuleDefinitionError, match="initial_scale"):
        T.scale_by_rms(initial_scale=1.0)
    with pytest.raises(RuleDefinitionError, match="b1"):
        T.chain(T.scale_by_adam(b1=1.5), T.scale_by_learning_rate(0.1))


def test_a_masked_chains_parallel_walk_gives_the_serial_bits(unregister, monkeypatch):
    cls = T.chain(T.clip_by_global_norm(2.0), T.scale_by_adam(), T.trace(0.5),
                  T.masked(T.add_decayed_weights(0.1), "[ad]"), T.scale_by_learning_rate(0.01))
    unregister.append(cls.schema.name)
    parallel_equals_serial(cls, monkeypatch)


def test_bad_masks_are_refused():
    with pytest.raises(RuleDefinitionError, match="clipping nor masked"):
        T.masked(T.clip_by_global_norm(1.0), "*")
    with pytest.raises(RuleDefinitionError, match="clipping nor masked"):
        T.masked(T.masked(T.trace(), "*"), "a")
    with pytest.raises(RuleDefinitionError, match="path pattern"):
        T.masked(T.trace(), [])


@pytest.mark.parametrize("storage", [{}, {"state_dtype": "bfloat16"},
                                     {"master_weights": True, "dtype": "bfloat16"}],
                         ids=["float32", "bf16_state", "bf16_master"])
def test_a_mask_is_set_for_parameters_added_later_and_survives_loads(unregister, tmp_path,
                                                                     storage):
    """Found by a hostile probe: loads into reduced-precision buffers zeroed the masks."""
    storage = dict(storage)
    dtype = ml_dtypes.bfloat16 if storage.pop("dtype", None) else np.float32
    cls = T.chain(T.scale_by_adam(), T.masked(T.add_decayed_weights(0.5), "*.w"),
                  T.scale_by_learning_rate(0.25))
    unregister.append(cls.schema.name)
    paths = ("l.w", "l.b", "m.w", "m.b")
    start = {path: np.ones(2, dtype) for path in paths}
    opt = cls({p: start[p].copy() for p in paths[:2]}, **storage)
    opt.add_param_group({"params": {p: start[p].copy() for p in paths[2:]}})
    grads = {path: np.full(2, 0.5, dtype) for path in paths}
    opt.step(grads)
    for load in ("file", "state_dict"):
        again = cls({p: start[p].copy() for p in paths[:2]}, **storage)
        again.add_param_group({"params": {p: start[p].copy() for p in paths[2:]}})
        if load == "file":
            flatopt.save(tmp_path / "masked.h5", opt)
            flatopt.load(tmp_path / "masked.h5", again)
        else:
            again.load_state_dict(opt.state_dict())
            for path in paths:
                again.params[path] = opt.params[path]
        twin = copy.deepcopy(opt.state_dict()), {p: opt.params[p].copy() for p in paths}
        for o in (again, opt):
            o.step(grads)
        for path in paths:
            assert again.params[path].tobytes() == opt.params[path].tobytes(), (load, path)
        opt.load_state_dict(twin[0])
        for path in paths:
            opt.params[path] = twin[1][path]
    decayed = opt.params["l.w"].astype(np.float32)[0] < opt.params["l.b"].astype(np.float32)[0]
    assert decayed  # the weights decay, the biases do not


def test_chains_of_the_same_pieces_with_other_defaults_each_load_their_own_files(unregister,
                                                                                 tmp_path):
    """Found by a hostile probe: two such chains share a default name; the second replaced
    the first, whose own checkpoints then failed to load into it."""
    encoder = T.chain(T.scale_by_adam(), T.scale_by_learning_rate(1e-3))
    decoder = T.chain(T.scale_by_adam(b1=0.5), T.scale_by_learning_rate(1e-2))
    unregister.append(encoder.schema.name)
    assert encoder.schema.name == decoder.schema.name
    for cls in (encoder, decoder):
        opt = cls({"w": np.ones(3)})
        opt.step({"w": np.ones(3)})
        flatopt.save(tmp_path / "own.h5", opt)
        again = cls({"w": np.zeros(3)})
        flatopt.load(tmp_path / "own.h5", again)
        assert again.params["w"].tobytes() == opt.params["w"].tobytes()


def test_a_chain_with_a_long_default_name_steps(unregister):
    """Found by a hostile probe: a 258-character default name made Numba's cache file names
    too long for the file system (OSError at the first step)."""
    cls = T.chain(*[T.masked(T.add_decayed_weights(0.01), "*.weight") for _ in range(8)],
                  T.scale_by_adam(), T.scale_by_learning_rate(1e-3))
    unregister.append(cls.schema.name)
    assert len(cls.schema.name) > 250
    opt = cls({"l.weight": np.ones(4, np.float32)})
    opt.step({"l.weight": np.ones(4, np.float32)})
    assert opt.params["l.weight"][0] < 1
