"""``python -m bench.precision``: AdamW's step with reduced-precision storage, side by side.

Rows (each a fresh optimizer on the same random start and the same gradients, one tensor of
``--elements`` elements, 64M by default):

==============================  ==========  ===========================================
row                             parameters  optimizer settings
==============================  ==========  ===========================================
float32                         float32     (the baseline)
int8 state                      float32     ``state_dtype="int8"``
bf16 state                      float32     ``state_dtype="bfloat16"``
bf16 params + bf16 state        bfloat16    ``state_dtype="bfloat16"``,
                                            ``rounding="stochastic"``
bf16 params + int8 state        bfloat16    ``state_dtype="int8"``, ``rounding="stochastic"``
bf16 + master + int8            bfloat16    ``master_weights=True``, ``state_dtype="int8"``
bitsandbytes AdamW8bit          float32     ``bnb.optim.AdamW8bit`` on CPU torch tensors
==============================  ==========  ===========================================

plus the roofline kernel (``bench/roofline.py``: float32 AdamW's traffic, 28 B per element, with
trivial arithmetic) over the float32 row's buffer layout, measured in the same rounds: its
GB/s is the machine's bandwidth for this access pattern at this thread count.

Every row is measured in the same process, interleaved round by round (the order rotates each
round, with a short pause between implementations, as ``python -m bench`` does) after two
warm-up steps; the second warm-up step is watched for Numba compilations (there must be none).

Columns
-------
- ``ms/step``: median over the rounds.
- ``state B/param``: ``opt.memory()["state"] / n`` (8-bit block scales included); for
  bitsandbytes, the nbytes of the tensors in ``optimizer.state[p]``.
- ``B moved/elem``: the bytes one step must read and write per element, from the formats
  (:func:`traffic`): the parameters are read and written (with master weights only written:
  the step reads the float32 master copy instead, and reads and writes it, +8 B), the gradient
  read, each state slot read and written, 8-bit state also reading and writing one float32 scale
  per ``BLOCK`` elements. Float32 AdamW: 4+4 + 4 + 2*(4+4) = 28 B; int8 state: 8 + 4 +
  2*(1+1) + 2*2*4/256 = 16.06 B; bf16 params and state: 2+2 + 2 + 2*(2+2) = 14 B; bf16 params,
  master, int8 state: 2 + 8 + 2 + 4.06 = 16.06 B. bitsandbytes' AdamW8bit moves (at least) the
  same bytes as flatopt's int8-state row.
- ``GB/s``: ``n * B moved / time``.
- ``% roof``: that bandwidth / the roofline kernel's bandwidth (28 B * n / its time).
- ``x float32``: the float32 row's time / this row's time (above 1: faster).
- ``in-cache ns/elem``: the row's compute bound, measured: the same optimizer over
  ``CACHE_ELEMENTS`` and twice that (both in the core's L2 cache, so no step waits on
  memory), timed in the same interleaved rounds; the difference of the two times over the
  difference of the sizes is the cost of one element's instructions (the fixed cost of a step
  cancels). No hardware counters are needed (this machine's VM has none).
- ``memory ns/elem``: the bytes-based bound, ``B moved/elem`` at the roofline kernel's
  bandwidth.
- ``binds``: the larger of the two bounds; ``bound x float32``: the float32 row's time over
  this row's larger bound (the best ``x float32`` the row's instructions and bytes allow).

Targets (issue 32), one met/MISSED line each, with the bound beside a missed one: int8 state
>= 0.5x float32 and bf16 params + bf16 state >= 0.9x float32 (measured at 1 thread; with
``--threads 1 2`` each also >= 1.7x faster at 2 threads than at 1), flatopt's int8 state >= 3x
faster than bitsandbytes' AdamW8bit, state bytes per parameter <= 2.1 (int8) and 4 (bf16).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT32 = np.dtype(np.float32)

try:  # the storage constants of the core (flatopt/_storage.py); the spec's values otherwise
    from flatopt._storage import BLOCK, MIN_8BIT_SIZE
except Exception:  # pragma: no cover - only while the core is incomplete
    BLOCK, MIN_8BIT_SIZE = 256, 4096

ADAMW_SLOTS = 2
"""AdamW's state slots (exp_avg, exp_avg_sq; no amsgrad)."""
ROOFLINE_BYTES = 28
"""Bytes per element the roofline kernel moves with ``ADAMW_SLOTS`` slots (float32)."""
CACHE_ELEMENTS = 1 << 15
"""The smaller of the two in-cache sizes (32K elements; float32 AdamW moves 28 B each, so the
larger, 64K, holds 1.8 MB: within a 2 MB L2)."""
SWITCH_PAUSE_S = 0.015
"""Pause before each sample (OpenMP workers spin for ~5 ms after a parallel region); the same as
``bench/run.py``'s, which is imported when available."""


