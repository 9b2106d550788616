"""Continuing a torch.optim run with flatopt: ``opt.load_torch_state_dict(sd, names)`` for every
registered rule that torch has, then the next steps agree with torch's (bit for bit where the
rule is bit-identical to torch's single-tensor path: the facts' ``bit_exact`` in
tests/optimizers.py); and its errors."""

from __future__ import annotations

import numpy as np
import pytest

import flatopt
from flatopt import StateDictError
from optimizers import INFO, NAMES, fit_shape, random_settings, torch_group, torch_settings

torch = pytest.importorskip("torch")

TORCH_RULES = [name for name in NAMES if INFO[name].torch is not None]
SHAPES = {"enc.w": (6, 5), "enc.b": (5,), "head.w": (5, 2), "scale": ()}
# single-tensor torch is the oracle of their float32 bits (the runs here are float32)
BITS = {name for name in TORCH_RULES if (bits := INFO[name].bit_exact) is not None
        and bits.single_tensor and np.dtype(np.float32) in bits.dtypes}


def torch_run(name, groups, rng, steps):
    tensors = {path: torch.tensor(value.copy(), requires_grad=True)
               for params, _ in groups for path, value in params.items()}
    torch_opt = getattr(torch.optim, INFO[name].torch)(
        [{"params": [tensors[p] for p in params], **torch_group(name, hp)}
         for params, hp in groups],
        foreach=False)
    return tensors, torch_opt


def step_both(flat_opt, tensors, torch_opt, grads):
    for path, t in tensors.items():
        t.grad = torch.from_numpy(grads[path].copy()) if path in grads else None
    torch_opt.step()
    if flat_opt is not None:
        flat_opt.step(grads)


@pytest.mark.parametrize("name", TORCH_RULES)
def test_a_torch_run_continues_in_flatopt(name):
    rng = np.random.default_rng(7)
    shapes = {path: fit_shape(name, shape) for path, shape in SHAPES.items()}
    if INFO[name].matrices_only:  # Muon: matrices only
        shapes = {path: shape for path, shape in shapes.items() if len(shape) == 2}
    values = {path: rng.standard_normal(shape).astype(np.float32)
              for path, shape in shapes.items()}
    paths = list(values)
    groups = [({p: values[p] for p in paths[:2]},
               torch_settings(name, random_settings(name, rng))),
              ({p: values[p] for p in paths[2:]},
               torch_settings(name, random_settings(name, rng)))]
    tensors, torch_opt = torch_run(name, groups, rng, 4)

    def grads_for_step():
        return {p: rng.standard_normal(shapes[p]).astype(np.float32) for p in paths
                if rng.random() < 0.8}

    for _ in range(4):
        step_both(None, tensors, torch_opt, grads_for_step())
    # a fresh flatopt optimizer: torch's current values, the same groups, then torch's state
    current = [({p: tensors[p].detach().numpy().copy() for p in params}, hp)
               for params, hp in groups]
    opt = flatopt.registry.lookup(name)([{"params": params, **hp} for params, hp in current])
    opt.load_torch_state_dict(torch_opt.state_dict(), paths)
    for path, t in tensors.items():
        entry = torch_opt.state.get(t, {})
        ours = opt.state_of(path)
        assert (ours is None) == (len(entry) == 0), path
        if ours is not None and "step" in entry:
            assert ours.step == int(entry["step"].item())
    for step in range(4):
        step_both(opt, tensors, torch_opt, grads_for_step())
        for path, t in tensors.items():
            where = f"{name} {path} step {step}"
            if name in BITS:
                assert opt.params[path].tobytes() == t.detach().numpy().tobytes(), where
            else:
                np.testing.assert_allclose(opt.params[path], t.detach().numpy(), rtol=1e-4,
                                           atol=1e-6, err_msg=where)


