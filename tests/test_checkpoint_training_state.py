"""A run's whole training state in one checkpoint: nested extra arrays (format version 4),
``save(ema=, scaler=)`` / ``load(ema=, scaler=)`` restored in the load's one commit."""

from __future__ import annotations

import numpy as np
import pytest

import flatopt
from flatopt.checkpoint import writer as writer_mod
from checkpoint_helpers import make_opt, same_snapshot, snapshot, state_equal, step_with_grads


def trained(seed: int = 0):
    """An optimizer with an EMA and a GradScaler that have seen a few steps (one skipped)."""
    opt = make_opt("Adam", seed=seed)
    ema = flatopt.EMA(opt, 0.9, warmup=True)
    scaler = flatopt.GradScaler(init_scale=8.0, growth_interval=2)
    for t in range(4):
        grads = {p: np.full(v.shape, np.inf if t == 1 else t + 1.0, v.dtype)
                 for p, v in opt.params.items()}
        scaler.step(opt, grads)
        scaler.update()
        ema.update()
    return opt, ema, scaler


def fresh(seed: int = 7):
    opt = make_opt("Adam", seed=seed, steps=0)
    return opt, flatopt.EMA(opt, 0.5), flatopt.GradScaler(init_scale=2.0)


def same_ema(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return ({k: sa[k] for k in ("decay", "warmup", "num_updates")}
            == {k: sb[k] for k in ("decay", "warmup", "num_updates")}
            and sa["averages"].keys() == sb["averages"].keys()
            and all(np.array_equal(sa["averages"][p], sb["averages"][p]) for p in sa["averages"]))


def test_nested_arrays_come_back_nested_and_only_they_need_version_4(tmp_path):
    opt = make_opt("Adam")
    nested = {"loader": {"epoch": np.array(3), "order": np.arange(5)},
              "bn": {"layer 1": {"mean": np.ones(2, np.float32), "var/x": None}}}
    with pytest.raises(flatopt.CheckpointError, match="'/'") as info:
        flatopt.save(tmp_path / "bad.h5", opt, arrays=nested)   # a key holding '/': refused
    assert not (tmp_path / "bad.h5").exists()
    assert "nest dicts" in str(info.value)
    del nested["bn"]["layer 1"]["var/x"]
    flatopt.save(tmp_path / "ck.h5", opt, arrays=nested)
    result = flatopt.load(tmp_path / "ck.h5", make_opt("Adam", seed=3, steps=0))
    assert result.info["format_version"] == 4
    assert list(result.arrays) == ["loader", "bn"]
    assert np.array_equal(result.arrays["loader"]["order"], np.arange(5))
    assert result.arrays["bn"]["layer 1"]["mean"].dtype == np.float32
    assert flatopt.read(tmp_path / "ck.h5").arrays["loader"]["epoch"] == 3
    flatopt.save(tmp_path / "flat.h5", opt, arrays={"x": np.ones(1)})   # older readers read it
    assert flatopt.read(tmp_path / "flat.h5").info["format_version"] == 2


@pytest.mark.parametrize("arrays, match", [
    ({"flatopt:ema": np.zeros(1)}, "flatopt's own"),
    ({"a": {}}, "empty dict"),
    ({"a": {"b": object()}}, "not a NumPy array"),
])
def test_save_refuses_bad_nested_arrays_before_touching_the_target(tmp_path, arrays, match):
    opt = make_opt("Adam")
    target = tmp_path / "ck.h5"
    target.write_bytes(b"previous")
    with pytest.raises(flatopt.CheckpointError, match=match):
        flatopt.save(target, opt, arrays=arrays)
    assert target.read_bytes() == b"previous"


def test_a_name_that_is_also_a_dict_is_refused_as_damaged(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "checked_arrays", lambda arrays, own: dict(arrays))
    flatopt.save(tmp_path / "ck.h5", make_opt("Adam"),
                 arrays={"a": np.zeros(1), "a/b": np.zeros(1)})
    other = make_opt("Adam", seed=9, steps=0)
    before = snapshot(other)
    with pytest.raises(flatopt.CheckpointCorrupt, match="also a dict"):
        flatopt.load(tmp_path / "ck.h5", other)
    assert same_snapshot(before, snapshot(other))


def test_ema_and_scaler_resume_exactly(tmp_path):
    opt, ema, scaler = trained()
    flatopt.save(tmp_path / "ck.h5", opt, ema=ema, scaler=scaler)
    opt2, ema2, scaler2 = fresh()
    result = flatopt.load(tmp_path / "ck.h5", opt2, ema=ema2, scaler=scaler2)
    assert result.arrays == {}                    # flatopt's own state is not the user's
    assert same_ema(ema, ema2) and scaler2.state_dict() == scaler.state_dict()
    for o, e, s in ((opt, ema, scaler), (opt2, ema2, scaler2)):   # both continue alike
        step_with_grads(o, 5, 2)
        s.step(o, {p: np.ones(v.shape, v.dtype) for p, v in o.params.items()})
        s.update()
        e.update()
    assert same_snapshot(snapshot(opt), snapshot(opt2))
    assert same_ema(ema, ema2) and scaler2.state_dict() == scaler.state_dict()


def test_ema_averages_follow_renamed_parameters(tmp_path):
    opt, ema, _ = trained()
    flatopt.save(tmp_path / "ck.h5", opt, ema=ema)
    opt2, ema2, _ = fresh()
    first, second = "mix.weight", "dec.weight"        # same shape, dtype and group
    rename = {first: second, second: first}
    flatopt.load(tmp_path / "ck.h5", opt2, ema=ema2, rename=rename)
    assert np.array_equal(ema2.params[second], ema.params[first])
    assert np.array_equal(ema2.params[first], ema.params[second])


def test_loading_what_the_file_lacks_is_a_mismatch_unless_not_strict(tmp_path):
    opt, ema, scaler = trained()
    flatopt.save(tmp_path / "ck.h5", opt)
    opt2, ema2, scaler2 = fresh()
    before, ema_before = snapshot(opt2), ema2.state_dict()
    with pytest.raises(flatopt.CheckpointMismatch, match="holds no EMA state"):
        flatopt.load(tmp_path / "ck.h5", opt2, ema=ema2)
    with pytest.raises(flatopt.CheckpointMismatch, match="holds no GradScaler state"):
        flatopt.load(tmp_path / "ck.h5", opt2, scaler=scaler2)
    assert same_snapshot(before, snapshot(opt2))
    flatopt.load(tmp_path / "ck.h5", opt2, ema=ema2, scaler=scaler2, strict=False)
    assert state_equal(opt, opt2)
    assert ema2.state_dict()["decay"] == ema_before["decay"]   # kept its own
    assert scaler2.get_scale() == 2.0


def test_save_refuses_an_ema_of_another_optimizer(tmp_path):
    opt, _, _ = trained()
    other, other_ema, _ = fresh()
    with pytest.raises(flatopt.CheckpointOptionError, match="EMA of the optimizer being saved"):
        flatopt.save(tmp_path / "ck.h5", opt, ema=other_ema)
    with pytest.raises(flatopt.CheckpointOptionError, match="GradScaler"):
        flatopt.save(tmp_path / "ck.h5", opt, scaler=object())
    assert not (tmp_path / "ck.h5").exists()


def test_load_refuses_what_save_refuses_before_anything_changes(tmp_path):
    """An EMA (or Lookahead) of another optimizer with the same paths and shapes loaded
    without complaint, although save refuses it."""
    opt, ema, _ = trained()
    path = flatopt.save(tmp_path / "ck.h5", opt, ema=ema, lookahead=flatopt.Lookahead(opt))
    target, target_ema, _ = fresh()
    other, other_ema, _ = fresh(seed=9)  # the same paths, shapes and dtypes as target
    before, ema_before = snapshot(target), other_ema.state_dict()
    for options, match in ((dict(ema=other_ema), "EMA of the optimizer being loaded"),
                           (dict(scaler=object()), "GradScaler"),
                           (dict(lookahead=flatopt.Lookahead(other)),
                            "Lookahead over the optimizer being loaded")):
        with pytest.raises(flatopt.CheckpointOptionError, match=match):
            flatopt.load(path, target, **options)
    assert same_snapshot(before, snapshot(target))
    assert other_ema.state_dict()["num_updates"] == ema_before["num_updates"]
    assert all(np.array_equal(other_ema.params[p], ema_before["averages"][p])
               for p in other_ema.params)
    flatopt.load(path, target, ema=target_ema)  # its own EMA loads
    assert same_ema(ema, target_ema)


def test_a_failing_last_restore_undoes_the_optimizer_scheduler_and_ema(tmp_path, monkeypatch):
    opt, ema, scaler = trained()
    scheduler = flatopt.lr_scheduler.StepLR(opt, step_size=2)
    scheduler.step()
    flatopt.save(tmp_path / "ck.h5", opt, scheduler=scheduler, ema=ema, scaler=scaler)
    opt2, ema2, scaler2 = fresh()
    scheduler2 = flatopt.lr_scheduler.StepLR(opt2, step_size=5)
    before, ema_before, sched_before = snapshot(opt2), ema2.state_dict(), scheduler2.state_dict()

    def broken(state):
        raise ValueError("no")
    monkeypatch.setattr(scaler2, "load_state_dict", broken)
    with pytest.raises(flatopt.CheckpointError, match="GradScaler.load_state_dict"):
        flatopt.load(tmp_path / "ck.h5", opt2, scheduler=scheduler2, ema=ema2, scaler=scaler2)
    assert same_snapshot(before, snapshot(opt2))
    assert scheduler2.state_dict() == sched_before
    assert ema2.state_dict()["decay"] == ema_before["decay"]
    assert all(np.array_equal(ema2.params[p], ema_before["averages"][p]) for p in ema2.params)


def test_background_saves_take_ema_and_scaler(tmp_path):
    opt, ema, scaler = trained()
    flatopt.save(tmp_path / "ck.h5", opt, ema=ema, scaler=scaler, background=True).wait()
    opt2, ema2, scaler2 = fresh()
    flatopt.load(tmp_path / "ck.h5", opt2, ema=ema2, scaler=scaler2)
    assert same_ema(ema, ema2) and scaler2.state_dict() == scaler.state_dict()


# ----------------------------------------------------------------------------- found by the state machine
@pytest.mark.parametrize("what", ["ema", "scheduler"])
def test_an_ema_or_scheduler_made_before_a_group_was_added_is_refused_by_save(tmp_path, what):
    """Found by tests/test_state_machine.py: after ``add_param_group`` an EMA (or scheduler)
    made before it covers fewer groups; save wrote the scheduler (then load refused the file)
    and failed on the EMA with a bare KeyError. Save now refuses both, as their update and
    step do, before the target is touched."""
    opt = flatopt.AdamW({"w": np.ones(3, np.float32)}, lr=0.1)
    more = {"ema": flatopt.EMA(opt, 0.9)} if what == "ema" else \
        {"scheduler": flatopt.lr_scheduler.StepLR(opt, 2)}
    target = tmp_path / "ck.h5"
    flatopt.save(target, opt, **more)
    before = target.read_bytes()
    opt.add_param_group({"params": {"v": np.ones(2, np.float32)}})
    with pytest.raises(flatopt.CheckpointOptionError, match=f"{what}=: .*(group|groups)"):
        flatopt.save(target, opt, **more)
    assert target.read_bytes() == before
    with pytest.raises(flatopt.HyperparameterError):
        (more["ema"].state_dict() if what == "ema" else more["scheduler"].state_dict())


def test_a_grad_scaler_steps_a_lookahead():
    """torch's GradScaler steps any optimizer, timm's Lookahead included; flatopt's refused a
    Lookahead with a bare TypeError (found by tests/test_state_machine.py)."""
    def kit():
        opt = flatopt.SGD({"w": np.ones(4, np.float32)}, lr=0.1, momentum=0.9)
        return opt, flatopt.Lookahead(opt, k=2)
    (a, la), (b, lb) = kit(), kit()
    scaler = flatopt.GradScaler(init_scale=8.0)
    for step in range(4):
        g = np.full(4, step + 1.0, np.float32)
        scaler.step(la, {"w": g * 8.0})
        scaler.update()
        lb.step({"w": g})
    assert a.params["w"].tobytes() == b.params["w"].tobytes()
    assert la.state_dict()["steps"] == lb.state_dict()["steps"] == [4]
