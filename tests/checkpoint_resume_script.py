"""Helper for test_checkpoint_resume.py: train, save and resume in separate processes.

    python checkpoint_resume_script.py first DIR    train SPLIT steps per optimizer, save DIR/<kind>.h5
    python checkpoint_resume_script.py resume DIR   load DIR/<kind>.h5 into a fresh optimizer, train
                                                    to TOTAL, write DIR/<kind>-resumed.npz
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import flatopt

SPLIT, TOTAL = 5, 11
KINDS = ("SGD", "Adam", "AdamW")


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
    rules = [{"match": ["*.bias", "scale"], "weight_decay": 0.0, "label": "no_decay"},
             {"match": "late.*", "lr": 0.05, "label": "late"}]
    if kind == "SGD":
        rules[1].update(nesterov=True, dampening=0.0)
        rules[0]["dampening"] = 0.3
        groups = flatopt.group_by_pattern(params, rules, rest={"label": "decay"})
        return flatopt.SGD(groups, lr=0.02, momentum=0.9, weight_decay=1e-3)
    rules[1]["amsgrad"] = True
    groups = flatopt.group_by_pattern(params, rules, rest={"label": "decay"})
    cls = flatopt.Adam if kind == "Adam" else flatopt.AdamW
    return cls(groups, lr=0.01, betas=(0.8, 0.99), weight_decay=0.05)


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


def run(opt: flatopt.Optimizer, start: int, stop: int) -> None:
    for t in range(start, stop):
        opt.step(gradients(opt, t))


def dump(opt: flatopt.Optimizer) -> dict[str, np.ndarray]:
    out = {}
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
    mode, directory = argv[0], Path(argv[1])
    for kind in KINDS:
        opt = build(kind)
        if mode == "first":
            run(opt, 0, SPLIT)
            flatopt.save(directory / f"{kind}.h5", opt, metadata={"step": SPLIT})
        elif mode == "resume":
            result = flatopt.load(directory / f"{kind}.h5", opt)
            assert result.metadata == {"step": SPLIT}
            run(opt, SPLIT, TOTAL)
            np.savez(directory / f"{kind}-resumed.npz", **dump(opt))
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
