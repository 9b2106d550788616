"""Cautious updates (``caution=True``: timm's mask from "Cautious Optimizers", arXiv
2411.16085) in AdamW/Adam, Lion and ADOPT: the mask's semantics on hand-made cases, the clamp,
the per-parameter mean's independence of threads and chunking, the flag's second pass only
when set, and old checkpoints and state dicts (without ``caution``) still loading."""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest

import flatopt
from flatopt import HyperparameterError
from flatopt.checkpoint import writer as writer_mod
from flatopt.kernels import cpu
from optimizers import INFO, NAMES, slow_beyond
from reference import ReferenceOptimizer
from walks import SHAPES, serial_and_chunked

CAUTIOUS = [name for name in NAMES if INFO[name].cautious]  # Adam, AdamW, Lion, ADOPT


def adamw(caution, n=4, dtype=np.float64, **settings):
    return flatopt.AdamW({"w": np.zeros(n, dtype)}, lr=0.1, weight_decay=0.0,
                         caution=caution, **settings)


def test_only_elements_whose_new_moment_agrees_with_the_gradient_move_scaled_up():
    """Step 2's gradient [-10, -0.5, 1, 1] after a step of ones: the new moments are
    [-0.91, 0.04, 0.19, 0.19], so elements 0, 2, 3 agree (element 0 only with the NEW moment,
    the old one being 0.1) and move 4/3 as far as without caution; element 1 stays."""
    plain, cautious = adamw(False), adamw(True)
    for opt in (plain, cautious):
        opt.step({"w": np.ones(4)})
    np.testing.assert_array_equal(cautious.params["w"], plain.params["w"])  # all agree
    before = cautious.params["w"].copy()
    for opt in (plain, cautious):
        opt.step({"w": np.array([-10.0, -0.5, 1.0, 1.0])})
    np.testing.assert_allclose(cautious.state_of("w").exp_avg, [-0.91, 0.04, 0.19, 0.19])
    np.testing.assert_array_equal(cautious.state_of("w").exp_avg,
                                  plain.state_of("w").exp_avg)  # stored unmasked
    moved_plain = plain.params["w"] - before
    moved = cautious.params["w"] - before
    assert moved[1] == 0.0 and moved_plain[1] != 0.0
    np.testing.assert_allclose(moved[[0, 2, 3]], moved_plain[[0, 2, 3]] * (4 / 3),
                               rtol=1e-14)


def test_the_mean_is_clamped_at_one_thousandth():
    """One agreeing element in 2000: the scale is 1 / max(1/2000, 1e-3) = 1000, not 2000."""
    for dtype in (np.float64, np.float32):
        plain, cautious = adamw(False, 2000, dtype), adamw(True, 2000, dtype)
        grad = np.full(2000, -0.5, dtype)
        grad[7] = 1.0
        for opt in (plain, cautious):
            opt.step({"w": np.ones(2000, dtype)})
        before = cautious.params["w"].copy()
        for opt in (plain, cautious):
            opt.step({"w": grad})
        moved = cautious.params["w"] - before
        assert np.count_nonzero(moved) == 1
        expected = (plain.params["w"][7] - before[7]) * 1000
        np.testing.assert_allclose(moved[7], expected, rtol=1e-6 if dtype == np.float32
                                   else 1e-12)
        # rounded as timm's float32 tensors: 1 / float32(1e-3), in the dtype
        assert cautious.buffers[0].columns["caution_scale"][0] == dtype(1) / dtype(1e-3)


def test_a_zero_gradient_keeps_nothing_but_the_decoupled_decay():
    opt = flatopt.AdamW({"w": np.ones(5)}, lr=0.1, weight_decay=0.5, caution=True)
    opt.step({"w": np.zeros(5)})
    np.testing.assert_array_equal(opt.params["w"], np.full(5, 1 - 0.1 * 0.5))
    lion = flatopt.Lion({"w": np.ones(5)}, lr=0.1, weight_decay=0.5, caution=True)
    lion.step({"w": np.zeros(5)})
    np.testing.assert_array_equal(lion.params["w"], np.full(5, 1 - 0.1 * 0.5))


