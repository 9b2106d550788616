"""The runner's other figures: first-step compile time in a fresh process (cold and warm Numba
cache), per-step latency of the smallest profile, memory overhead, checkpoint throughput and
memory (``bench.checkpoint``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import checkpoint
from .impls import Case, make_impl, max_threads, schema_of, set_threads
from .profiles import PROFILES


def memory_overhead(case: Case) -> dict:
    """State bytes per element against the minimum: one element per used parameter-sized
    state slot (shaped slots, Adafactor's factors, count as nothing)."""
    opt = case.opt
    n = case.profile.n_elements
    state = sum(b.nbytes for buf in opt.buffers for b in buf.state.values())
    per_param = sum(a.nbytes for buf in opt.buffers for a in buf.columns.values())
    layout = sum(buf.offsets.nbytes + buf.sizes.nbytes + buf.chunk_first.nbytes
                 + buf.present.nbytes for buf in opt.buffers)
    total = sum(buf.nbytes for buf in opt.buffers) + per_param + layout
    return {"profile": case.profile.name, "optimizer": case.optimizer,
            "dtype": str(case.dtype), "n_elements": n,
            "padded_elements": sum(buf.length for buf in opt.buffers),
            "state_bytes_per_element": (state + per_param) / n,
            "minimum_state_bytes_per_element":
                len(schema_of(case.optimizer).parallel_slots(case.settings))
                * case.dtype.itemsize,
            "total_bytes_per_element": total / n}


_COMPILE_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import flatopt
t_import = time.perf_counter() - t0
out = {"import_s": t_import}
dtype = np.dtype(sys.argv[1])
for name in flatopt.registry.names():
    cls = flatopt.registry.lookup(name)
    params = {"a": np.ones((64, 32), dtype), "b": np.ones(32, dtype)}
    t0 = time.perf_counter()
    opt = cls(params, **cls.schema.benchmark)
    opt.grads.mark_present()
    opt.step()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.grads.mark_present()
    opt.step()
    second = time.perf_counter() - t0
    out[name] = {"first_step_s": first, "second_step_s": second}
print("RESULT" + json.dumps(out))
"""


def compile_times(dtype: str = "float32") -> dict:
    """First step in a fresh process with an empty Numba cache, then again with it warm."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="flatopt-bench-cache-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for which in ("cold", "warm"):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, dtype], env=env,
                                  capture_output=True, text=True)
            wall = time.perf_counter() - t0
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
            if proc.returncode or not line:
                out[which] = {"error": proc.stderr[-2000:]}
                continue
            out[which] = json.loads(line[0][len("RESULT"):])
            out[which]["process_wall_s"] = wall
    return out


def latency(profile_name: str = "1000x100", optimizer: str = "adam", dtype="float32",
            steps: int = 2000) -> dict:
    """Single-step latency distribution (each step timed alone), all cores and 1 thread."""
    case = Case(PROFILES[profile_name], optimizer, dtype)
    out = {"profile": profile_name, "optimizer": optimizer, "dtype": str(dtype)}
    impls = ["flatopt", "torch-fused"]
    for threads in sorted({1, max_threads()}):
        set_threads(threads)
        for name in impls:
            try:
                impl = make_impl(name, case)
            except Exception as exc:
                out[f"{name}_{threads}t"] = {"skipped": str(exc)}
                continue
            for _ in range(20):
                impl.step()
            ts = np.empty(steps)
            for k in range(steps):
                t0 = time.perf_counter()
                impl.step()
                ts[k] = time.perf_counter() - t0
            out[f"{name}_{threads}t"] = {
                "median_us": float(np.median(ts) * 1e6),
                "p90_us": float(np.percentile(ts, 90) * 1e6),
                "p99_us": float(np.percentile(ts, 99) * 1e6)}
            impl.close()
    set_threads(max_threads())
    return out


def checkpoint_throughput(profiles, dtype="float32", rounds: int = 3) -> dict:
    """``bench.checkpoint``: save, background-save pause, load and verify against
    np.save/np.load, with peak RSS, per profile."""
    return {"profiles": checkpoint.run(profiles, rounds=rounds, dtype=dtype)}


def run_all(quick: bool, dtype: str, progress) -> dict:
    out = {}
    for name, fn in [("compile", lambda: compile_times(dtype)),
                     ("latency", lambda: latency(dtype=dtype, steps=500 if quick else 2000)),
                     ("checkpoint", lambda: checkpoint_throughput(
                         ["64x1M"] if quick else checkpoint.DEFAULT_PROFILES, dtype=dtype,
                         rounds=2 if quick else 3))]:
        progress.show(f"extras: {name}")
        try:
            out[name] = fn()
        except Exception as exc:  # an extra that fails is reported, the table still stands
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        progress.advance()
    return out


def print_extras(extras: dict) -> None:
    c = extras.get("compile", {})
    print("\nFirst step in a fresh process (construct + step, every registered optimizer):")
    for which in ("cold", "warm"):
        r = c.get(which, {})
        if "error" in r or not r:
            print(f"  {which}: {r.get('error', 'not run')[:300]}")
            continue
        names = [k for k in r if isinstance(r[k], dict)]
        print(f"  {which} cache: import {r['import_s']:.2f} s; first step "
              + ", ".join(f"{k} {r[k]['first_step_s']:.2f} s" for k in names)
              + "; second step "
              + ", ".join(f"{k} {r[k]['second_step_s'] * 1e6:.0f} us" for k in names))
    lat = extras.get("latency", {})
    print(f"\nPer-step latency, {lat.get('profile')} {lat.get('optimizer')} (each step timed "
          "alone):")
    for key, r in lat.items():
        if isinstance(r, dict) and "median_us" in r:
            print(f"  {key:<18} median {r['median_us']:.1f} us, p90 {r['p90_us']:.1f} us, "
                  f"p99 {r['p99_us']:.1f} us")
    ck = extras.get("checkpoint", {})
    if "skipped" in ck or "error" in ck:
        print("\nCheckpoint throughput:")
        print(f"  {ck.get('skipped') or ck.get('error')}")
    elif ck.get("profiles"):
        checkpoint.print_table(ck["profiles"])
