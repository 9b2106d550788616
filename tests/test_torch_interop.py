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
