"""Helper for test_checkpoint_resume.py: train, save and resume in separate processes.

    python checkpoint_resume_script.py first DIR KIND...   train SPLIT steps, save DIR/<kind>.h5
    python checkpoint_resume_script.py resume DIR KIND...  load DIR/<kind>.h5 into a fresh
                                    optimizer, train to TOTAL, write DIR/<kind>-resumed.npz

Every registered optimizer works (``--plugin MODULE`` imports a module that registers more);
each group's hyperparameters are drawn from the schema's examples.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np

import flatopt
from optimizers import fit_params, random_settings, rich_settings

SPLIT, TOTAL = 5, 11


def build(kind: str) -> flatopt.Optimizer:
    rng = np.random.default_rng(42)
    params = {
        "layer1.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "layer1.bias": rng.standard_normal(8).astype(np.float32),
        "layer2.weight": rng.standard_normal((8, 4)),                       # float64
        "layer2.bias": rng.standard_normal(4),
        "late.weight": rng.standard_normal((4, 4)).astype(np.float32),      # first grad at 7
        "frozen.bias": rng.standard_normal(3).astype(np.float32),           # never a gradient
        "scale": np.array(0.5, dtype=np.float32),                           # 0-d
    }
    rules = [{"match": ["*.bias", "scale"], "label": "no_decay",
              **random_settings(kind, np.random.default_rng(1))},
             {"match": "late.*", "label": "late", **rich_settings(kind, seed=2)}]
    params = fit_params(kind, params)
    groups = flatopt.group_by_pattern(params, rules,
                                      rest={"label": "decay", **rich_settings(kind, seed=3)})
    return flatopt.registry.lookup(kind)(groups)


def build_scheduler(opt: flatopt.Optimizer):
    """Warm-up then cosine, as a real run would: the resume must restore the lrs it sets."""
    lr = flatopt.lr_scheduler
    return lr.SequentialLR(opt, [lr.LinearLR(opt, start_factor=0.1, total_iters=3),
                                 lr.CosineAnnealingLR(opt, T_max=8, eta_min=1e-5)],
                           milestones=[3])


def gradients(opt: flatopt.Optimizer, t: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + t)
    grads = {}
    for k, (path, view) in enumerate(opt.params.items()):
        g = rng.standard_normal(view.shape).astype(view.dtype)
        if path == "frozen.bias" or (path == "late.weight" and t < 7) or (k + t) % 5 == 0:
            continue  # a missing gradient
        if path == "layer1.bias" and t == 6:
            g[...] = 0  # a zero gradient is a real step
        grads[path] = g
    return grads


def run(opt: flatopt.Optimizer, sched, start: int, stop: int) -> None:
    for t in range(start, stop):
        opt.step(gradients(opt, t))
        sched.step()


def dump(opt: flatopt.Optimizer) -> dict[str, np.ndarray]:
    out = {f"lr{k}": np.array(group["lr"]) for k, group in enumerate(opt.param_groups)}
    for path in opt.params:
        out[f"{path}/param"] = opt.params[path].copy()
        state = opt.state_of(path)
        if state is None:
            continue
        for name, value in state._asdict().items():
            if value is not None:
                out[f"{path}/{name}"] = np.array(value).copy()
    return out


def main(argv: list[str]) -> int:
    while argv[0] == "--plugin":
        importlib.import_module(argv[1])
        argv = argv[2:]
    mode, directory, kinds = argv[0], Path(argv[1]), argv[2:]
    for kind in kinds:
        opt = build(kind)
        sched = build_scheduler(opt)
        if mode == "first":
            run(opt, sched, 0, SPLIT)
            flatopt.save(directory / f"{kind}.h5", opt, scheduler=sched,
                         metadata={"step": SPLIT})
        elif mode == "resume":
            # no option: the lrs the scheduler set are restored with its state
            result = flatopt.load(directory / f"{kind}.h5", opt, scheduler=sched)
            assert result.metadata == {"step": SPLIT}
            run(opt, sched, SPLIT, TOTAL)
            np.savez(directory / f"{kind}-resumed.npz", **dump(opt))
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