def test_lion_masks_with_the_interpolated_direction_not_the_stored_momentum():
    """timm's Lion: sign(beta1 * m + (1 - beta1) * g) * g > 0. After a step of ones
    (m = 0.01), g = [-0.5, 1] gives directions [-0.041, 0.109]: both agree and move by lr,
    although the new momentum's first element (0.0049) disagrees with its gradient."""
    opt = flatopt.Lion({"w": np.zeros(2)}, lr=0.1, caution=True)
    opt.step({"w": np.ones(2)})
    opt.step({"w": np.array([-0.5, 1.0])})
    np.testing.assert_allclose(opt.state_of("w").exp_avg, [0.0049, 0.0199])
    np.testing.assert_array_equal(opt.params["w"], [-0.1 + 0.1, -0.1 - 0.1])
    # directions [0.00431, 0.1179]: one agrees of two, and moves 2 * lr
    opt.step({"w": np.array([-1e-3, 1.0])})
    np.testing.assert_allclose(opt.params["w"], [0.0, -0.2 - 0.2], atol=1e-15)


def test_adopt_first_step_only_seeds_and_later_steps_are_cautious():
    opt = flatopt.ADOPT({"w": np.ones(4)}, lr=0.1, caution=True, clip_exp=None)
    opt.step({"w": np.array([1.0, 1.0, 1.0, 1.0])})
    np.testing.assert_array_equal(opt.params["w"], 1.0)
    ref = ReferenceOptimizer("ADOPT", [({"w": np.ones(4)}, opt.param_groups[0])])
    ref.step({"w": np.ones(4)})
    grad = np.array([1.0, -1.0, 2.0, -3.0])
    opt.step({"w": grad})
    ref.step({"w": grad})
    np.testing.assert_allclose(opt.params["w"], ref.params["w"], rtol=1e-14)
    # m = 0.1 * g / 1: every element agrees; the next m is [0.04, -0.04, 0.38, -0.57]
    grad = np.array([-0.5, 0.5, 2.0, -3.0])
    opt.step({"w": grad})
    ref.step({"w": grad})
    np.testing.assert_allclose(opt.params["w"], ref.params["w"], rtol=1e-14)
    assert opt.buffers[0].columns["caution_scale"][0] == 2.0


@pytest.mark.parametrize("name", CAUTIOUS)
def test_switching_caution_mid_run_follows_the_reference(name):
    rng = np.random.default_rng(3)
    params = {"a": rng.standard_normal(300), "b": rng.standard_normal((5, 7))}
    opt = flatopt.registry.lookup(name)(params, lr=0.01)
    ref = ReferenceOptimizer(name, [(params, dict(opt.param_groups[0]))])
    for step in range(6):
        caution = step in (2, 3, 5)
        opt.param_groups[0]["caution"] = caution
        ref.groups[0][1]["caution"] = caution
        grads = {k: rng.standard_normal(v.shape) for k, v in params.items()}
        opt.step(grads)
        ref.step(grads)
        for path in params:
            np.testing.assert_allclose(opt.params[path], ref.params[path], rtol=1e-12,
                                       err_msg=f"{name} {path} step {step}")


@pytest.mark.parametrize("name", slow_beyond(CAUTIOUS))
def test_the_scale_does_not_depend_on_threads_or_chunks(name, monkeypatch):
    """The count of agreeing elements is summed per chunk segment, then in chunk order: the
    same bits serially, and threaded over 64-element chunks that cut every parameter."""
    cls = flatopt.registry.lookup(name)
    serial, chunked = serial_and_chunked(lambda params: cls(params, caution=True), monkeypatch,
                                         {**SHAPES, "a": (5000,)}, seed=11)
    scales = serial.buffers[0].columns["caution_scale"]
    assert np.array_equal(chunked.buffers[0].columns["caution_scale"], scales)
    assert np.any(scales > 1)  # the mask did keep a share below one somewhere


@pytest.mark.parametrize("name", slow_beyond(CAUTIOUS))
def test_the_second_pass_runs_only_with_caution(name, monkeypatch):
    calls = []
    original = cpu.CompiledRule.reduce

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cpu.CompiledRule, "reduce", counting)
    opt = flatopt.registry.lookup(name)({"w": np.ones(10, np.float32)})
    opt.step({"w": np.ones(10, np.float32)})
    assert calls == []
    opt.param_groups[0]["caution"] = True
    opt.step({"w": np.ones(10, np.float32)})
    assert calls == [1]


@pytest.mark.parametrize("name", CAUTIOUS)
def test_caution_must_be_a_bool_named_with_its_group(name):
    cls = flatopt.registry.lookup(name)
    with pytest.raises(HyperparameterError, match=r"param group 1 \('late'\): caution=1 is "
                                                  "invalid: must be True or False"):
        cls([{"params": {"a": np.ones(2)}}, {"params": {"b": np.ones(2)}, "caution": 1,
                                               "label": "late"}])
    opt = cls({"a": np.ones(2)})
    opt.param_groups[0]["caution"] = "yes"
    with pytest.raises(HyperparameterError, match="caution='yes' is invalid"):
        opt.step({"a": np.ones(2)})
    assert opt.state_of("a") is None


