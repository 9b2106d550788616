"""Distributed-mode benchmark: ``python -m bench.mpi`` (``--help`` for options).

For each world size it launches ``mpiexec -n P python -m bench.mpi --worker ...``; every rank
runs Adam (float32) over one model of N elements (four tensors) in two ways, one after the
other, so that only one is in memory at a time:

- ``zero1``: flatopt with ``comm=`` (flatopt.distributed): gradients averaged by Alltoallv +
  rank-order sum over the rank's shard, the shard stepped, parameters all-gathered;
- ``ddp``: the plain data-parallel baseline: ``Allreduce`` of the whole gradient buffer, divide
  by P, every rank steps every parameter (a plain flatopt optimizer).

Reported per step (median over the timed steps, the slowest rank's): ``reduce`` (averaging,
and for zero1 the agreement exchange), ``step`` (the update), ``gather`` (zero1's Allgatherv),
and memory per rank: optimizer state, and everything the optimizer holds (parameters,
gradients, state, zero1's receive scratch). Results go to ``bench/results/mpi.json``.

With ``--checkpoint DIR`` (at world sizes above 1) it also times, per model size, saving and
loading the sharded Adam: ``save`` (one file per rank and the manifest) against
``save gathered`` (``consolidated`` to rank 0, which writes one file: what a sharded save did
before per-rank files), ``load`` (each rank reads its ranges of the directory),
``load file`` (each rank reads its ranges of the single file) and ``load whole`` (every rank
reads the whole file into a plain copy: the route partial loads take). Each figure is the
slowest rank's, the best of two, page cache hot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).with_name("results") / "mpi.json"
MiB = 1 << 20


def _parse_elements(text: str) -> int:
    text = text.strip().upper()
    factor = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * factor)


def _model(elements: int) -> dict:
    """Four float32 tensors of N elements in all (a quarter each, the last takes the rest)."""
    quarter = elements // 4
    sizes = [quarter, quarter, quarter, elements - 3 * quarter]
    rng = np.random.default_rng(0)
    return {f"layer{k}.weight": rng.standard_normal(size).astype(np.float32)
            for k, size in enumerate(sizes)}


def _median_of_slowest(comm, samples: list[float]) -> float:
    """Per step, the slowest rank's time; then the median over steps."""
    slowest = np.max(np.array(comm.allgather(samples)), axis=0)
    return float(np.median(slowest))


def _run_zero1(comm, elements: int, steps: int, warmup: int) -> dict:
    import flatopt
    opt = flatopt.Adam(_model(elements), lr=1e-3, comm=comm)
    rng = np.random.default_rng(comm.Get_rank())
    for buf in opt.buffers:
        buf.grads[...] = rng.standard_normal(buf.length).astype(np.float32)
    sharding = opt.sharding
    parts = {"reduce": [], "step": [], "gather": [], "total": []}
    for step in range(warmup + steps):
        opt.grads.mark_present()
        comm.Barrier()
        before = dict(sharding.timings) if sharding else None
        start = time.perf_counter()
        opt.step()
        total = time.perf_counter() - start
        if step < warmup:
            continue
        parts["total"].append(total)
        if sharding is None:  # world size 1: a plain optimizer
            parts["reduce"].append(0.0)
            parts["step"].append(total)
            parts["gather"].append(0.0)
        else:
            delta = {k: sharding.timings[k] - before[k] for k in before}
            parts["reduce"].append(delta["exchange"] + delta["reduce"])
            parts["step"].append(delta["step"])
            parts["gather"].append(delta["gather"])
    state = sharding.state_nbytes if sharding else sum(
        a.nbytes for buf in opt.buffers for a in buf.state.values())
    scratch = sum(s._scratch.nbytes for s in sharding.shards
                  if s._scratch is not None) if sharding else 0
    held = sum(buf.params.nbytes + buf.grads.nbytes for buf in opt.buffers) + state + scratch
    return {**{k: _median_of_slowest(comm, v) for k, v in parts.items()},
            "state_mib": state / MiB, "held_mib": held / MiB}