def test_names_and_torch_only_settings_are_checked_before_anything_changes():
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    torch_opt = torch.optim.Adam(params, lr=0.1)
    for t in params:
        t.grad = torch.ones_like(t)
    torch_opt.step()
    saved = torch_opt.state_dict()
    opt = flatopt.Adam({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}, lr=0.5)
    with pytest.raises(StateDictError, match=r"parameter indices \[1\] have no name"):
        opt.load_torch_state_dict(saved, ["a"])
    with pytest.raises(StateDictError, match=r"names\[1\] = 'c' is not a parameter"):
        opt.load_torch_state_dict(saved, ["a", "c"])
    with pytest.raises(StateDictError, match="names must be a list of paths"):
        opt.load_torch_state_dict(saved, "a")
    saved["param_groups"][0]["capturable"] = True
    with pytest.raises(StateDictError, match="capturable=True has no meaning"):
        opt.load_torch_state_dict(saved, ["a", "b"])
    saved["param_groups"][0].update(capturable=False, decoupled_weight_decay=True)
    with pytest.raises(StateDictError, match="decoupled_weight_decay"):
        opt.load_torch_state_dict(saved, ["a", "b"])  # torch's Adam with it is AdamW
    assert opt.state_of("a") is None and opt.param_groups[0]["lr"] == 0.5
    saved["param_groups"][0]["decoupled_weight_decay"] = False
    opt.load_torch_state_dict(saved, {0: "a", 1: "b"})
    assert opt.state_of("b").step == 1 and opt.param_groups[0]["lr"] == 0.1


def test_the_readme_recipe_steps_a_torch_model_through_flat_buffers():
    """A torch CPU model whose parameters and .grad are views of flatopt's buffers: backward
    accumulates straight into the gradient buffer, step() updates what the model computes
    with, and each step equals torch's fused AdamW's on the same gradients bit for bit (the
    reference takes the model's gradients: torch's own backward may round differently for
    differently placed memory)."""
    torch.manual_seed(0)

    def make():
        # sizes that are multiples of 16: torch's fused kernel rounds the rest of a vector
        # width without fused multiply-adds (test_conformance.BIT_EXACT)
        return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 16))

    model, reference = make(), make()
    reference.load_state_dict(model.state_dict())
    opt = flatopt.AdamW({n: p.detach().numpy().copy() for n, p in model.named_parameters()},
                        lr=1e-2)
    for name, p in model.named_parameters():
        p.data = torch.from_numpy(opt.params[name])
        p.grad = torch.from_numpy(opt.grads[name])
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    x, y = torch.randn(32, 4), torch.randn(32, 16)
    for _ in range(6):
        opt.zero_grad(set_to_none=False)  # zero in place: the .grad views stay
        ((model(x) - y) ** 2).mean().backward()
        opt.grads.mark_present()
        opt.step()
        for theirs, ours in zip(reference.parameters(), model.parameters()):
            theirs.grad = ours.grad.clone()
        torch_opt.step()
    for name, p in model.named_parameters():
        assert np.shares_memory(p.grad.numpy(), opt.buffers[0].grads) or any(
            np.shares_memory(p.grad.numpy(), buf.grads) for buf in opt.buffers)
        assert torch.equal(p.detach(), dict(reference.named_parameters())[name].detach())


# ----------------------------------------------------------------------------- malformed
# Every torch state dict, however malformed (wrong types at every level, tensors of the wrong
# shape, dtype or device, arrays where numbers belong, missing and extra keys, bools, None,
# huge ints, NaN), gives StateDictError or loads; a refused one changes no bit of the
# optimizer (issue 33, item 8).

