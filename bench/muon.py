"""Muon on GPT-2 small's block matrices against torch.optim.Muon (CPU): flatopt orthogonalises
in float32 with NumPy's BLAS matrix products, torch in bfloat16.

Run: ``python -m bench.muon [--blocks 1] [--rounds 3]`` (one block = c_attn, attn.c_proj,
mlp.c_fc, mlp.c_proj; a step of all 12 blocks is 12 times one block's).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import flatopt

from .impls import torch

D = 768


def block_shapes(blocks: int) -> dict[str, tuple[int, int]]:
    shapes = {}
    for b in range(blocks):
        shapes.update({f"h.{b}.attn.c_attn.weight": (D, 3 * D),
                       f"h.{b}.attn.c_proj.weight": (D, D),
                       f"h.{b}.mlp.c_fc.weight": (D, 4 * D),
                       f"h.{b}.mlp.c_proj.weight": (4 * D, D)})
    return shapes


def best_of(step, rounds: int) -> float:
    step()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return min(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.muon",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    shapes = block_shapes(args.blocks)
    params = {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    opt = flatopt.Muon({k: v.copy() for k, v in params.items()}, lr=0.02)
    ours = best_of(lambda: opt.step(grads), args.rounds)
    line = f"Muon, {args.blocks} GPT-2 block(s), float32: flatopt {ours * 1e3:.0f} ms"
    if torch is not None:
        tensors = [torch.tensor(v.copy(), requires_grad=True) for v in params.values()]
        for t, g in zip(tensors, grads.values()):
            t.grad = torch.from_numpy(g)
        theirs = best_of(torch.optim.Muon(tensors, lr=0.02).step, args.rounds)
        line += f", torch {theirs * 1e3:.0f} ms ({theirs / ours:.2f}x)"
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