# --------------------------------------------------------------------------- traffic model
def format_bytes(dtype: str) -> float:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}[dtype]


def state_slot_bytes(state_dtype: str, size: int, block: int = BLOCK,
                     min_8bit: int = MIN_8BIT_SIZE) -> float:
    """Bytes one state slot holds per element: its format, plus one float32 scale per block
    for 8-bit state (tensors under ``min_8bit`` elements keep float32)."""
    if state_dtype == "int8":
        if size < min_8bit:
            return 4.0
        return 1.0 + 4.0 * math.ceil(size / block) / size
    return float(format_bytes(state_dtype))


def traffic(param_dtype: str, state_dtype: str, *, grad_dtype: str | None = None,
            master: bool = False, rounding: str = "nearest", slots: int = ADAMW_SLOTS,
            sizes: tuple[int, ...] = (1 << 26,)) -> float:
    """Bytes one step reads plus writes, per element, averaged over tensors of ``sizes``.

    - parameters: read and written (P + P); with master weights only written (P), while the
      float32 master copy is read and written (4 + 4); with Kahan rounding a 16-bit
      compensation buffer is also read and written (P + P);
    - gradients: read (G, the parameter's dtype unless ``grad_dtype``);
    - each state slot: read and written (2 S; 8-bit: the code byte and the block's scale).
    """
    p = format_bytes(param_dtype)
    g = format_bytes(grad_dtype or param_dtype)
    fixed = (p + 8 if master else 2 * p) + g
    if rounding == "kahan" and not master and p < 4:
        fixed += 2 * p
    total = sum(size * (fixed + 2 * slots * state_slot_bytes(state_dtype, size))
                for size in sizes)
    return total / sum(sizes)


# --------------------------------------------------------------------------- rows
@dataclass
class RowSpec:
    name: str
    param_dtype: str
    options: dict = field(default_factory=dict)
    kind: str = "flatopt"  # "flatopt" or "bitsandbytes"
    formats: dict = field(default_factory=dict)
    """The storage the traffic model assumes, where ``options`` do not say it."""

    def bytes_per_element(self, sizes) -> float:
        o = {**self.options, **self.formats}
        return traffic(self.param_dtype, o.get("state_dtype", "float32"),
                       grad_dtype=o.get("grad_dtype"), master=o.get("master_weights", False),
                       rounding=o.get("rounding", "nearest"), sizes=sizes)


ROWS = [
    RowSpec("float32", "float32"),
    RowSpec("int8 state", "float32", {"state_dtype": "int8"}),
    RowSpec("bf16 state", "float32", {"state_dtype": "bfloat16"}),
    RowSpec("bf16 params + bf16 state", "bfloat16",
            {"state_dtype": "bfloat16", "rounding": "stochastic"}),
    RowSpec("bf16 params + int8 state", "bfloat16",
            {"state_dtype": "int8", "rounding": "stochastic"}),
    RowSpec("bf16 + master + int8", "bfloat16",
            {"master_weights": True, "state_dtype": "int8"}),
    RowSpec("bitsandbytes AdamW8bit", "float32", kind="bitsandbytes",
            formats={"state_dtype": "int8"}),
]
ROOFLINE = "roofline (f32 AdamW traffic)"

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
"""AdamW's hyperparameters for every row (bitsandbytes' included)."""


