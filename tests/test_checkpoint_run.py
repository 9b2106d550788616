"""One checkpoint for several optimizers (``flatopt.save(path, {"muon": m, "adamw": a})``):
saved whole or not at all, loaded in one commit, refused when damaged (shown member by member
by the CLI: tests/test_cli.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import flatopt
from flatopt.checkpoint import files, run
from checkpoint_helpers import same_snapshot, snapshot, state_equal


def build(seed: int = 0, steps: int = 3):
    """Muon for the matrices, AdamW for the rest, a scheduler each, an EMA of AdamW and a
    GradScaler, trained ``steps`` steps."""
    rng = np.random.default_rng(seed)
    muon = flatopt.Muon({"w1": rng.standard_normal((8, 6)).astype(np.float32),
                         "w2": rng.standard_normal((6, 4)).astype(np.float32)}, lr=0.02)
    adamw = flatopt.AdamW({"b1": rng.standard_normal(6).astype(np.float32),
                           "emb": rng.standard_normal((5, 3)).astype(np.float64)}, lr=1e-2)
    kit = {"muon": muon, "adamw": adamw,
           "schedulers": {"muon": flatopt.lr_scheduler.StepLR(muon, 2, gamma=0.5),
                          "adamw": flatopt.lr_scheduler.StepLR(adamw, 3, gamma=0.5)},
           "ema": flatopt.EMA(adamw, 0.9), "scaler": flatopt.GradScaler(init_scale=4.0)}
    advance(kit, seed, steps)
    return kit


def advance(kit: dict, seed: int, steps: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    for _ in range(steps):
        for name in ("muon", "adamw"):
            opt = kit[name]
            opt.step({p: rng.standard_normal(v.shape).astype(v.dtype)
                      for p, v in opt.params.items()})
            kit["schedulers"][name].step()
        kit["ema"].update()


def optimizers(kit: dict) -> dict:
    return {"muon": kit["muon"], "adamw": kit["adamw"]}


def save(kit: dict, path, **more):
    return flatopt.save(path, optimizers(kit), schedulers=kit["schedulers"], ema=[kit["ema"]],
                        scaler=kit["scaler"], **more)


def load(kit: dict, path, **more):
    return flatopt.load(path, optimizers(kit), schedulers=kit["schedulers"], ema=kit["ema"],
                        scaler=kit["scaler"], **more)


def snapshots(kit: dict) -> dict:
    return {"opt": {n: snapshot(kit[n]) for n in ("muon", "adamw")},
            "sched": {n: s.state_dict() for n, s in kit["schedulers"].items()},
            "ema": kit["ema"].state_dict(), "scaler": kit["scaler"].state_dict()}


def unchanged(kit: dict, before: dict) -> bool:
    now = snapshots(kit)
    return (all(same_snapshot(before["opt"][n], now["opt"][n]) for n in now["opt"])
            and now["sched"] == before["sched"] and now["scaler"] == before["scaler"]
            and all(np.array_equal(before["ema"]["averages"][p], now["ema"]["averages"][p])
                    for p in now["ema"]["averages"]))


def test_a_run_resumes_exactly(tmp_path):
    kit = build()
    target = save(kit, tmp_path / "run", metadata={"epoch": 3},
                  arrays={"loader": {"order": np.arange(4)}})
    assert sorted(os.listdir(target))[-1] == run.RUN_FILE
    other = build(seed=5, steps=1)
    results = load(other, target)
    assert results["muon"].metadata == {"epoch": 3}
    assert np.array_equal(results["muon"].arrays["loader"]["order"], np.arange(4))
    assert results["adamw"].arrays == {}
    for name in ("muon", "adamw"):
        assert state_equal(kit[name], other[name])
        assert other["schedulers"][name].state_dict() == kit["schedulers"][name].state_dict()
    advance(kit, 9, 2)
    advance(other, 9, 2)
    for name in ("muon", "adamw"):
        assert state_equal(kit[name], other[name])
    assert all(np.array_equal(kit["ema"].params[p], other["ema"].params[p])
               for p in kit["ema"].params)
    data = flatopt.read(target)
    assert list(data) == ["muon", "adamw"] and data["adamw"].optimizer == "AdamW"


def test_a_member_that_does_not_match_changes_no_optimizer(tmp_path):
    kit = build()
    save(kit, tmp_path / "run")
    other = build(seed=5, steps=1)
    other["adamw"].param_groups[0]["eps"] = 0.5   # a differing hyperparameter, second member
    before = snapshots(other)
    with pytest.raises(flatopt.CheckpointMismatch, match="optimizer 'adamw'") as info:
        load(other, tmp_path / "run")
    assert info.value.differences   # the member's differences are kept
    assert unchanged(other, before)


def test_a_failure_in_the_last_commit_puts_every_optimizer_back(tmp_path, monkeypatch):
    kit = build()
    save(kit, tmp_path / "run")
    other = build(seed=5, steps=1)
    before = snapshots(other)

    def broken(state):
        raise ValueError("refused")
    monkeypatch.setattr(other["scaler"], "load_state_dict", broken)
    with pytest.raises(flatopt.CheckpointError, match="GradScaler.load_state_dict"):
        load(other, tmp_path / "run")
    assert unchanged(other, before)


def test_names_must_match_unless_not_strict(tmp_path):
    kit = build()
    save(kit, tmp_path / "run")
    other = build(seed=5, steps=1)
    with pytest.raises(flatopt.CheckpointMismatch, match="were not given"):
        flatopt.load(tmp_path / "run", {"muon": other["muon"]})
    with pytest.raises(flatopt.CheckpointMismatch, match="none named"):
        flatopt.load(tmp_path / "run", {"muon": other["muon"], "sgd": other["adamw"]})
    flatopt.load(tmp_path / "run", {"muon": other["muon"]}, strict=False,
                 schedulers={"muon": other["schedulers"]["muon"]})
    assert state_equal(kit["muon"], other["muon"])
    with pytest.raises(flatopt.CheckpointMismatch, match="is a run of the optimizers"):
        flatopt.load(tmp_path / "run", other["muon"])
    flatopt.save(tmp_path / "one.h5", kit["muon"])
    with pytest.raises(flatopt.CheckpointMismatch, match="holds one optimizer"):
        flatopt.load(tmp_path / "one.h5", {"muon": other["muon"]})


def test_a_refused_save_leaves_the_previous_run(tmp_path):
    kit = build()
    target = save(kit, tmp_path / "run")
    listing = sorted(os.listdir(target))
    committed = (tmp_path / "run" / run.RUN_FILE).read_bytes()
    stranger = flatopt.EMA(build(seed=2)["adamw"])
    with pytest.raises(flatopt.CheckpointOptionError, match="EMAs of the optimizers given"):
        flatopt.save(target, optimizers(kit), ema=stranger)
    with pytest.raises(flatopt.CheckpointError, match="optimizer 'muon'.*metadata"):
        flatopt.save(target, optimizers(kit), metadata={"x": object()})
    with pytest.raises(flatopt.CheckpointOptionError, match="same optimizer"):
        flatopt.save(target, {"a": kit["muon"], "b": kit["muon"]})
    with pytest.raises(flatopt.CheckpointOptionError, match="schedulers="):
        flatopt.save(target, optimizers(kit), scheduler=kit["schedulers"]["muon"])
    (tmp_path / "file").write_bytes(b"kept")
    with pytest.raises(flatopt.CheckpointError, match="it is a file"):
        save(kit, tmp_path / "file")
    assert (tmp_path / "file").read_bytes() == b"kept"
    assert sorted(os.listdir(target)) == listing
    assert (tmp_path / "run" / run.RUN_FILE).read_bytes() == committed


def test_a_save_that_dies_before_its_commit_leaves_the_previous_run(tmp_path, monkeypatch):
    kit = build()
    target = save(kit, tmp_path / "run")
    first = sorted(os.listdir(target))
    real = files.replace_atomically

    def dies_at_commit(final, write):
        if final.endswith(run.RUN_FILE):
            raise KeyboardInterrupt   # killed between the member files and the commit
        real(final, write)
    monkeypatch.setattr(files, "replace_atomically", dies_at_commit)
    advance(kit, 3, 1)
    with pytest.raises(KeyboardInterrupt):
        save(kit, target)
    monkeypatch.undo()
    assert len(os.listdir(target)) == len(first) + 2   # the dead save's members
    other = build(seed=5, steps=1)
    load(other, target)   # the previous run, whole
    again = build(seed=5, steps=1)
    save(again, target)
    assert len(os.listdir(target)) == len(first)      # the next commit removed them


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["members"][0].update(file="../escape.0.h5"), "names the file"),
    (lambda c: c.update(save_id="0" * 16), "digest does not match"),
    (lambda c: c.update(format="other"), "format is 'other'"),
])
def test_a_damaged_commit_file_is_refused(tmp_path, edit, match):
    kit = build()
    target = save(kit, tmp_path / "run")
    path = tmp_path / "run" / run.RUN_FILE
    content = json.loads(path.read_text())
    edit(content)
    if "escape" in json.dumps(content):
        content["digest"] = run._digest(content)   # sealed: the name alone must be refused
    path.write_text(json.dumps(content))
    other = build(seed=5, steps=1)
    before = snapshots(other)
    with pytest.raises(flatopt.CheckpointCorrupt, match=match):
        load(other, target)
    assert unchanged(other, before)


def test_a_member_file_of_another_save_is_refused(tmp_path):
    kit = build()
    a = save(kit, tmp_path / "a")
    advance(kit, 4, 1)
    b = save(kit, tmp_path / "b")
    [member_a] = [e["file"] for e in run.read_run(a)["members"] if e["name"] == "adamw"]
    [member_b] = [e["file"] for e in run.read_run(b)["members"] if e["name"] == "adamw"]
    os.replace(os.path.join(b, member_b), os.path.join(a, member_a))
    with pytest.raises(flatopt.CheckpointCorrupt, match="not the file its run committed"):
        load(build(seed=5, steps=1), a)


# ----------------------------------------------------------------------------- concurrency
def resumed(loaded: dict, saved: dict) -> bool:
    return all(state_equal(saved[n], loaded[n]) and loaded["schedulers"][n].state_dict()
               == saved["schedulers"][n].state_dict() for n in ("muon", "adamw"))


def test_a_save_never_removes_the_members_of_a_save_still_writing(tmp_path, monkeypatch):
    """Save B pauses between its members; save A, of other optimizers, runs meanwhile. Before
    the directory lock A's clean-up removed B's first member and B then committed a run
    naming it: nothing loadable was left."""
    import threading
    a, b = build(seed=1), build(seed=2)
    target = str(tmp_path / "run")
    written = threading.Event()
    go_on = threading.Event()
    real = run._write_member

    def slow_for_b(final, member, name, snapshot):
        entry = real(final, member, name, snapshot)
        if threading.current_thread().name == "B" and member.endswith(".0.h5"):
            written.set()
            go_on.wait(timeout=30)
        return entry
    monkeypatch.setattr(run, "_write_member", slow_for_b)
    errors = []

    def saving(kit):
        try:
            save(kit, target)
        except Exception as exc:  # pragma: no cover - what the test is about
            errors.append(exc)
    tb = threading.Thread(target=saving, args=(b,), name="B")
    tb.start()
    assert written.wait(timeout=60)
    ta = threading.Thread(target=saving, args=(a,), name="A")
    ta.start()
    ta.join(timeout=3)   # A waits for B's lock now; before, it finished here
    go_on.set()
    tb.join(timeout=60)
    ta.join(timeout=60)
    assert not errors and not ta.is_alive() and not tb.is_alive()
    fresh = build(seed=9, steps=1)
    load(fresh, target)
    assert resumed(fresh, a)   # A committed last: it waited for B
    assert sorted(e for e in os.listdir(target) if e.endswith(".h5")) == \
        sorted(m["file"] for m in run.read_run(target)["members"])


def test_a_save_removes_what_killed_saves_left(tmp_path):
    """A run save killed while writing a member leaves ``.<save_id>.<k>.h5.<pid>.<rand>.tmp``
    (and maybe whole members of a save that never committed); every save has a new id, so the
    per-name clean-up of single files never matched them. The next save removes them all,
    whatever the pid (with the directory locked, no other save of it is writing)."""
    import subprocess
    kit = build()
    target = save(kit, tmp_path / "run")
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftovers = [f".{'ab' * 8}.0.h5.{dead.pid}.abcd1234.tmp",
                 f".{'cd' * 8}.1.h5.{os.getpid()}.x_y12345.tmp",
                 f"{'ef' * 8}.0.h5"]
    for entry in leftovers:
        with open(os.path.join(target, entry), "wb") as f:
            f.write(b"\0" * 4096)
    kept = ["notes.txt", ".ab.0.h5.tmp"]   # a user's files, not named as flatopt names them
    for entry in kept:
        with open(os.path.join(target, entry), "wb") as f:
            f.write(b"mine")
    advance(kit, 1, 1)
    save(kit, target)
    left = set(os.listdir(target))
    assert not left & set(leftovers)
    assert set(kept) <= left
    fresh = build(seed=9, steps=1)
    load(fresh, target)
    assert resumed(fresh, kit)


def test_the_lock_file_is_never_followed(tmp_path):
    """A symlink planted where the save lock lives is refused, not followed (nothing outside
    the directory is created or locked), and the previous run stays."""
    kit = build()
    target = save(kit, tmp_path / "run")
    lock = os.path.join(target, run.LOCK_FILE)
    os.unlink(lock)
    outside = tmp_path / "outside"
    os.symlink(outside, lock)
    before = run.read_run(target)
    advance(kit, 1, 1)
    with pytest.raises(flatopt.CheckpointError, match="lock"):
        save(kit, target)
    assert not outside.exists()
    assert run.read_run(target) == before


def test_locks_are_taken_in_one_order_whatever_the_dict_order(tmp_path):
    """Two threads saving (or loading) runs of the same optimizers named in different orders
    deadlocked: each took the first optimizer's lock and waited for the other's."""
    kit = build()
    order = []

    class Recording:
        def __init__(self, name, lock):
            self.name, self.lock = name, lock

        def __enter__(self):
            order.append(self.name)
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)
    for name in ("muon", "adamw"):
        kit[name].lock = Recording(name, kit[name].lock)
    flatopt.save(tmp_path / "ab", {"muon": kit["muon"], "adamw": kit["adamw"]})
    first = list(order)
    order.clear()
    flatopt.save(tmp_path / "ba", {"adamw": kit["adamw"], "muon": kit["muon"]})
    assert order[:2] == first[:2]
    order.clear()
    flatopt.load(tmp_path / "ab", {"adamw": kit["adamw"], "muon": kit["muon"]})
    assert order[:2] == first[:2]


def test_threads_saving_runs_in_both_orders_finish(tmp_path):
    import threading
    kit = build()
    a, b = kit["muon"], kit["adamw"]

    def saving(members, where):
        for _ in range(15):
            flatopt.save(where, members)
            flatopt.load(where, members)
    threads = [threading.Thread(target=saving, args=({"a": a, "b": b}, tmp_path / "x")),
               threading.Thread(target=saving, args=({"b": b, "a": a}, tmp_path / "y"))]
    for t in threads:
        t.daemon = True
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock"


def test_a_load_during_a_newer_commit_reads_the_newer_run(tmp_path, monkeypatch):
    """A load that read run.json of save S1, while another process commits S2 and removes
    S1's members, found a member missing ('does not exist' or 'damaged'): it must read S2."""
    first, second = build(seed=1), build(seed=2)
    target = save(first, tmp_path / "run")
    real = run.parse
    calls = []

    def with_a_commit_in_between(member):
        if not calls:
            calls.append(member)
            save(second, target)   # commits and removes the members this load read of
        return real(member)
    monkeypatch.setattr(run, "parse", with_a_commit_in_between)
    fresh = build(seed=9, steps=1)
    load(fresh, target)
    assert calls and not os.path.exists(calls[0])
    assert resumed(fresh, second)