def _hyperparameters(file) -> str:
    text = file["groups/0"].attrs["hyperparameters"]
    return text.decode() if isinstance(text, bytes) else str(text)


def _save_as_before_caution(path, opt, monkeypatch):
    """A checkpoint as the flatopt before ``caution`` wrote it: schema version 1 (no
    attribute) and groups without the key."""
    old_settings = opt.settings

    def settings():
        return [{k: v for k, v in group.items() if k != "caution"} for group in old_settings()]

    monkeypatch.setattr(opt, "settings", settings)
    original = writer_mod.Snapshot.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.header.pop("schema_version", None)

    monkeypatch.setattr(writer_mod.Snapshot, "__init__", init)
    flatopt.save(path, opt)
    monkeypatch.undo()
    with h5py.File(path) as f:
        assert "schema_version" not in f.attrs
        assert "caution" not in _hyperparameters(f)


@pytest.mark.parametrize("name", ["AdamW", "Lion"])
def test_a_checkpoint_from_before_caution_loads_as_caution_false(name, tmp_path,
                                                                 monkeypatch):
    cls = flatopt.registry.lookup(name)
    rng = np.random.default_rng(0)
    opt = cls({"w": rng.standard_normal(6).astype(np.float32)})
    opt.step({"w": rng.standard_normal(6).astype(np.float32)})
    _save_as_before_caution(tmp_path / "old.h5", opt, monkeypatch)
    fresh = cls({"w": np.zeros(6, np.float32)})
    flatopt.load(tmp_path / "old.h5", fresh)
    assert fresh.params["w"].tobytes() == opt.params["w"].tobytes()
    assert fresh.state_of("w").step == 1 and fresh.param_groups[0]["caution"] is False
    # the file means caution=False: a cautious optimizer differs from it
    cautious = cls({"w": np.zeros(6, np.float32)}, caution=True)
    with pytest.raises(flatopt.CheckpointMismatch, match="caution"):
        flatopt.load(tmp_path / "old.h5", cautious)
    flatopt.load(tmp_path / "old.h5", cautious, hyperparameters="saved")
    assert cautious.param_groups[0]["caution"] is False
    # and what this flatopt writes is schema version 2, with the key
    flatopt.save(tmp_path / "new.h5", cautious)
    with h5py.File(tmp_path / "new.h5") as f:
        assert f.attrs["schema_version"] == 2
        assert '"caution": false' in _hyperparameters(f)


def test_a_hyperparameter_newer_than_its_schema_is_refused():
    with pytest.raises(TypeError, match=r"\['caution'\] are of a later version"):
        dataclasses.replace(flatopt.AdamW.schema, version=1)


def test_a_state_dict_from_before_caution_loads():
    opt = flatopt.AdamW({"w": np.ones(3)})
    opt.step({"w": np.ones(3)})
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["caution"]
    fresh = flatopt.AdamW({"w": np.zeros(3)})
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["caution"] is False and fresh.state_of("w").step == 1
    np.testing.assert_array_equal(fresh.state_of("w").exp_avg, opt.state_of("w").exp_avg)


def test_a_torch_adamw_run_continues_cautiously():
    """torch's groups have no ``caution``: the live optimizer's setting stays."""
    torch = pytest.importorskip("torch")
    t = torch.ones(4, requires_grad=True)
    torch_opt = torch.optim.AdamW([t], lr=0.1)
    t.grad = torch.ones(4)
    torch_opt.step()
    opt = flatopt.AdamW({"w": t.detach().numpy().copy()}, lr=0.5, caution=True)
    opt.load_torch_state_dict(torch_opt.state_dict(), ["w"])
    assert opt.param_groups[0]["caution"] is True and opt.param_groups[0]["lr"] == 0.1
    ref = ReferenceOptimizer("AdamW", [({"w": opt.params["w"].copy()},
                                        dict(opt.param_groups[0]))])
    ref.state["w"] = {"step": 1, "exp_avg": opt.state_of("w").exp_avg.copy(),
                      "exp_avg_sq": opt.state_of("w").exp_avg_sq.copy()}
    grad = np.array([-10.0, -0.5, 1.0, 1.0], np.float32)
    opt.step({"w": grad})
    ref.step({"w": grad})
    np.testing.assert_allclose(opt.params["w"], ref.params["w"], rtol=1e-6)