def adamw_settings() -> dict:
    """The benchmark's AdamW settings (``bench.impls.settings_of``, as ``python -m bench``),
    restricted to what bitsandbytes also takes; ``HYPER`` when unavailable."""
    try:
        from .impls import settings_of
        s = settings_of("adamw")
        return {k: (tuple(s[k]) if k == "betas" else s[k]) for k in HYPER if k in s}
    except Exception:  # pragma: no cover
        return dict(HYPER)


class Runner:
    """One row's step function over its own parameters and state; ``close`` frees them."""

    def __init__(self, name: str, step: Callable[[], None], state_bytes: Callable[[], int],
                 keep):
        self.name, self.step, self.state_bytes, self.keep = name, step, state_bytes, keep

    def close(self) -> None:
        self.step = self.state_bytes = self.keep = None


def _in_cache(row: str, size: int) -> str:
    return f"{row} @ {size} in cache"


def make_flatopt(spec: RowSpec, start: dict, grads: dict, settings: dict,
                 name: str | None = None) -> Runner:
    import flatopt
    dtype = np.dtype(BFLOAT16 if spec.param_dtype == "bfloat16" else spec.param_dtype)
    # the start values go in at construction: master weights are copied from them
    params = {path: value.astype(dtype) for path, value in start.items()}
    opt = flatopt.AdamW(params, **settings, **spec.options)
    del params
    for path, view in opt.grads.items():
        view[...] = grads[path].astype(view.dtype, copy=False)
    opt.grads.mark_present()
    return Runner(name or spec.name, opt.step, lambda: opt.memory()["state"], opt)


def make_bitsandbytes(spec: RowSpec, start: dict, grads: dict, settings: dict) -> Runner:
    import torch
    with _quiet_stderr():  # bitsandbytes warns about optional GPU kernels on a CPU machine
        import bitsandbytes as bnb
    tensors = []
    for path, value in start.items():
        t = torch.from_numpy(value.copy()).requires_grad_(True)
        t.grad = torch.from_numpy(grads[path])  # shared, only read
        tensors.append(t)
    opt = bnb.optim.AdamW8bit(tensors, **settings)

    def state_bytes() -> int:
        return sum(v.nbytes for t in tensors for v in opt.state[t].values()
                   if isinstance(v, torch.Tensor))

    return Runner(spec.name, opt.step, state_bytes, (opt, tensors))


def make_roofline(runner: Runner) -> Runner:
    """The roofline kernel over the float32 row's buffer (its gradients only read)."""
    from .roofline import Roofline
    (buffer,) = runner.keep.buffers
    kernel = Roofline(buffer, ADAMW_SLOTS)
    return Runner(ROOFLINE, kernel.step, lambda: 0, kernel)


class _quiet_stderr:
    def __enter__(self):
        import os
        sys.stderr.flush()
        self.saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        import os
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)


