"""The README's Python blocks run as written, in order, in one namespace (in a temporary
directory). The first block is complete; later ones are fragments of a training loop that take a
few names as given (a loss, a backward function, the loop's counters): the prelude below defines
those and nothing else. A block that needs hardware this machine lacks is named in SKIPPED."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SKIPPED = {"import cupy": "needs CuPy and a GPU"}


def blocks() -> list[str]:
    return BLOCK.findall(README.read_text())


def prelude(namespace: dict) -> None:
    """What the fragments after the first block take as given (set after it has run)."""
    opt = namespace["opt"]
    shapes = {path: view.shape for path, view in opt.params.items()}

    def backward(loss=None):
        return {path: np.full(shape, 0.01, np.float32) for path, shape in shapes.items()}

    namespace.update(
        start=9_000, grads=backward(), micro_batches=[0, 1], backward=backward,
        loss=np.float32(0.5), evaluate=lambda params: None, epoch=3, step=120,
        # "build the optimizer exactly as before": the class and settings of the one in use
        build_optimizer=lambda params: type(namespace["opt"])(namespace["groups"],
                                                              **namespace["opt"].defaults),
        build_scheduler=lambda opt: namespace["flatopt"].lr_scheduler.OneCycleLR(
            opt, max_lr=0.5, total_steps=10_000),  # the README's scheduler
        init_params=lambda: None)


def test_the_readme_has_blocks_and_each_one_runs(tmp_path, monkeypatch):
    found = blocks()
    assert len(found) >= 5
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    namespace: dict = {}
    ran = 0
    for number, code in enumerate(found, start=1):
        reason = next((why for marker, why in SKIPPED.items() if marker in code), None)
        if reason:
            continue
        try:
            exec(compile(code, f"README.md python block {number}", "exec"), namespace)
        except Exception as exc:  # the block's number and the error, not a bare traceback
            pytest.fail(f"README python block {number} failed: {type(exc).__name__}: {exc}")
        if number == 1:
            prelude(namespace)
        ran += 1
    assert ran == len(found) - 1  # only the GPU block is skipped
