"""Muon against torch.optim.Muon (CPU): flatopt's default orthogonalises in float32 with
NumPy's BLAS matrix products, ``ns_dtype="bfloat16"`` with bfloat16 operands on AMX tiles
(``kernels/amx.py``, NumPy's float32 products of the rounded operands without AMX), torch in
bfloat16 (its own matrix products: oneDNN, AMX where the CPU has it).

Run: ``python -m bench.muon [--model gpt2|small] [--blocks 1] [--rounds 3]
[--after-matmuls]``. ``gpt2``: one GPT-2 small block per ``--blocks`` (c_attn, attn.c_proj,
mlp.c_fc, mlp.c_proj; a step of all 12 blocks is 12 times one block's); ``small``: the
matrices 128x512, 512x512 and 512x10 per block (a new user's model in issue 32).
``--after-matmuls``: each timed step right after two 512 x 512 NumPy products (the median),
where a training loop runs it: NumPy's BLAS threads still spinning.

Beside the steps it prints each side's *product bound*: the Newton-Schulz iteration's
matrix products alone (``ns_steps`` times ``X X^T``, ``G G`` and ``G X`` per matrix, the wide
orientation), timed in float32 with NumPy and in bfloat16 with torch. No float32 step can be
faster than its products; when torch's whole step is faster than flatopt's product bound, the
gap is the matrix products' precision, not the step around them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import flatopt
from flatopt.kernels import amx

from .impls import torch

D = 768
NS_STEPS = 5


def block_shapes(blocks: int, model: str = "gpt2") -> dict[str, tuple[int, int]]:
    shapes = {}
    for b in range(blocks):
        if model == "small":
            shapes.update({f"{b}.in": (128, 512), f"{b}.hidden": (512, 512),
                           f"{b}.out": (512, 10)})
        else:
            shapes.update({f"h.{b}.attn.c_attn.weight": (D, 3 * D),
                           f"h.{b}.attn.c_proj.weight": (D, D),
                           f"h.{b}.mlp.c_fc.weight": (D, 4 * D),
                           f"h.{b}.mlp.c_proj.weight": (4 * D, D)})
    return shapes


MATMUL_N = 512


def matmuls() -> callable:
    """A forward/backward's stand-in: two 512 x 512 float32 products (NumPy's BLAS on every
    core, its threads still spinning when the step starts: ``bench.inloop``'s)."""
    a = np.random.default_rng(1).standard_normal((MATMUL_N, MATMUL_N)).astype(np.float32)

    def run():
        a @ (a @ a)
    return run


def best_of(step, rounds: int, before=None) -> float:
    """The fastest of ``rounds`` calls of ``step`` back to back; with ``before`` (untimed,
    before each call) the median: a step after matmuls varies with the BLAS threads."""
    step()
    samples = []
    for _ in range(rounds):
        if before is not None:
            before()
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return min(samples) if before is None else float(np.median(samples))


def products(shapes, matmul, make) -> callable:
    """One Newton-Schulz step's worth of products for every matrix, ``NS_STEPS`` times."""
    work = []
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        x = make((m, n))
        work.append((x, make((m, m))))

    def run():
        for _ in range(NS_STEPS):
            for x, g in work:
                gram = matmul(x, x.T)
                matmul(gram, gram)
                matmul(g, x)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.muon",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "small"), default="gpt2")
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--after-matmuls", action="store_true",
                        help="time each step right after two 512 x 512 NumPy products "
                             "(the median; the products alone are timed back to back)")
    args = parser.parse_args(argv)
    before = matmuls() if args.after_matmuls else None
    rng = np.random.default_rng(0)
    shapes = block_shapes(args.blocks, args.model)
    params = {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    # bfloat16 first: its kernels choose serial or parallel by timing both (kernels/threads.py),
    # and BLAS threads left spinning by the float32 runs would make the first timings stale
    half = flatopt.Muon({k: v.copy() for k, v in params.items()}, lr=0.02,
                        ns_dtype="bfloat16")
    ours_half = best_of(lambda: half.step(grads), args.rounds, before)
    opt = flatopt.Muon({k: v.copy() for k, v in params.items()}, lr=0.02)
    ours = best_of(lambda: opt.step(grads), args.rounds, before)
    ours_products = best_of(products(
        shapes.values(), np.matmul,
        lambda s: (rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)), args.rounds)
    line = (f"Muon, {args.blocks} {args.model} block(s)"
            f"{', after matmuls' if args.after_matmuls else ''}: flatopt {ours * 1e3:.1f} ms "
            f"(float32 products alone {ours_products * 1e3:.1f} ms), "
            f"flatopt ns_dtype=bfloat16 {ours_half * 1e3:.1f} ms "
            f"({'AMX' if amx.available() else 'no AMX: NumPy'} products)")
    if torch is not None:
        tensors = [torch.tensor(v.copy(), requires_grad=True) for v in params.values()]
        for t, g in zip(tensors, grads.values()):
            t.grad = torch.from_numpy(g)
        theirs = best_of(torch.optim.Muon(tensors, lr=0.02).step, args.rounds, before)
        theirs_products = best_of(products(
            shapes.values(), torch.matmul,
            lambda s: torch.randn(*s, dtype=torch.bfloat16) / s[1] ** 0.5), args.rounds)
        line += (f", torch {theirs * 1e3:.1f} ms (bfloat16 products alone "
                 f"{theirs_products * 1e3:.1f} ms); torch / flatopt {theirs / ours:.2f}x, "
                 f"torch / flatopt bfloat16 {theirs / ours_half:.2f}x")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