# --------------------------------------------------------------------------- measuring
def _time_steps(step, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        step()
    return (time.perf_counter() - start) / inner


def _watched(step, inner: int = 1) -> tuple[float, int]:
    """Seconds per step of ``inner`` steps and the Numba compilations they started."""
    from numba.core import event
    with event.install_recorder("numba:compile") as rec:
        t = _time_steps(step, inner)
    return t, sum(1 for _, ev in rec.buffer if ev.is_start)


WARM_STEPS = 3
"""Steps after the first before timing: the second is watched for compilations (there must be
none), the later ones let the kernels' serial/parallel chooser (``kernels/threads.py``) try
both ways, so a lazily compiled parallel variant compiles before the timed rounds."""


def log(text: str, enabled: bool) -> None:
    if enabled:
        print(text, file=sys.stderr, flush=True)


def measure(elements: int, rounds: int, threads: int, sample_s: float = 0.02, seed: int = 0,
            verbose: bool = True) -> dict:
    """Build every row, warm up, time interleaved rounds; the report (rows, targets)."""
    from .impls import set_threads
    try:
        from .run import SWITCH_PAUSE_S as pause
    except Exception:  # pragma: no cover
        pause = SWITCH_PAUSE_S
    set_threads(threads)
    rng = np.random.default_rng(seed)
    sizes = (elements,)
    start = {"p0": rng.standard_normal(elements, dtype=np.float32)}
    grads = {"p0": rng.standard_normal(elements, dtype=np.float32)}
    settings = adamw_settings()

    results: dict[str, dict] = {}
    runners: list[Runner] = []
    for spec in ROWS:
        rec = {"row": spec.name, "kind": spec.kind, "param_dtype": spec.param_dtype,
               "options": spec.options, "bytes_per_element": spec.bytes_per_element(sizes)}
        results[spec.name] = rec
        log(f"building {spec.name}", verbose)
        try:
            if spec.kind == "bitsandbytes":
                runner = make_bitsandbytes(spec, start, grads, settings)
            else:
                runner = make_flatopt(spec, start, grads, settings)
        except ImportError as exc:
            rec["skipped"] = f"{type(exc).__name__}: {exc}"
            continue
        except Exception as exc:
            rec["error"] = _error_text(exc)
            continue
        runners.append(runner)
        if spec.kind == "flatopt":
            for size in (CACHE_ELEMENTS, 2 * CACHE_ELEMENTS):
                small = {path: value[:size] for path, value in start.items()}
                small_grads = {path: value[:size] for path, value in grads.items()}
                runners.append(make_flatopt(spec, small, small_grads, settings,
                                            name=_in_cache(spec.name, size)))
                results[_in_cache(spec.name, size)] = {"row": _in_cache(spec.name, size),
                                                       "kind": "in-cache",
                                                       "bytes_per_element": 0.0}
        if spec.name == "float32":
            try:
                runners.append(make_roofline(runner))
                results[ROOFLINE] = {"row": ROOFLINE, "kind": "roofline",
                                     "bytes_per_element": float(ROOFLINE_BYTES)}
            except Exception as exc:
                results[ROOFLINE] = {"row": ROOFLINE, "kind": "roofline",
                                     "error": _error_text(exc)}

    inner: dict[str, int] = {}
    live = []
    for runner in runners:  # warm-up: compiles and first-step allocations, then calibrate
        rec = results[runner.name]
        log(f"warm-up {runner.name}", verbose)
        try:
            t0 = time.perf_counter()
            runner.step()
            rec["first_step_s"] = time.perf_counter() - t0
            t, rec["second_step_compiles"] = _watched(runner.step)
            rec["second_step_s"] = t
            later = 0
            for _ in range(WARM_STEPS - 1):
                t, c = _watched(runner.step)
                later += c
            rec["later_warmup_compiles"] = later
            n = max(1, min(2000, math.ceil(sample_s / max(t, 1e-7))))
            if n > 1:
                t = _time_steps(runner.step, n)
            inner[runner.name] = n
            state = runner.state_bytes()
            if rec["kind"] not in ("roofline", "in-cache"):
                rec["state_bytes"] = int(state)
                rec["state_bytes_per_param"] = state / elements
            live.append(runner)
        except Exception as exc:
            rec["error"] = _error_text(exc)
            runner.close()
            log(f"{runner.name} failed: {rec['error']}", verbose)

    samples = {r.name: [] for r in live}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for k in range(rounds):
            log(f"round {k + 1}/{rounds}", verbose)
            for j in range(len(live)):
                runner = live[(j + k) % len(live)]
                if runner.step is None:
                    continue
                time.sleep(pause)
                try:
                    t, c = _watched(runner.step, inner[runner.name])
                    samples[runner.name].append(t)
                    results[runner.name]["timed_compiles"] = (
                        results[runner.name].get("timed_compiles", 0) + c)
                except Exception as exc:
                    results[runner.name]["error"] = _error_text(exc)
                    runner.close()
    finally:
        if gc_was:
            gc.enable()
    for runner in live:
        runner.close()
    del runners, live
    gc.collect()

    for name, s in samples.items():
        if s and "error" not in results[name]:
            results[name].update(median_s=float(np.median(s)), min_s=float(np.min(s)),
                                 samples_s=[float(x) for x in s],
                                 steps_per_sample=inner[name])
    derive(results, elements, threads)
    rows = [rec for rec in results.values() if rec["kind"] != "in-cache"]
    return {"elements": elements, "threads": threads, "rounds": rounds, "block": BLOCK,
            "settings": {k: list(v) if isinstance(v, tuple) else v
                         for k, v in settings.items()},
            "rows": rows, "targets": check_targets(results)}


def _error_text(exc: BaseException) -> str:
    """The exception and the last frames outside Numba (where flatopt called it)."""
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "site-packages" not in f.filename]
    where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:])
    return f"{type(exc).__name__}: {exc} (at {where})"


