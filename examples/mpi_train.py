"""Data-parallel training of a NumPy MLP with flatopt over MPI (ZeRO-1 sharded AdamW).

    mpiexec -n 4 python examples/mpi_train.py --check --save /tmp/mlp
    mpiexec -n 2 python examples/mpi_train.py --resume /tmp/mlp --steps 20

Every rank holds the whole model and computes gradients on its slice of each batch; flatopt
averages them across ranks, each rank updates its shard of the flat buffers (with optimizer
state for that shard only) and the parameters are all-gathered. ``--check`` also steps a
plain single-process optimizer on the rank-order mean gradient and compares every bit.
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import flatopt
from flatopt import distributed

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def model(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"hidden.weight": (rng.standard_normal((128, 1024)) / 11.3).astype(np.float32),
            "hidden.bias": np.zeros(1024, np.float32),
            "middle.weight": (rng.standard_normal((1024, 1024)) / 32).astype(np.float32),
            "middle.bias": np.zeros(1024, np.float32),
            "out.weight": (rng.standard_normal((1024, 1)) / 32).astype(np.float32),
            "out.bias": np.zeros(1, np.float32)}


def batch(step: int, global_batch: int = 256):
    """The step's global batch (the same on every rank); each rank takes its slice."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((global_batch, 128)).astype(np.float32)
    y = np.sin(x[:, :4].sum(axis=1, keepdims=True)).astype(np.float32)
    rows = slice(rank * global_batch // size, (rank + 1) * global_batch // size)
    return x[rows], y[rows]


def loss_and_gradients(p: dict, x: np.ndarray, y: np.ndarray):
    """Mean squared error of a 2-hidden-layer tanh MLP, and its gradients (backprop)."""
    h1 = np.tanh(x @ p["hidden.weight"] + p["hidden.bias"])
    h2 = np.tanh(h1 @ p["middle.weight"] + p["middle.bias"])
    out = h2 @ p["out.weight"] + p["out.bias"]
    delta = 2 * (out - y) / len(x)
    g = {"out.weight": h2.T @ delta, "out.bias": delta.sum(0)}
    d2 = (delta @ p["out.weight"].T) * (1 - h2 * h2)
    g["middle.weight"], g["middle.bias"] = h1.T @ d2, d2.sum(0)
    d1 = (d2 @ p["middle.weight"].T) * (1 - h1 * h1)
    g["hidden.weight"], g["hidden.bias"] = x.T @ d1, d1.sum(0)
    return float(np.mean((out - y) ** 2)), g


def build(comm_or_none):
    groups = flatopt.group_by_pattern(model(), [{"match": ["*.bias"], "weight_decay": 0.0}],
                                      rest={})
    return flatopt.AdamW(groups, lr=1e-3, weight_decay=0.01, comm=comm_or_none)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--check", action="store_true",
                        help="compare with one process stepping on the mean gradient")
    parser.add_argument("--save", help="checkpoint written at the end (every rank calls save; "
                        "a directory of one file per rank and a manifest when P > 1)")
    parser.add_argument("--resume", help="checkpoint to start from (saved at any world size)")
    args = parser.parse_args()
    opt = build(comm)
    first = 0
    if args.resume:
        first = flatopt.load(args.resume, opt).metadata["step"]
    reference = build(None) if args.check else None
    if reference is not None and args.resume:
        flatopt.load(args.resume, reference)
    identical = True
    for step in range(first, first + args.steps):
        x, y = batch(step)
        loss, grads = loss_and_gradients(opt.params, x, y)
        opt.step(grads, max_grad_norm=1.0)
        if reference is not None:  # the rank-order mean gradient, in one process
            every = comm.allgather(grads)
            mean = {path: _rank_order_mean([g[path] for g in every]) for path in grads}
            reference.step(mean, max_grad_norm=1.0)
            identical &= all(np.array_equal(opt.params[p].view(np.uint32),
                                            reference.params[p].view(np.uint32))
                             for p in grads)
        total = comm.allreduce(loss) / size
        if rank == 0 and (step % 10 == 0 or step == first + args.steps - 1):
            print(f"step {step:4d}  loss {total:.5f}", flush=True)
    state = comm.gather(distributed.state_nbytes(opt))
    if rank == 0:
        print(f"{size} ranks; optimizer state per rank: "
              + ", ".join(f"{b / 2**20:.2f} MiB" for b in state))
        if reference is not None:
            print("bit-identical to one process on the mean gradient:", identical)
    if args.save:
        flatopt.save(args.save, opt, metadata={"step": first + args.steps})
        if rank == 0:
            print(f"saved {args.save} at step {first + args.steps}")


def _rank_order_mean(pieces: list[np.ndarray]) -> np.ndarray:
    total = pieces[0]
    for piece in pieces[1:]:
        total = total + piece  # ((g0 + g1) + g2) + ...
    return total / total.dtype.type(len(pieces))


if __name__ == "__main__":
    main()