def _run_ddp(comm, elements: int, steps: int, warmup: int) -> dict:
    import flatopt
    from mpi4py import MPI
    opt = flatopt.Adam(_model(elements), lr=1e-3)
    rng = np.random.default_rng(comm.Get_rank())
    for buf in opt.buffers:
        buf.grads[...] = rng.standard_normal(buf.length).astype(np.float32)
    size = np.float32(comm.Get_size())
    parts = {"reduce": [], "step": [], "gather": [], "total": []}
    for step in range(warmup + steps):
        opt.grads.mark_present()
        comm.Barrier()
        start = time.perf_counter()
        for buf in opt.buffers:
            comm.Allreduce(MPI.IN_PLACE, [buf.grads, MPI.FLOAT], op=MPI.SUM)
            np.divide(buf.grads, size, out=buf.grads)
        reduced = time.perf_counter()
        opt.step()
        done = time.perf_counter()
        if step < warmup:
            continue
        parts["reduce"].append(reduced - start)
        parts["step"].append(done - reduced)
        parts["gather"].append(0.0)
        parts["total"].append(done - start)
    state = sum(a.nbytes for buf in opt.buffers for a in buf.state.values())
    held = sum(buf.params.nbytes + buf.grads.nbytes for buf in opt.buffers) + state
    return {**{k: _median_of_slowest(comm, v) for k, v in parts.items()},
            "state_mib": state / MiB, "held_mib": held / MiB}


def _timed(comm, action, rounds: int = 2) -> float:
    """Seconds ``action()`` took on the slowest rank (started together), the best of
    ``rounds`` (the first also loads compiled checks from Numba's cache)."""
    best = float("inf")
    for _ in range(rounds):
        comm.Barrier()
        start = time.perf_counter()
        action()
        best = min(best, max(comm.allgather(time.perf_counter() - start)))
    return best


def _run_checkpoint(comm, elements: int, directory: str) -> dict:
    import flatopt
    from flatopt import distributed
    from flatopt.checkpoint import sharded
    opt = flatopt.Adam(_model(elements), lr=1e-3, comm=comm)
    rng = np.random.default_rng(comm.Get_rank())
    for buf in opt.buffers:
        buf.grads[...] = rng.standard_normal(buf.length).astype(np.float32)
    opt.grads.mark_present()
    opt.step()
    sharded_path = os.path.join(directory, f"adam-{elements}-{comm.Get_size()}")
    single_path = os.path.join(directory, f"adam-{elements}-{comm.Get_size()}.h5")

    def save_gathered():
        twin = distributed.consolidated(opt, root=0)
        if comm.Get_rank() == 0:
            flatopt.save(single_path, twin)
        comm.Barrier()

    row = {"save": _timed(comm, lambda: flatopt.save(sharded_path, opt)),
           "save_gathered": _timed(comm, save_gathered),
           "load": _timed(comm, lambda: flatopt.load(sharded_path, opt)),
           "load_file": _timed(comm, lambda: flatopt.load(single_path, opt)),
           "load_whole": _timed(comm, lambda: sharded._load_whole(single_path, opt, {}, ""))}
    comm.Barrier()
    if comm.Get_rank() == 0:
        import shutil
        shutil.rmtree(sharded_path, ignore_errors=True)
        os.unlink(single_path)
    return row


