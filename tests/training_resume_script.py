"""A training loop with every tool around the step, run in two processes by
tests/test_training.py: AdamW over pattern groups, warm-up + cosine (SequentialLR), gradient
accumulation over two micro-batches (``grads.add``), dynamic loss scaling (GradScaler) with
overflows that skip steps, global-norm clipping inside the step, and an EMA of the weights.

``python training_resume_script.py first DIR`` trains SPLIT steps and saves one checkpoint
(the optimizer, the scheduler, the EMA's averages as extra arrays, the rest of the EMA's and
the scaler's state as metadata); ``resume DIR`` loads it in a fresh process, trains to TOTAL
and writes what it ended with to DIR/resumed.npz."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import flatopt

SPLIT, TOTAL = 6, 14
MICRO_BATCHES = 2
OVERFLOW_STEPS = (4, 9)      # a micro-batch holds an infinity: the step is skipped
SHAPES = {"enc.weight": (8, 6), "enc.bias": (6,), "norm.scale": (6,), "head.weight": (6, 3),
          "head.bias": (3,)}


def build():
    rng = np.random.default_rng(7)
    params = {path: rng.standard_normal(shape).astype(np.float32)
              for path, shape in SHAPES.items()}
    groups = flatopt.group_by_pattern(
        params, [{"match": ["*.bias", "norm.*"], "weight_decay": 0.0, "label": "no_decay"}],
        rest={"label": "decay"})
    opt = flatopt.AdamW(groups, lr=3e-3, weight_decay=0.1)
    lr = flatopt.lr_scheduler
    sched = lr.SequentialLR(opt, [lr.LinearLR(opt, start_factor=0.1, total_iters=3),
                                  lr.CosineAnnealingLR(opt, T_max=10, eta_min=1e-5)],
                            milestones=[3])
    scaler = flatopt.GradScaler(init_scale=2.0 ** 10, growth_interval=3)
    ema = flatopt.EMA(opt, decay=0.9, warmup=True)
    return opt, sched, scaler, ema


def micro_batches(t: int) -> list[dict[str, np.ndarray]]:
    """Each micro-batch's gradients of the unscaled loss; head.bias gets none in the second
    micro-batch of odd steps and none at all at step 5."""
    rng = np.random.default_rng(100 + t)
    batches = []
    for micro in range(MICRO_BATCHES):
        grads = {path: rng.standard_normal(shape).astype(np.float32)
                 for path, shape in SHAPES.items()}
        if (micro == 1 and t % 2) or t == 5:
            del grads["head.bias"]
        if t in OVERFLOW_STEPS and micro == 1:
            grads["enc.weight"][2, 3] = np.inf
        batches.append(grads)
    return batches


def train(tools, start: int, stop: int) -> list[bool]:
    opt, sched, scaler, ema = tools
    skipped = []
    for t in range(start, stop):
        opt.zero_grad()
        for grads in micro_batches(t):  # backward of scaler.scale(loss) / MICRO_BATCHES
            factor = np.float32(scaler.get_scale() / MICRO_BATCHES)
            opt.grads.add({path: g * factor for path, g in grads.items()})
        result = scaler.step(opt, max_grad_norm=1.0)
        scaler.update()
        if not result.skipped:
            ema.update()
        sched.step()
        skipped.append(result.skipped)
    return skipped


def save(path: Path, tools) -> None:
    opt, sched, scaler, ema = tools
    ema_state = ema.state_dict()
    averages = ema_state.pop("averages")
    flatopt.save(path, opt, scheduler=sched,
                 arrays={f"ema:{name}": value for name, value in averages.items()},
                 metadata={"scaler": scaler.state_dict(), "ema": ema_state})


def load(path: Path, tools) -> None:
    opt, sched, scaler, ema = tools
    result = flatopt.load(path, opt, scheduler=sched)
    scaler.load_state_dict(result.metadata["scaler"])
    averages = {name[len("ema:"):]: value for name, value in result.arrays.items()}
    ema.load_state_dict({**result.metadata["ema"], "averages": averages})


def dump(tools) -> dict[str, np.ndarray]:
    opt, sched, scaler, ema = tools
    out = {f"lr{k}": np.array(group["lr"]) for k, group in enumerate(opt.param_groups)}
    out["scale"] = np.array(scaler.get_scale())
    out["ema_updates"] = np.array(ema.num_updates)
    for path in opt.params:
        out[f"{path}/param"] = opt.params[path].copy()
        out[f"{path}/ema"] = ema.params[path].copy()
        for name, value in opt.state_of(path)._asdict().items():
            if value is not None:
                out[f"{path}/{name}"] = np.array(value).copy()
    return out


def main(argv: list[str]) -> int:
    mode, directory = argv[0], Path(argv[1])
    tools = build()
    if mode == "first":
        train(tools, 0, SPLIT)
        save(directory / "loop.h5", tools)
    elif mode == "resume":
        load(directory / "loop.h5", tools)
        train(tools, SPLIT, TOTAL)
        np.savez(directory / "resumed.npz", **dump(tools))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