def _malformed_targets():
    """(name, flatopt optimizer factory, torch optimizer factory, paths): two groups each,
    the flatopt optimizer stepped once (its state must survive a refused load)."""
    rng = np.random.default_rng(3)
    values = {"a": rng.standard_normal(3).astype(np.float32),
              "b": rng.standard_normal((2, 2)).astype(np.float32),
              "c": rng.standard_normal(300).astype(np.float32)}
    import ml_dtypes
    torch_kinds = {"AdamW": dict(lr=0.01, weight_decay=0.1), "SGD": dict(lr=0.1, momentum=0.9)}

    def flat(kind, **storage):
        def make():
            groups = [{"params": {p: values[p].copy() for p in "ab"}},
                      {"params": {"c": values["c"].astype(ml_dtypes.bfloat16)
                                  if storage else values["c"].copy()}, **storage}]
            opt = getattr(flatopt, kind)(groups, **torch_kinds[kind])
            opt.step({p: np.full(values[p].shape, 0.5, opt.params[p].dtype) for p in "abc"})
            return opt
        return make

    def saved(kind):
        tensors = {p: torch.tensor(v, requires_grad=True) for p, v in values.items()}
        torch_opt = getattr(torch.optim, kind)(
            [{"params": [tensors["a"], tensors["b"]]}, {"params": [tensors["c"]], "lr": 0.05}],
            **torch_kinds[kind])
        for _ in range(2):
            for t in tensors.values():
                t.grad = torch.ones_like(t)
            torch_opt.step()
        return torch_opt.state_dict()
    return {"AdamW": (flat("AdamW"), saved("AdamW")), "SGD": (flat("SGD"), saved("SGD")),
            "AdamW-bf16": (flat("AdamW", master_weights=True), saved("AdamW"))}


def _bad_values():
    """Factories (fresh objects per example) of values that fit nowhere or somewhere."""
    import ml_dtypes
    return [
        lambda: None, lambda: True, lambda: False, lambda: 0, lambda: -1, lambda: 2 ** 70,
        lambda: 10 ** 400, lambda: float("nan"), lambda: float("inf"), lambda: 1.5,
        lambda: "x", lambda: b"x", lambda: [], lambda: [1, "a"], lambda: [[0], [1, 2]],
        lambda: {}, lambda: {"a": 1}, lambda: (0.9, 0.999), lambda: object(),
        lambda: np.array(3), lambda: np.float32("nan"), lambda: np.ones(2),
        lambda: np.ones((2, 3)), lambda: np.array([True]), lambda: np.zeros(3, np.int64),
        lambda: np.zeros(3), lambda: np.zeros(0), lambda: np.array(["a"]),
        lambda: np.array(1.0, ml_dtypes.bfloat16), lambda: np.bool_(True),
        lambda: torch.tensor(2.0), lambda: torch.tensor(float("nan")),
        lambda: torch.tensor(True), lambda: torch.tensor(10.0 ** 30), lambda: torch.zeros(3),
        lambda: torch.zeros(2), lambda: torch.zeros((3, 1)), lambda: torch.zeros(300),
        lambda: torch.zeros(3, dtype=torch.float64), lambda: torch.zeros(3, dtype=torch.bfloat16),
        lambda: torch.zeros(300, dtype=torch.bfloat16), lambda: torch.zeros(3, dtype=torch.int64),
        lambda: torch.zeros(3, dtype=torch.complex64), lambda: torch.zeros(3, requires_grad=True),
        lambda: torch.zeros(3).to_sparse(), lambda: torch.zeros(3, device="meta"),
        lambda: torch.full((2, 2), -1.0), lambda: torch.full((3,), float("inf")),
    ]


MALFORMED = None


def _slots(tree, where=()):
    """Every (container, key) of a torch state dict: its dicts' keys and its lists' items."""
    found = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            found.append((tree, key))
            found += _slots(value, where + (key,))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            found.append((tree, index))
            found += _slots(value, where + (index,))
    return found


def _mutable(saved):
    """A copy of a torch state dict with its tuples and tensors fresh (the load reads them;
    mutations here replace, never modify, what they reach)."""
    if isinstance(saved, dict):
        return {key: _mutable(value) for key, value in saved.items()}
    if isinstance(saved, list):
        return [_mutable(value) for value in saved]
    return saved.clone() if isinstance(saved, torch.Tensor) else saved


def _fingerprint(opt):
    """Every bit of the optimizer a load could change."""
    out = [repr(opt.param_groups)]
    for buf in opt.buffers:
        arrays = [buf.params, *buf.state.values(), *buf.absmax.values(),
                  *buf.columns.values(), buf.master, buf.compensation]
        out += [sorted(buf.state), buf.draws,
                [None if a is None else (a.dtype.str, a.tobytes()) for a in arrays]]
    return out


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover (hypothesis is in the test extra)
    given = None


