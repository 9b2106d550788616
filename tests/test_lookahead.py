"""Lookahead: timm's semantics (its Lookahead ported verbatim over torch.optim as the oracle),
the fused sync, saving and resuming with the optimizer."""

from __future__ import annotations

from collections import defaultdict

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flatopt
from flatopt.kernels import threads

torch = pytest.importorskip("torch")


class TimmLookahead:
    """timm.optim.Lookahead (timm 1.0), its step, update_slow and sync_lookahead as written
    there, over a torch.optim optimizer (timm pulls torchvision, so it is ported here)."""

    def __init__(self, base_optimizer, alpha=0.5, k=6):
        self._base_optimizer = base_optimizer
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self.state = defaultdict(dict)
        for name, default in defaults.items():
            for group in self._base_optimizer.param_groups:
                group.setdefault(name, default)

    @torch.no_grad()
    def update_slow(self, group):
        for fast_p in group["params"]:
            if fast_p.grad is None:
                continue
            param_state = self._base_optimizer.state[fast_p]
            if "lookahead_slow_buff" not in param_state:
                param_state["lookahead_slow_buff"] = torch.empty_like(fast_p)
                param_state["lookahead_slow_buff"].copy_(fast_p)
            slow = param_state["lookahead_slow_buff"]
            slow.add_(fast_p - slow, alpha=group["lookahead_alpha"])
            fast_p.copy_(slow)

    def sync_lookahead(self):
        for group in self._base_optimizer.param_groups:
            self.update_slow(group)

    @torch.no_grad()
    def step(self):
        self._base_optimizer.step()
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)


BASES = {"SGD": dict(lr=0.05, momentum=0.9), "AdamW": dict(lr=0.01, weight_decay=0.1)}


def groups_of(dtype, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"w": rng.standard_normal((5, 7)).astype(dtype),
             "b": rng.standard_normal(7).astype(dtype)},
            {"e": rng.standard_normal((3, 4)).astype(dtype), "s": np.array(0.5, dtype)}]


def pair(base: str, dtype, seed: int, alpha: float, k: int):
    groups = groups_of(dtype, seed)
    opt = getattr(flatopt, base)([{"params": g} for g in groups], **BASES[base])
    la = flatopt.Lookahead(opt, alpha=alpha, k=k)
    tensors = {p: torch.tensor(a.copy()) for g in groups for p, a in g.items()}
    torch_opt = getattr(torch.optim, base)(
        [{"params": [tensors[p] for p in g]} for g in groups], foreach=False, **BASES[base])
    return la, TimmLookahead(torch_opt, alpha=alpha, k=k), tensors


def step_both(la, ref, tensors, rng, missing: float = 0.25) -> None:
    grads = {}
    for path, t in tensors.items():
        if rng.random() < missing:
            t.grad = None          # timm skips a parameter without a gradient at a sync too
            continue
        g = rng.standard_normal(t.shape).astype(la.params[path].dtype)
        grads[path] = g
        t.grad = torch.tensor(g)
    la.zero_grad()
    la.step(grads)
    ref.step()


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("alpha, k", [(0.5, 1), (0.5, 3), (0.8, 2), (0.0, 2), (1.0, 4)])
def test_steps_equal_timms_lookahead(base, dtype, alpha, k):
    rng = np.random.default_rng([k, int(alpha * 10), int(dtype == np.float64)])
    la, ref, tensors = pair(base, dtype, 0, alpha, k)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-5, atol=1e-6)
    for step in range(13):
        step_both(la, ref, tensors, rng)
        if step == 7:
            la.sync_lookahead()
            ref.sync_lookahead()
        for path, t in tensors.items():
            np.testing.assert_allclose(la.params[path], t.numpy(), **tol,
                                       err_msg=f"{path} step {step}")
            state = ref._base_optimizer.state[t]
            assert ("lookahead_slow_buff" in state) == (path in la.state_dict()["slow"])
            if "lookahead_slow_buff" in state:
                np.testing.assert_allclose(la.slow[path], state["lookahead_slow_buff"].numpy(),
                                           **tol)
    assert la.steps == [13, 13]


