"""Adafactor on GPT-2 small's parameter shapes against torch.optim.Adafactor (CPU), torch's
best of its for-loop and foreach implementations; both in float32, same threads.

Run: ``python -m bench.adafactor [--blocks 12] [--rounds 3] [--threads 2]`` (the token and
position embeddings, ``--blocks`` transformer blocks with their biases and layer norms, the
final layer norm).
"""

from __future__ import annotations

import argparse

import numpy as np

import flatopt

from .impls import torch
from .muon import D, best_of, block_shapes


def gpt2_shapes(blocks: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (50257, D), "wpe.weight": (1024, D)}
    for name, shape in block_shapes(blocks).items():
        shapes[name] = shape
        shapes[name.replace(".weight", ".bias")] = (shape[1],)
    for b in range(blocks):
        for norm in ("ln_1", "ln_2"):
            shapes[f"h.{b}.{norm}.weight"] = shapes[f"h.{b}.{norm}.bias"] = (D,)
    shapes["ln_f.weight"] = shapes["ln_f.bias"] = (D,)
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.adafactor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        import numba
        numba.set_num_threads(args.threads)
        if torch is not None:
            torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shapes = gpt2_shapes(args.blocks)
    params = {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    elements = sum(p.size for p in params.values())
    opt = flatopt.Adafactor({k: v.copy() for k, v in params.items()}, weight_decay=0.01)
    ours = best_of(lambda: opt.step(grads), args.rounds)
    state_bytes = sum(flat.nbytes for buf in opt.buffers for flat in buf.state.values())
    line = (f"Adafactor, GPT-2 with {args.blocks} block(s) ({elements / 1e6:.0f}M float32 "
            f"elements, state {state_bytes / 2**20:.1f} MiB): flatopt {ours * 1e3:.0f} ms")
    if torch is not None:
        tensors = [torch.tensor(v.copy(), requires_grad=True) for v in params.values()]
        for t, g in zip(tensors, grads.values()):
            t.grad = torch.from_numpy(g)
        times = {}
        for foreach in (False, True):
            step = torch.optim.Adafactor(tensors, weight_decay=0.01, foreach=foreach).step
            times["foreach" if foreach else "for-loop"] = best_of(step, args.rounds)
        best = min(times, key=times.get)
        line += ", torch " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in times.items())
        line += f" (best {best}: {times[best] / ours:.2f}x flatopt's time)"
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