def derive(results: dict[str, dict], elements: int, threads: int = 1) -> None:
    """GB/s, % of the roofline's bandwidth, speed-up over the float32 row, the bounds. The
    in-cache steps are below the kernels' parallel threshold (``kernels/threads.py``), so they
    run on one core: at ``threads`` threads their cost per element is divided by ``threads``
    (compute-bound work splits over the cores)."""
    roof = results.get(ROOFLINE, {}).get("median_s")
    base = results.get("float32", {}).get("median_s")
    roof_gbps = elements * ROOFLINE_BYTES / roof / 1e9 if roof else None
    for rec in results.values():
        t = rec.get("median_s")
        if t is None:
            continue
        rec["gbps"] = elements * rec["bytes_per_element"] / t / 1e9
        if roof_gbps:
            rec["pct_roofline"] = 100.0 * rec["gbps"] / roof_gbps
        if base:
            rec["speedup_vs_float32"] = base / t
    for name, rec in results.items():
        small = results.get(_in_cache(name, CACHE_ELEMENTS), {}).get("median_s")
        large = results.get(_in_cache(name, 2 * CACHE_ELEMENTS), {}).get("median_s")
        if small is None or large is None:
            continue
        rec["compute_ns"] = max(large - small, 0.0) / CACHE_ELEMENTS * 1e9 / threads
        if roof_gbps:
            rec["memory_ns"] = rec["bytes_per_element"] / roof_gbps
            bound = max(rec["compute_ns"], rec["memory_ns"])
            rec["binds"] = "compute" if rec["compute_ns"] >= rec["memory_ns"] else "memory"
            if base:
                rec["bound_vs_float32"] = base / (bound * 1e-9 * elements)


def check_targets(results: dict[str, dict]) -> list[dict]:
    def get(row, key):
        return results.get(row, {}).get(key)

    out = []

    def add(target, value, ok, text):
        out.append({"target": target, "value": value,
                    "met": bool(ok) if value is not None else None,
                    "text": text if value is not None else "not measured"})

    for row, least in (("int8 state", 0.5), ("bf16 params + bf16 state", 0.9)):
        x = get(row, "speedup_vs_float32")
        bound = get(row, "bound_vs_float32")
        text = f"{x:.2f}x" if x else ""
        if x and bound and x < least:
            text += f" (its bound: {bound:.2f}x, {get(row, 'binds')})"
        add(f"{row} >= {least}x float32", x, x is not None and x >= least, text)
    t8, tb = get("int8 state", "median_s"), get("bitsandbytes AdamW8bit", "median_s")
    vs = tb / t8 if t8 and tb else None
    add("int8 state >= 3x bitsandbytes AdamW8bit", vs, vs is not None and vs >= 3,
        f"{vs:.2f}x" if vs else "")
    b8 = get("int8 state", "state_bytes_per_param")
    add("int8 state bytes/param <= 2.1", b8, b8 is not None and b8 <= 2.1,
        f"{b8:.3f} B" if b8 is not None else "")
    b16 = get("bf16 state", "state_bytes_per_param")
    add("bf16 state bytes/param = 4", b16, b16 is not None and abs(b16 - 4) < 0.01,
        f"{b16:.3f} B" if b16 is not None else "")
    return out


def thread_scaling(reports: list[dict], least: float = 1.7) -> list[dict]:
    """For the reduced-precision target rows measured at 1 and at 2 threads: the 1-thread time
    over the 2-thread time, against ``least``."""
    by_threads = {r["threads"]: {rec["row"]: rec for rec in r["rows"]} for r in reports}
    if 1 not in by_threads or 2 not in by_threads:
        return []
    out = []
    for row in ("int8 state", "bf16 params + bf16 state"):
        one, two = (by_threads[n].get(row, {}).get("median_s") for n in (1, 2))
        if one and two:
            x = one / two
            out.append({"target": f"{row}: 2 threads >= {least}x 1 thread", "value": x,
                        "met": x >= least, "text": f"{x:.2f}x"})
    return out


