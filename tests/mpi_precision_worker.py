"""The MPI side of tests/test_mpi_precision.py: ``mpiexec -n P python
tests/mpi_precision_worker.py [CASE...]``.

Each case builds a reduced-precision optimizer with ``comm=`` and steps it on every rank's own
gradients; rank 0 also steps a single-process optimizer on their rank-order average and
compares parameters, stored state (codes, block scales, bfloat16 bits), master weights,
compensation and the decoded state bit for bit. Every rank prints ``[rank R] ok <what>`` or
``[rank R] FAIL <what>``."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flatopt  # noqa: E402
from flatopt import distributed  # noqa: E402
from flatopt.errors import CheckpointError  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
# several tensors of at least 4096 elements (8-bit state), sizes not multiples of the
# 256-element block, over several 16K-element chunks, so blocks and ranks' ranges meet
# parameter boundaries; "small" keeps float32 state under int8 (a buffer of its own)
SHAPES = [("w1", (300, 250)), ("b1", (5000,)), ("w2", (70, 90)), ("w3", (200, 151)),
          ("small", (100,))]
CASES = {
    "bf16-stochastic": ("AdamW", BF16, dict(rounding="stochastic", state_dtype="bfloat16",
                                            seed=11)),
    "int8": ("AdamW", np.dtype(np.float32), dict(state_dtype="int8")),
    "bf16-int8-stochastic": ("AdamW", BF16, dict(rounding="stochastic", state_dtype="int8",
                                                 seed=5)),
    "master": ("AdamW", BF16, dict(master_weights=True, grad_dtype="float32")),
    "lamb-kahan": ("LAMB", BF16, dict(rounding="kahan", state_dtype="bfloat16")),
    "f16-int8-master": ("Adam", np.dtype(np.float16), dict(master_weights=True,
                                                           state_dtype="int8")),
}
STEP_OPTIONS = [{}, {"max_grad_norm": 1.0}, {}, {"max_grad_norm": 0.5, "norm_type": np.inf}]
COMM, RANK, SIZE = None, 0, 1
FAILURES: list[str] = []


def report(ok: bool, what: str) -> None:
    print(f"[rank {RANK}] {'ok' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILURES.append(what)


def build(case: str, comm=None):
    name, dtype, storage = CASES[case]
    rng = np.random.default_rng(3)
    params = {path: rng.standard_normal(shape).astype(dtype) for path, shape in SHAPES}
    return getattr(flatopt, name)(params, lr=1e-2, weight_decay=0.01, comm=comm, **storage)


def local_gradients(opt, step: int, rank: int) -> dict:
    """Rank ``rank``'s gradients at ``step``, in the gradient dtype; b1 is missing on rank 1
    at step 1 (zeros there in the average)."""
    rng = np.random.default_rng(1000 * step + rank)
    grads = {}
    for path, shape in SHAPES:
        dtype = opt.buffers[opt.index[path].buffer].grads.dtype
        g = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        if not (path == "b1" and step == 1 and rank == 1):
            grads[path] = g
    return grads


def mean_gradients(opt, step: int, size: int) -> dict:
    """The average ZeRO-1 computes: summed in rank order, divided by the world size (in
    float32 for 16-bit gradients, then rounded to nearest in their dtype)."""
    per_rank = [local_gradients(opt, step, rank) for rank in range(size)]
    mean = {}
    for path, shape in SHAPES:
        dtype = opt.buffers[opt.index[path].buffer].grads.dtype
        wide = np.dtype(np.float32) if dtype.itemsize == 2 else dtype
        zeros = np.zeros(shape, wide)
        total = per_rank[0].get(path, zeros).astype(wide)
        for grads in per_rank[1:]:
            total = total + grads.get(path, zeros).astype(wide)
        mean[path] = (total / wide.type(size)).astype(dtype)
    return mean


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, dict) or isinstance(b, dict):  # an int8 slot's state-dict entry
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() \
            and all(same(a[key], b[key]) for key in a)
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def buffer_differences(twin, reference) -> list[str]:
    problems = []
    for got, want in zip(twin.buffers, reference.buffers):
        where = f"buffer {want.number}"
        if set(got.state) != set(want.state) or set(got.absmax) != set(want.absmax):
            problems.append(f"{where}: slots {sorted(got.state)} != {sorted(want.state)}")
        problems += [f"{where}: stored {name} differs" for name in want.state
                     if not same(got.state.get(name), want.state[name])]
        problems += [f"{where}: block scales of {name} differ" for name in want.absmax
                     if not same(got.absmax.get(name), want.absmax[name])]
        problems += [f"{where}: {kind} differs" for kind in ("master", "compensation")
                     if not same(getattr(got, kind), getattr(want, kind))]
        if got.draws != want.draws:
            problems.append(f"{where}: draws {got.draws} != {want.draws}")
    got, want = twin.state_dict()["state"], reference.state_dict()["state"]
    problems += [f"decoded state {path}.{key} differs" for path in want
                 for key, value in want[path].items() if not same(got[path][key], value)]
    return problems


def checkpoint_problems(case: str, opt, reference) -> list[str]:
    """Saved at this world size (one file, gathered on rank 0), the checkpoint resumes bit
    for bit in one process and in a fresh sharded optimizer; one process's file resumes in a
    sharded optimizer at this world size. Each resumed run takes one more step on the same
    gradients as the uninterrupted ones and must match them."""
    problems = []
    where = COMM.bcast(tempfile.mkdtemp(prefix="flatopt-mpi-precision-") if RANK == 0 else None)
    mine = os.path.join(where, "sharded.h5")
    single = os.path.join(where, "single.h5")
    try:  # refused on rank 0 (metadata that is not JSON): raised on every rank, no file
        flatopt.save(mine, opt, metadata={"bad": object()})
        problems.append("a save with unserializable metadata was not refused")
    except CheckpointError:
        if os.path.exists(mine):
            problems.append("the refused save wrote a file")
    saved = flatopt.save(mine, opt, metadata={"size": SIZE})
    if RANK == 0:
        if not os.path.isfile(saved):
            problems.append(f"the sharded save wrote {saved!r}, not one file")
        flatopt.save(single, reference)
    COMM.Barrier()
    step, options = len(STEP_OPTIONS), {"max_grad_norm": 1.0}
    resumed = build(case, COMM)
    result = flatopt.load(mine, resumed)
    if result.metadata != {"size": SIZE}:
        problems.append(f"metadata {result.metadata!r}")
    from_single = build(case, COMM)
    flatopt.load(single, from_single)
    for sharded in (opt, resumed, from_single):
        sharded.step(local_gradients(sharded, step, RANK), **options)
    twins = [distributed.consolidated(o, root=0) for o in (opt, resumed, from_single)]
    if RANK == 0:
        alone = build(case)
        flatopt.load(mine, alone)
        gradients = mean_gradients(reference, step, SIZE)
        for one in (reference, alone):
            one.step(gradients, **options)
        for label, twin, want in (("resumed from the sharded save", twins[1], twins[0]),
                                  ("resumed from one process's file", twins[2], twins[0]),
                                  ("one process resumed from the sharded save", alone,
                                   reference)):
            problems += [f"{label}: parameter {path} differs" for path, _ in SHAPES
                         if not same(twin.params[path], want.params[path])]
            problems += [f"{label}: {p}" for p in buffer_differences(twin, want)]
        # the uninterrupted sharded run still is one process's, bit for bit
        problems += [f"after the save: {p}" for p in buffer_differences(twins[0], reference)]
        for path in (mine, single):
            os.remove(path)
        os.rmdir(where)
    return problems


def run_case(case: str) -> None:
    opt = build(case, COMM)
    reference = build(case) if RANK == 0 else None
    problems = []
    for step, options in enumerate(STEP_OPTIONS):
        if step == 2:  # writing a parameter resets (this rank's range of) its master copy
            value = np.full((70, 90), 0.25, np.float32).astype(opt.params["w2"].dtype)
            opt.params["w2"] = value
            if reference is not None:
                reference.params["w2"] = value
        result = opt.step(local_gradients(opt, step, RANK), **options)
        if reference is not None:
            expected = reference.step(mean_gradients(reference, step, SIZE), **options)
            if not same(np.float64(result.grad_norm or 0.0),
                        np.float64(expected.grad_norm or 0.0)):
                problems.append(f"step {step}: grad_norm {result.grad_norm!r} != "
                                f"{expected.grad_norm!r}")
    twin = distributed.consolidated(opt, root=0)
    if reference is not None:
        problems += [f"parameter {path} differs" for path, _ in SHAPES
                     if not same(opt.params[path], reference.params[path])]
        problems += buffer_differences(twin, reference)
    digests = COMM.allgather(b"".join(opt.params[p].tobytes() for p, _ in SHAPES))
    if len(set(digests)) > 1:
        problems.append("the ranks hold different parameters")
    problems += checkpoint_problems(case, opt, reference)
    memory = opt.memory()
    held = COMM.allgather(memory["state"] + memory["master"])
    if reference is not None:
        whole = reference.memory()
        full = whole["state"] + whole["master"]
        if sum(held) != full:  # the ranges partition every buffer's state and master
            problems.append(f"state and master bytes over the ranks {held} != {full}")
        if SIZE > 1 and not max(held) < full:
            problems.append(f"a rank holds all the state and master bytes: {held}")
        if memory["params"] != whole["params"] or memory["grads"] != whole["grads"]:
            problems.append("parameter or gradient bytes differ from one process's")
    problems = COMM.bcast(problems if RANK == 0 else None) + (problems if RANK else [])
    report(not problems, f"precision {case} at {SIZE} ranks" +
           "".join(f"\n    {p}" for p in problems[:8]))


def main() -> None:
    global COMM, RANK, SIZE
    from mpi4py import MPI
    COMM, RANK, SIZE = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    for case in sys.argv[1:] or CASES:
        try:
            run_case(case)
        except Exception:
            report(False, f"precision {case}: {traceback.format_exc()}")
    COMM.Barrier()
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