def worker(elements: list[int], steps: int, warmup: int, checkpoint: str | None) -> None:
    import gc
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rows = []
    for n in elements:
        for mode, run in (("zero1", _run_zero1), ("ddp", _run_ddp)):
            row = run(comm, n, steps, warmup)
            gc.collect()
            rows.append({"mode": mode, "ranks": comm.Get_size(), "elements": n, **row})
        if checkpoint and comm.Get_size() > 1:
            row = _run_checkpoint(comm, n, checkpoint)
            gc.collect()
            rows.append({"mode": "ckpt", "ranks": comm.Get_size(), "elements": n, **row})
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def _table(rows: list[dict]) -> str:
    lines = [f"{'elements':>9} {'ranks':>5} {'mode':>6} {'reduce ms':>10} {'step ms':>8} "
             f"{'gather ms':>10} {'total ms':>9} {'state MiB':>10} {'held MiB':>9}"]
    for r in rows:
        if r["mode"] == "ckpt":
            continue
        lines.append(f"{r['elements'] / MiB:>8.0f}M {r['ranks']:>5} {r['mode']:>6} "
                     f"{1e3 * r['reduce']:>10.2f} {1e3 * r['step']:>8.2f} "
                     f"{1e3 * r['gather']:>10.2f} {1e3 * r['total']:>9.2f} "
                     f"{r['state_mib']:>10.1f} {r['held_mib']:>9.1f}")
    saved = [r for r in rows if r["mode"] == "ckpt"]
    if saved:
        lines += ["", f"{'elements':>9} {'ranks':>5} {'save ms':>8} {'save gathered ms':>17} "
                      f"{'load ms':>8} {'load file ms':>13} {'load whole ms':>14}"]
        lines += [f"{r['elements'] / MiB:>8.0f}M {r['ranks']:>5} {1e3 * r['save']:>8.0f} "
                  f"{1e3 * r['save_gathered']:>17.0f} {1e3 * r['load']:>8.0f} "
                  f"{1e3 * r['load_file']:>13.0f} {1e3 * r['load_whole']:>14.0f}"
                  for r in saved]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mpi", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", default="1M,16M,64M",
                        help="model sizes, comma separated (K and M suffixes; default "
                             "%(default)s)")
    parser.add_argument("--ranks", default="1,2,4", help="world sizes (default %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--out", default=str(RESULTS), help="JSON results (default "
                                                            "bench/results/mpi.json)")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="also time sharded checkpoints written to DIR (see above)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    elements = [_parse_elements(x) for x in args.elements.split(",")]
    if args.worker:
        worker(elements, args.steps, args.warmup, args.checkpoint)
        return 0
    mpiexec = Path(sys.executable).with_name("mpiexec")
    rows = []
    cores = len(os.sched_getaffinity(0))
    for ranks in [int(x) for x in args.ranks.split(",")]:
        command = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(ranks),
                   sys.executable, "-m", "bench.mpi", "--worker", "--elements", args.elements,
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   *(["--checkpoint", os.path.abspath(args.checkpoint)]
                     if args.checkpoint else [])]
        # ranks share the cores: each gets its share of Numba threads (unless set)
        threads = os.environ.get("NUMBA_NUM_THREADS") or str(max(1, cores // ranks))
        print(f"NUMBA_NUM_THREADS={threads} " + " ".join(command[2:]), file=sys.stderr,
              flush=True)
        output = subprocess.run(command, capture_output=True, text=True, check=False,
                                cwd=Path(__file__).resolve().parents[1],
                                env={**os.environ, "NUMBA_NUM_THREADS": threads})
        found = [line for line in output.stdout.splitlines() if line.startswith("RESULT ")]
        if output.returncode or not found:
            print(output.stdout[-3000:], output.stderr[-3000:], file=sys.stderr)
            return 1
        rows += json.loads(found[-1][len("RESULT "):])
    rows.sort(key=lambda r: (r["elements"], r["ranks"], r["mode"] != "zero1"))
    print(_table(rows))
    record = {"command": "python -m bench.mpi " + " ".join(argv or sys.argv[1:]),
              "machine": {"cpus": cores, "platform": platform.platform(),
                          "numba_threads_per_rank": os.environ.get("NUMBA_NUM_THREADS")
                          or "cores // ranks (at least 1)"},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
