"""A fingerprint of every registered rule's results, to show that a refactor keeps the bits:
``python -m bench.rule_bits > before.txt``, change the code, run it again and ``diff``.

For each registered rule (the examples' too with ``--examples``), six settings drawn from its
schema's examples, float32 and float64: three parameters (one missing its gradient at some
steps) stepped five times; a line per (rule, settings, dtype) with a digest of the parameters
and the state dict, or why the optimizer refused the settings.

``--storage``: the reduced-precision walks instead (``kernels/coded.py``): each rule with two
settings per storage configuration of :data:`STORAGES` (8-bit and bfloat16 state, 16-bit
parameters rounded to nearest, stochastically, with Kahan compensation or master weights),
over parameters large enough for 8-bit state (``MIN_8BIT_SIZE``) and one that is not, with
gradients scaled by clipping so the scaled-gradient views run too.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np

from flatopt import registry

SHAPES = {"a": (6, 8), "b": (8,), "c": (3, 5)}
TRIALS = 6
STORAGE_TRIALS = 2
STEPS = 5
STORAGE_SHAPES = {"a": (70, 80), "b": (300,), "c": (33, 130)}
STORAGES = {
    "int8": (np.float32, dict(state_dtype="int8")),
    "bf16-state": (np.float32, dict(state_dtype="bfloat16")),
    "bf16-nearest": ("bfloat16", dict()),
    "bf16-stochastic": ("bfloat16", dict(rounding="stochastic", state_dtype="bfloat16")),
    "bf16-kahan-int8": ("bfloat16", dict(rounding="kahan", state_dtype="int8")),
    "bf16-master-int8": ("bfloat16", dict(master_weights=True, state_dtype="int8")),
    "f16-stochastic": (np.float16, dict(rounding="stochastic")),
}
"""Parameter dtype and storage keywords of each ``--storage`` configuration."""


def fingerprint(cls, settings: dict, dtype, rng, shapes=SHAPES, **step_options) -> str:
    """The digest of a run, or why it stopped (``step_options``: keywords of each step)."""
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
    try:
        opt = cls(params, **settings)
    except Exception as exc:  # a combination the schema refuses: part of the fingerprint
        return f"refused {type(exc).__name__}"
    digest = hashlib.sha256()
    try:
        for step in range(STEPS):
            opt.step({k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()
                      if (step + len(k)) % 3}, **step_options)
    except Exception as exc:  # as above: recorded, compared like a digest
        return f"error {type(exc).__name__}: {str(exc)[:80]}"
    for k in shapes:
        digest.update(np.ascontiguousarray(opt.params[k]).tobytes())
    digest.update(repr(opt.state_dict()["state"]).encode())
    return digest.hexdigest()[:16]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", action="store_true",
                        help="register examples/'s rules first (their bits too)")
    parser.add_argument("--storage", action="store_true",
                        help="the reduced-precision storage configurations instead")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="these registered optimizers only (a subset of the lines)")
    args = parser.parse_args(argv)
    if args.examples:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        for module in ("adabelief", "adan", "lamb", "adagrad_norm", "adamw_blocks"):
            __import__(module)
    warnings.simplefilter("ignore")  # steps where no gradient is present say so
    for name in sorted(args.only or registry.names()):
        cls = registry.lookup(name)
        hypers = {k: h for k, h in cls.schema.hyperparameters.items() if not h.state}
        for trial in range(TRIALS):
            rng = np.random.default_rng(trial)
            settings = {k: h.examples[int(rng.integers(len(h.examples)))] if h.examples
                        else h.default for k, h in hypers.items()}
            if args.storage:
                if trial >= STORAGE_TRIALS:
                    break
                for label, (dtype, storage) in STORAGES.items():
                    dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
                    print(name, trial, label, fingerprint(
                        cls, {**settings, **storage}, dtype, rng, STORAGE_SHAPES,
                        max_grad_norm=10.0))
                continue
            for dtype in (np.float32, np.float64):
                print(name, trial, np.dtype(dtype).name, fingerprint(cls, settings, dtype, rng))


if __name__ == "__main__":
    main()