@pytest.mark.skipif(given is None, reason="needs hypothesis (the test extra)")
def test_malformed_torch_state_dicts_give_state_dict_errors_and_change_nothing():
    global MALFORMED
    MALFORMED = MALFORMED or _malformed_targets()
    bad = _bad_values()

    @settings(max_examples=250, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def check(data):
        target = data.draw(st.sampled_from(sorted(MALFORMED)), "target")
        make, saved = MALFORMED[target]
        sd = _mutable(saved)
        for _ in range(data.draw(st.integers(1, 3), "mutations")):
            slots = _slots(sd)
            action = data.draw(st.sampled_from(["replace", "delete", "add", "rekey"]), "action")
            value = data.draw(st.sampled_from(bad), "value")() if data.draw(
                st.booleans(), "pool") else data.draw(
                st.one_of(st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True)), "number")
            if action == "add" or not slots:
                containers = [sd] + [c for c, k in slots if isinstance(c[k], (dict, list))]
                container = data.draw(st.sampled_from(containers), "where")
                if isinstance(container, dict):
                    container[data.draw(st.sampled_from(["zzz", 7, None, True, "lr", "step"]),
                                        "key")] = value
                else:
                    container.append(value)
                continue
            container, key = data.draw(st.sampled_from(slots), "slot")
            if action == "replace":
                container[key] = value
            elif action == "delete":
                del container[key]
            elif isinstance(container, dict):  # rekey: the same value under another key
                moved = container.pop(key)
                try:
                    container[value] = moved
                except TypeError:  # an unhashable key cannot be in a dict at all
                    container[key] = moved
        names = [["a", "b", "c"]] * 6 + [{0: "a", 1: "b", 2: "c"}, ["a", "a", "c"], ["a", "b"],
                                          [0, "b", "c"], {True: "a", 1: "b", 2: "c"}]
        names = names[data.draw(st.integers(0, len(names) - 1), "names")]
        convert = data.draw(st.booleans(), "convert")
        opt = make()
        before = _fingerprint(opt)
        try:
            opt.load_torch_state_dict(sd, names, convert=convert)
        except StateDictError as exc:
            assert str(exc)
            assert _fingerprint(opt) == before
    check()


# ----------------------------------------------------------------------------- convert=
CONVERT_SIZES = {"small": (300,), "big": (64, 80)}  # big: int8 state from 4,096 elements


def torch_state_on(kind: str, dtype, steps: int = 3):
    """A real torch.optim state after ``steps`` steps on ``dtype`` tensors: (tensors, optimizer)."""
    torch.manual_seed(5)
    tensors = {p: torch.randn(shape, dtype=dtype, requires_grad=True)
               for p, shape in CONVERT_SIZES.items()}
    options = dict(lr=0.01, weight_decay=0.1) if kind == "AdamW" else dict(lr=0.1, momentum=0.9)
    torch_opt = getattr(torch.optim, kind)(list(tensors.values()), foreach=False, **options)
    for _ in range(steps):
        for t in tensors.values():
            t.grad = torch.randn_like(t)
        torch_opt.step()
    return tensors, torch_opt, options


def as_numpy(tensor, dtype):
    return tensor.detach().float().numpy().astype(dtype)


CONVERSIONS = {  # torch dtype, torch optimizer, the flatopt parameters' dtype and storage
    "bf16 torch -> bf16 params": (torch.bfloat16, "AdamW", "bfloat16", {}),
    "bf16 torch -> bf16 state": (torch.bfloat16, "AdamW", "bfloat16",
                                 dict(state_dtype="bfloat16")),
    "bf16 torch -> kahan": (torch.bfloat16, "SGD", "bfloat16", dict(rounding="kahan")),
    "f32 torch -> master weights": (torch.float32, "AdamW", "bfloat16",
                                    dict(master_weights=True)),
    "f32 torch -> bf16 state": (torch.float32, "AdamW", "float32",
                                dict(state_dtype="bfloat16")),
    "f32 torch -> stochastic bf16 params": (torch.float32, "SGD", "bfloat16",
                                            dict(rounding="stochastic",
                                                 state_dtype="bfloat16")),
    "f32 torch -> int8 state": (torch.float32, "AdamW", "float32", dict(state_dtype="int8")),
    "f64 torch -> f32": (torch.float64, "SGD", "float32", {}),
}


