"""User-defined rules against the built-in ones, side by side in one process:
``python -m bench.custom_rules [--elements N] [--rounds R] [--threads T]``.

- ``flatopt.AdamW`` against ``chain(scale_by_adam(), add_decayed_weights(wd),
  scale_by_learning_rate(lr))``, the same update fused from optax-style pieces (target: the
  chain within 10% of AdamW);
- the examples' AdaBelief and Adan (``examples/``, ``flatopt.define_optimizer``) against
  AdamW (they move 3 and 5 arrays besides the gradient where AdamW moves 3) and, where
  pytorch-optimizer is installed, against its own AdaBelief and Adan (``foreach``, torch CPU)
  on the same float32 parameters;
- the examples of the other pieces against the built-in rules they resemble: Lamb (per-tensor
  totals: a reduce pass, then the step) against ``flatopt.LAMB`` (the same two passes, written
  by hand), AdaGradNorm (per-group totals) against ``flatopt.SGD``, SFSGD (state from the
  parameter) against ``flatopt.ScheduleFreeSGD``.

Each round times one step of every candidate in turn (after a NumPy matmul, as in a training
loop, so BLAS threads are awake), ``--rounds`` rounds; the median per candidate is printed, and
its ratio to AdamW's. Timings on a shared machine are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np

import flatopt
from flatopt import transforms as T

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def shapes(elements: int) -> dict[str, tuple]:
    """A transformer-like mix: four square matrices per block and their biases."""
    side = max(8, int((elements / 16) ** 0.5))
    return {f"block{b}.{name}": shape for b in range(4)
            for name, shape in (("wq", (side, side)), ("wk", (side, side)),
                                ("wv", (side, side)), ("wo", (side, side)), ("b", (side,)))}


def candidates(params: dict, grads: dict) -> dict:
    """name -> a function taking one step."""
    sys.path.insert(0, str(EXAMPLES))  # examples/ is not a package
    adabelief, adan, lamb, adagrad_norm, schedulefree_sgd = map(
        importlib.import_module, ("adabelief", "adan", "lamb", "adagrad_norm",
                                  "schedulefree_sgd"))

    def flat(cls, **kw):
        opt = cls({k: v.copy() for k, v in params.items()}, **kw)
        return lambda: opt.step(grads)

    chain = T.chain(T.scale_by_adam(), T.add_decayed_weights(1e-2),
                    T.scale_by_learning_rate(1e-3))
    steps = {"AdamW": flat(flatopt.AdamW, lr=1e-3, weight_decay=1e-2),
             "chain(adam, decay, lr)": flat(chain),
             "AdaBelief (examples/)": flat(adabelief.AdaBelief, weight_decay=1e-2),
             "Adan (examples/)": flat(adan.Adan, weight_decay=1e-2),
             "LAMB": flat(flatopt.LAMB, weight_decay=1e-2),
             "Lamb (examples/)": flat(lamb.Lamb, weight_decay=1e-2),
             "SGD": flat(flatopt.SGD, lr=1e-3),
             "AdaGradNorm (examples/)": flat(adagrad_norm.AdaGradNorm),
             "ScheduleFreeSGD": flat(flatopt.ScheduleFreeSGD),
             "SFSGD (examples/)": flat(schedulefree_sgd.SFSGD)}
    try:  # optional: the test extra
        pytorch_optimizer, torch = map(importlib.import_module, ("pytorch_optimizer", "torch"))
    except ImportError:
        return steps
    for name in ("AdaBelief", "Adan"):
        tensors = [torch.tensor(v.copy()) for v in params.values()]
        for t, g in zip(tensors, grads.values()):
            t.grad = torch.tensor(g)
        opt = getattr(pytorch_optimizer, name)(tensors, weight_decay=1e-2)
        steps[f"pytorch_optimizer.{name}"] = opt.step
    return steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=4_000_000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None,
                        help="Numba threads (default: Numba's)")
    args = parser.parse_args(argv)
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes(args.elements).items()}
    grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    steps = candidates(params, grads)
    a = rng.standard_normal((512, 512)).astype(np.float32)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # compile and warm up
        step()
        step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            a @ a  # BLAS threads awake, as after a backward pass
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    n = sum(v.size for v in params.values())
    print(f"{n:,} float32 parameters in {len(params)} tensors, {args.rounds} rounds, "
          f"median step time")
    base = statistics.median(times["AdamW"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:28s} {median * 1e3:8.2f} ms   {median / base:5.2f}x AdamW")
    return 0


if __name__ == "__main__":
    sys.exit(main())