def test_the_sync_is_the_same_at_one_thread_and_many(monkeypatch):
    runs = []
    for policy in ("never", "always"):
        monkeypatch.setattr(threads, "PARALLEL_MIN_ELEMENTS", 0)
        monkeypatch.setattr(threads, "_policy", policy)
        rng = np.random.default_rng(3)
        opt = flatopt.SGD({"w": np.zeros(70_000, np.float32)}, lr=0.1, momentum=0.9)
        la = flatopt.Lookahead(opt, alpha=0.3, k=2)
        for _ in range(6):
            la.step({"w": rng.standard_normal(70_000).astype(np.float32)})
        runs.append((opt.params["w"].copy(), la.slow["w"].copy()))
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_a_skipped_step_does_not_count():
    opt = flatopt.SGD({"w": np.ones(3, np.float32)}, lr=0.1)
    la = flatopt.Lookahead(opt, k=2)
    la.step({"w": np.ones(3, np.float32)})
    result = la.step({"w": np.full(3, np.nan, np.float32)}, skip_nonfinite=True)
    assert result.skipped and la.steps == [1]
    la.step({"w": np.ones(3, np.float32)})
    assert la.steps == [2] and "w" in la.state_dict()["slow"]


def trained(seed: int = 0, steps: int = 5):
    la, _, _ = pair("AdamW", np.float32, seed, 0.5, 2)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        la.step({p: rng.standard_normal(v.shape).astype(v.dtype)
                 for p, v in la.params.items() if rng.random() < 0.8})
    return la


def same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return (sa["steps"] == sb["steps"] and sa["slow"].keys() == sb["slow"].keys()
            and all(np.array_equal(sa["slow"][p], sb["slow"][p]) for p in sa["slow"])
            and all(np.array_equal(a.params[p], b.params[p]) for p in a.params))


@pytest.mark.parametrize("how", ["wrapper", "keyword", "run"])
def test_it_resumes_exactly_from_a_checkpoint(tmp_path, how):
    la = trained()
    other = trained(seed=9, steps=1)
    if how == "wrapper":
        flatopt.save(tmp_path / "ck.h5", la)
        flatopt.load(tmp_path / "ck.h5", other)
    elif how == "keyword":
        flatopt.save(tmp_path / "ck.h5", la.optimizer, lookahead=la)
        flatopt.load(tmp_path / "ck.h5", other.optimizer, lookahead=other)
    else:
        flatopt.save(tmp_path / "run", {"main": la})
        flatopt.load(tmp_path / "run", {"main": other})
    assert same(la, other)
    for item in (la, other):
        rng = np.random.default_rng(42)
        for _ in range(3):
            item.step({p: rng.standard_normal(v.shape).astype(v.dtype)
                       for p, v in item.params.items()})
    assert same(la, other)


def test_a_file_without_lookahead_state_is_a_mismatch_unless_not_strict(tmp_path):
    la = trained()
    flatopt.save(tmp_path / "ck.h5", la.optimizer)
    other = trained(seed=9, steps=1)
    before = other.state_dict()
    with pytest.raises(flatopt.CheckpointMismatch, match="holds no Lookahead state"):
        flatopt.load(tmp_path / "ck.h5", other)
    assert other.state_dict()["steps"] == before["steps"]
    flatopt.load(tmp_path / "ck.h5", other, strict=False)
    assert other.state_dict()["steps"] == before["steps"]   # kept its own


def test_state_dict_round_trip_and_checks():
    la = trained()
    other = trained(seed=9, steps=1)
    other.load_state_dict(la.state_dict())
    assert other.state_dict()["steps"] == la.state_dict()["steps"]
    bad = la.state_dict()
    bad["slow"] = {"w": np.zeros(2, np.float32)}
    before = other.state_dict()
    with pytest.raises(flatopt.StateDictError, match="'w'"):
        other.load_state_dict(bad)
    assert other.state_dict()["steps"] == before["steps"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(alpha=1.5), "alpha"), (dict(alpha=True), "alpha"), (dict(k=0), "k"),
    (dict(k=2.0), "k")])
def test_bad_settings_are_typed_errors(kwargs, match):
    opt = flatopt.SGD({"w": np.ones(3, np.float32)}, lr=0.1)
    with pytest.raises(flatopt.HyperparameterError, match=match):
        flatopt.Lookahead(opt, **kwargs)
    with pytest.raises(flatopt.HyperparameterError, match="flatopt optimizer"):
        flatopt.Lookahead(object())