@pytest.mark.parametrize("case", CONVERSIONS, ids=list(CONVERSIONS))
def test_torch_state_reaches_a_reduced_precision_optimizer_with_convert(case):
    """load_torch_state_dict into bf16 parameters or bf16/int8 state said "pass
    convert=True" but took no convert=. Now: refused by path, naming convert=, nothing
    changed; with convert=True exact where the stored format holds torch's values (float32
    state, bfloat16 from bfloat16), rounded to nearest into bfloat16 and quantized as
    bitsandbytes does into int8 (as load_state_dict and flatopt.load convert)."""
    import ml_dtypes
    torch_dtype, kind, param_dtype, storage = CONVERSIONS[case]
    tensors, torch_opt, options = torch_state_on(kind, torch_dtype)
    param_dtype = ml_dtypes.bfloat16 if param_dtype == "bfloat16" else np.float32
    values = {p: as_numpy(t, param_dtype) for p, t in tensors.items()}
    opt = getattr(flatopt, kind)(dict(values), **options, **storage)
    opt.step({p: np.full(v.shape, 0.25, v.dtype) for p, v in values.items()})  # state to keep
    before = _fingerprint(opt)
    with pytest.raises(StateDictError, match=r"'big'\).*convert=True"):
        opt.load_torch_state_dict(torch_opt.state_dict(), list(CONVERT_SIZES))
    assert _fingerprint(opt) == before
    with pytest.raises(StateDictError, match="convert must be True or False"):
        opt.load_torch_state_dict(torch_opt.state_dict(), list(CONVERT_SIZES), convert="yes")
    assert _fingerprint(opt) == before
    params = {p: opt.params[p].copy() for p in values}
    opt.load_torch_state_dict(torch_opt.state_dict(), list(CONVERT_SIZES), convert=True)
    slot = "exp_avg" if kind == "AdamW" else "momentum_buffer"
    for path, t in tensors.items():
        buf = opt.buffers[opt.index[path].buffer]
        want = torch_opt.state[t][slot].detach().double().numpy()  # torch's exact values
        got = getattr(opt.state_of(path), slot)  # float32 values, decoded
        stored = buf.storage.state if buf.storage is not None else "float32"
        if kind == "AdamW":
            assert opt.state_of(path).step == int(torch_opt.state[t]["step"])
        if stored == "int8":  # bitsandbytes' blockwise code of the float32 values
            assert buf.state[slot].dtype == np.uint8
            assert np.abs(got - want).max() <= 0.02 * np.abs(want).max(), path
        elif stored == "bfloat16":  # to nearest: the bits of torch's value rounded once
            raw = buf.state[slot][buf.offsets[opt.index[path].slot]:][:want.size]
            assert raw.view(np.uint16).tobytes() == \
                want.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).tobytes()
        else:
            assert got.tobytes() == want.astype(np.float32).tobytes(), path  # exact
        assert opt.params[path].tobytes() == params[path].tobytes()  # torch holds none
        if buf.master is not None:  # the master weights are the parameters' values
            assert buf.view(buf.master, opt.index[path].slot).tobytes() == \
                params[path].astype(np.float32).tobytes()
    if storage.get("state_dtype") == "int8":  # the same codes as load_state_dict's convert
        plain = getattr(flatopt, kind)(dict(values), **options)
        plain.load_torch_state_dict(torch_opt.state_dict(), list(CONVERT_SIZES))
        twin = getattr(flatopt, kind)(dict(values), **options, **storage)
        twin.load_state_dict(plain.state_dict(), convert=True)
        def stored(o):
            return [(name, a.tobytes()) for buf in o.buffers
                    for arrays in (buf.state, buf.absmax) for name, a in sorted(arrays.items())]
        assert stored(twin) == stored(opt)
    result = opt.step({p: np.full(v.shape, 0.5, v.dtype) for p, v in values.items()})
    assert all(np.isfinite(opt.params[p].astype(np.float32)).all() for p in values), result