# --------------------------------------------------------------------------- report
def fmt_ms(t):
    return f"{t * 1e3:.2f}" if t is not None else "-"


def print_report(report: dict, out=None) -> None:
    """The table and the targets, printed to ``out`` (None: the current ``sys.stdout``)."""
    n, threads = report["elements"], report["threads"]
    print(f"\nAdamW, 1 x {n:,} elements, {threads} thread{'s' if threads != 1 else ''}, "
          f"median of {report['rounds']} interleaved rounds", file=out)
    print("\n| row | ms/step | state B/param | B moved/elem | GB/s | % roof | x float32 "
          "| ns/elem | in-cache ns/elem | memory ns/elem | binds | bound x float32 |", file=out)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|", file=out)
    notes = []
    for rec in report["rows"]:
        def num(key, spec):
            v = rec.get(key)
            return format(v, spec) if v is not None else "-"
        if "median_s" in rec:
            cells = [fmt_ms(rec["median_s"]), num("state_bytes_per_param", ".3f"),
                     num("bytes_per_element", ".2f"), num("gbps", ".1f"),
                     num("pct_roofline", ".0f"), num("speedup_vs_float32", ".2f"),
                     format(rec["median_s"] / n * 1e9, ".3f"), num("compute_ns", ".3f"),
                     num("memory_ns", ".3f"), rec.get("binds", "-"),
                     num("bound_vs_float32", ".2f")]
        else:
            why = "skipped" if "skipped" in rec else "ERROR"
            cells = [why, "-", num("bytes_per_element", ".2f")] + ["-"] * 8
            notes.append(f"{rec['row']}: {rec.get('skipped') or rec.get('error')}")
        for key, when in (("second_step_compiles", "the second step"),
                          ("later_warmup_compiles", f"warm-up steps 3-{WARM_STEPS + 1}"),
                          ("timed_compiles", "the timed steps")):
            if rec.get(key):
                notes.append(f"{rec['row']}: {when} compiled {rec[key]} Numba function(s)")
        print(f"| {rec['row']} | " + " | ".join(cells) + " |", file=out)
    print("\nB moved/elem: bytes read + written per element by the formats (see the module "
          "docstring); % roof: GB/s over the roofline kernel's; x float32: float32 time / row "
          "time; in-cache ns/elem: the compute bound (the step over 32K and 64K elements in the "
          "L2 cache); memory ns/elem: B moved/elem at the roofline's bandwidth; bound x "
          "float32: float32 time / the larger bound.", file=out)
    for note in notes:
        print(f"note: {note}", file=out)
    print("\nTargets:", file=out)
    for t in report["targets"]:
        mark = {True: "met   ", False: "MISSED", None: "n/a   "}[t["met"]]
        print(f"  [{mark}] {t['target']:<44}{t['text']}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.precision",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 26,
                        help="elements of the one tensor (default 64M)")
    parser.add_argument("--quick", action="store_true", help="1M elements (for the test)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved samples per row")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="thread counts, one table each (default: all cores)")
    parser.add_argument("--sample-seconds", type=float, default=0.02,
                        help="short steps are repeated to fill a sample of about this long")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="write the rows and targets as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    from .impls import max_threads, set_threads
    elements = (1 << 20) if args.quick else args.elements
    threads = args.threads or [max_threads()]
    reports = []
    for n in threads:
        report = measure(elements, args.rounds, n, args.sample_seconds,
                         verbose=not args.quiet)
        try:
            from .run import machine_info
            report["machine"] = machine_info()
        except Exception:  # pragma: no cover
            pass
        print_report(report)
        reports.append(report)
    set_threads(max_threads())
    scaling = thread_scaling(reports)
    if scaling:
        print("\nThread scaling (target: >= 1.7x from 1 to 2 threads):")
        for t in scaling:
            mark = {True: "met   ", False: "MISSED"}[t["met"]]
            print(f"  [{mark}] {t['target']:<52}{t['text']}")
    if args.json is not None:
        args.json.write_text(json.dumps(reports if len(reports) > 1 else reports[0], indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