def test_a_group_added_later_gets_its_own_count():
    opt = flatopt.SGD({"w": np.ones(3, np.float32)}, lr=0.1)
    la = flatopt.Lookahead(opt, k=2)
    la.step({"w": np.ones(3, np.float32)})
    opt.add_param_group({"params": {"v": np.ones(2, np.float32)}})
    la.step({"w": np.ones(3, np.float32), "v": np.ones(2, np.float32)})
    assert la.steps == [2, 1]
    assert "w" in la.state_dict()["slow"] and "v" not in la.state_dict()["slow"]


REDUCED_GROUPS = {
    "bfloat16 params": lambda: {"params": {"v": np.ones(3, ml_dtypes.bfloat16)}},
    "float16 params, master weights": lambda: {"params": {"v": np.ones(3, np.float16)},
                                               "master_weights": True},
    "bfloat16 state": lambda: {"params": {"v": np.ones(300, np.float32)},
                               "state_dtype": "bfloat16"},
    "int8 state": lambda: {"params": {"v": np.ones(4096, np.float32)}, "state_dtype": "int8"},
}


@pytest.mark.parametrize("group", REDUCED_GROUPS, ids=list(REDUCED_GROUPS))
def test_a_reduced_precision_group_added_later_is_refused_before_anything_changes(group):
    """Lookahead refuses reduced-precision optimizers at construction; such a group added
    later was accepted, and every sync after it died in Numba (once the step was taken and
    the counts advanced)."""
    opt = flatopt.AdamW({"w": np.ones(3, np.float32)}, lr=0.1)
    la = flatopt.Lookahead(opt, k=1)
    la.step({"w": np.full(3, 0.5, np.float32)})
    la.step({"w": np.full(3, 0.5, np.float32)})
    before = la.state_dict(), opt.state_dict(), opt.params["w"].copy()
    with pytest.raises(flatopt.HyperparameterError,
                       match=r"param group 1: 'v' is stored in reduced precision .*nothing was "
                             r"added"):
        opt.add_param_group(REDUCED_GROUPS[group]())
    assert len(opt.param_groups) == 1 and "v" not in opt.index and len(opt.buffers) == 1
    after = la.state_dict(), opt.state_dict(), opt.params["w"]
    assert after[0]["steps"] == before[0]["steps"] == [2]
    assert np.array_equal(after[0]["slow"]["w"], before[0]["slow"]["w"])
    assert after[1]["state"]["w"]["step"] == 2 and np.array_equal(after[2], before[2])
    la.step({"w": np.full(3, 0.5, np.float32)})  # the syncs go on
    assert la.steps == [3]
    opt.add_param_group({"params": {"u": np.ones(2, np.float32)}})  # a float32 one is fine
    la.step({"w": np.full(3, 0.5, np.float32), "u": np.ones(2, np.float32)})
    assert la.steps == [4, 1]


def test_reduced_precision_is_refused_at_construction_and_only_while_wrapped():
    with pytest.raises(flatopt.HyperparameterError,
                       match=r"param group 0: 'w' .*state bfloat16.*cannot be wrapped"):
        flatopt.Lookahead(flatopt.AdamW({"w": np.ones(3, np.float32)},
                                        state_dtype="bfloat16"))
    opt = flatopt.AdamW({"w": np.ones(3, np.float32)}, lr=0.1)
    la = flatopt.Lookahead(opt)
    with pytest.raises(flatopt.HyperparameterError, match="reduced precision"):
        opt.add_param_group(REDUCED_GROUPS["bfloat16 params"]())
    del la  # the optimizer alone takes any group (the Lookahead's check is held weakly)
    opt.add_param_group(REDUCED_GROUPS["bfloat16 params"]())
    assert opt.params["v"].dtype == ml_dtypes.bfloat16


@settings(max_examples=15, deadline=None)
@given(key=st.sampled_from(["k", "steps"]),
       value=st.one_of(st.integers(2 ** 63, 2 ** 80), st.integers(-2 ** 70, -1),
                       st.just(True)))
def test_counts_a_file_cannot_hold_are_refused(key, value):
    """k and the groups' step counts: at most 2**63 - 1 (what a checkpoint's int64 arrays
    hold, so that what loads also saves), refused before anything changes."""
    la = trained()
    bad = la.state_dict()
    bad[key] = value if key == "k" else [value] * len(bad["steps"])
    other = trained(seed=9, steps=1)
    before = other.state_dict()
    with pytest.raises((flatopt.StateDictError, flatopt.HyperparameterError), match=key):
        other.load_state_dict(bad)
    assert other.state_dict()["steps"] == before["steps"] and other.k == la.k
