"""A fingerprint of every registered rule's results, to show that a refactor keeps the bits:
``python -m bench.rule_bits > before.txt``, change the code, run it again and ``diff``.

For each registered rule (the examples' too with ``--examples``), six settings drawn from its
schema's examples, float32 and float64: three parameters (one missing its gradient at some
steps) stepped five times; a line per (rule, settings, dtype) with a digest of the parameters
and the state dict, or why the optimizer refused the settings.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import warnings
from pathlib import Path

import numpy as np

from flatopt import registry

SHAPES = {"a": (6, 8), "b": (8,), "c": (3, 5)}
TRIALS = 6
STEPS = 5


def fingerprint(cls, settings: dict, dtype, rng) -> str:
    """The digest of a run, or why it stopped."""
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}
    try:
        opt = cls(params, **settings)
    except Exception as exc:  # a combination the schema refuses: part of the fingerprint
        return f"refused {type(exc).__name__}"
    digest = hashlib.sha256()
    try:
        for step in range(STEPS):
            opt.step({k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()
                      if (step + len(k)) % 3})
    except Exception as exc:  # as above: recorded, compared like a digest
        return f"error {type(exc).__name__}: {str(exc)[:80]}"
    for k in SHAPES:
        digest.update(np.ascontiguousarray(opt.params[k]).tobytes())
    digest.update(repr(opt.state_dict()["state"]).encode())
    return digest.hexdigest()[:16]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", action="store_true",
                        help="register examples/'s rules first (their bits too)")
    args = parser.parse_args(argv)
    if args.examples:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        for module in ("adabelief", "adan", "lamb", "adagrad_norm"):
            __import__(module)
    warnings.simplefilter("ignore")  # steps where no gradient is present say so
    for name in sorted(registry.names()):
        cls = registry.lookup(name)
        hypers = {k: h for k, h in cls.schema.hyperparameters.items() if not h.state}
        for trial in range(TRIALS):
            rng = np.random.default_rng(trial)
            settings = {k: h.examples[int(rng.integers(len(h.examples)))] if h.examples
                        else h.default for k, h in hypers.items()}
            for dtype in (np.float32, np.float64):
                print(name, trial, np.dtype(dtype).name, fingerprint(cls, settings, dtype, rng))


if __name__ == "__main__":
    main()
