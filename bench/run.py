"""The benchmark runner: ``python -m bench`` (``--help`` for options).

Measures every implementation side by side in one process, interleaved round by round (the
order rotates each round), with 1 thread and with all cores; prints a table, writes JSON and,
when matplotlib is installed, a PNG of throughput against tensor count with the roofline.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from . import extras, inloop
from .impls import (ELEMENTWISE, OPTIMIZERS, Case, available_impls, bytes_per_element, make_impl,
                    max_threads, set_threads)
from .profiles import DEFAULT_ORDER, PROFILES


class Progress:
    """One status line on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        line = f"[{self.done}/{self.total} {elapsed:6.0f}s] {text}"
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + line[:150])
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1

    def finish(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


# After a parallel region, Numba's and torch's OpenMP workers spin for about 5 ms before they
# sleep (measured); on a machine with few cores a spinning pool slows whichever library runs
# next, so the runner pauses before each sample of a different implementation.
SWITCH_PAUSE_S = 0.015


def time_steps(step, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        step()
    return (time.perf_counter() - start) / inner


def measure_case(case: Case, impl_names: list[str], rounds: int, sample_s: float,
                 progress: Progress, label: str) -> dict[str, dict]:
    """Median seconds per step of each implementation, interleaved run by run."""
    impls = []
    notes = {}
    for name in impl_names:
        try:
            impls.append(make_impl(name, case))
        except Exception as exc:  # a baseline that cannot run here is reported, not fatal
            notes[name] = f"{type(exc).__name__}: {exc}"
    inner = {}
    for impl in impls:  # warm up (compiles, first-step allocations) and calibrate
        progress.show(f"{label}: warm-up {impl.name}")
        impl.step()
        t = time_steps(impl.step, 1)
        inner[impl.name] = max(1, min(2000, math.ceil(sample_s / max(t, 1e-7))))
        if inner[impl.name] > 1:
            t = time_steps(impl.step, inner[impl.name])
    samples = {impl.name: [] for impl in impls}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            progress.show(f"{label}: round {r + 1}/{rounds}")
            for j in range(len(impls)):
                impl = impls[(j + r) % len(impls)]
                time.sleep(SWITCH_PAUSE_S)
                samples[impl.name].append(time_steps(impl.step, inner[impl.name]))
    finally:
        if gc_was:
            gc.enable()
    for impl in impls:
        impl.close()
    results = {name: {"median_s": float(np.median(s)), "min_s": float(np.min(s)),
                      "samples_s": [float(x) for x in s], "steps_per_sample": inner[name]}
               for name, s in samples.items()}
    for name, note in notes.items():
        results[name] = {"skipped": note}
    return results


def machine_info() -> dict:
    import numba
    info = {"python": platform.python_version(), "numpy": np.__version__,
            "numba": numba.__version__, "platform": platform.platform(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "numba_threads": numba.config.NUMBA_NUM_THREADS}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def summarize(records: list[dict]) -> None:
    """Derived figures: elements/s, GB/s, ratios to flatopt, percent of roofline."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for rec in records:
        key = (rec["profile"], rec["optimizer"], rec["dtype"], rec["threads"])
        by_key.setdefault(key, {})[rec["impl"]] = rec
    for group in by_key.values():
        flat = group.get("flatopt", {}).get("median_s")
        roof = group.get("roofline", {}).get("median_s")
        for rec in group.values():
            t = rec.get("median_s")
            if t is None:
                continue
            rec["elements_per_s"] = rec["n_elements"] / t
            rec["gbps"] = rec["n_elements"] * rec["bytes_per_element"] / t / 1e9
            if flat:
                rec["speedup_of_flatopt"] = t / flat  # >1: flatopt is that many times faster
            if roof:
                rec["pct_roofline"] = 100.0 * roof / t


def fmt_time(t: float) -> str:
    if t < 1e-3:
        return f"{t * 1e6:.0f} us"
    if t < 1:
        return f"{t * 1e3:.2f} ms"
    return f"{t:.2f} s"


def print_tables(records: list[dict], impls: list[str], out=sys.stdout) -> None:
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        groups.setdefault((rec["optimizer"], rec["dtype"], rec["threads"]), []).append(rec)
    baselines = [n for n in impls if n not in ("flatopt", "roofline")]
    for (optimizer, dtype, threads), recs in groups.items():
        print(f"\n{optimizer} {dtype}, {threads} thread{'s' if threads > 1 else ''}", file=out)
        head = (f"{'profile':<12}{'tensors':>8}{'flatopt':>11}{'GB/s':>7}{'% roof':>8}"
                + "".join(f"{'x ' + b:>16}" for b in baselines))
        print(head, file=out)
        by_profile: dict[str, dict[str, dict]] = {}
        for rec in recs:
            by_profile.setdefault(rec["profile"], {})[rec["impl"]] = rec
        for profile, row in by_profile.items():
            f = row.get("flatopt", {})
            if "median_s" not in f:
                continue
            line = (f"{profile:<12}{f['n_tensors']:>8}{fmt_time(f['median_s']):>11}"
                    f"{f['gbps']:>7.1f}{f.get('pct_roofline', float('nan')):>7.0f}%")
            for b in baselines:
                r = row.get(b, {})
                cell = f"{r['speedup_of_flatopt']:.2f}" if "speedup_of_flatopt" in r else "-"
                line += f"{cell:>16}"
            print(line, file=out)
    print("\n'x baseline' = baseline time / flatopt time (above 1: flatopt is faster); "
          "'% roof' = roofline kernel time / flatopt time.", file=out)


def plot(records: list[dict], path: Path, optimizer: str, dtype: str, threads: int) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    recs = [r for r in records if r["optimizer"] == optimizer and r["dtype"] == dtype
            and r["threads"] == threads and "gbps" in r]
    if not recs:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    impls = list(dict.fromkeys(r["impl"] for r in recs))
    for impl in impls:
        pts = sorted((r["n_tensors"], r["elements_per_s"], r["profile"]) for r in recs
                     if r["impl"] == impl)
        style = dict(linestyle="--", color="black", marker="_") if impl == "roofline" else \
            dict(marker="o")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=impl, **style)
        if impl == "flatopt":
            for n, y, name in pts:
                ax.annotate(name, (n, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("number of tensors")
    ax.set_ylabel("elements per second")
    ax.set_title(f"{optimizer} {dtype} step throughput, {threads} thread(s) "
                 "(roofline: same bytes, trivial arithmetic)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def check_targets(records: list[dict], extras_result: dict | None) -> list[dict]:
    """Issue 4's targets, each with the figure measured, per optimizer and thread count."""
    idx = {(r["profile"], r["optimizer"], r["threads"], r["impl"]): r for r in records}
    rows = []

    def get(profile, optimizer, threads, impl, key):
        return idx.get((profile, optimizer, threads, impl), {}).get(key)

    for optimizer in dict.fromkeys(r["optimizer"] for r in records):
        for threads in sorted({r["threads"] for r in records}, reverse=True):
            where = f"{optimizer} {threads}T"

            def add(name, value, ok, text):
                if value is not None:
                    rows.append({"case": where, "target": name, "value": value, "met": ok,
                                 "text": text})

            fused = get("1x64M", optimizer, threads, "torch-fused", "speedup_of_flatopt")
            roof = get("1x64M", optimizer, threads, "flatopt", "pct_roofline")
            add("1x64M >= torch fused", fused, fused is not None and fused >= 1.0,
                f"{fused:.2f}x torch fused" if fused else "")
            add("1x64M >= 90% roofline", roof, roof is not None and roof >= 90,
                f"{roof:.0f}% of roofline" if roof else "")
            f10k = get("10000x1000", optimizer, threads, "torch-fused", "speedup_of_flatopt")
            add("10000x1000 >= 10x torch fused", f10k, f10k is not None and f10k >= 10,
                f"{f10k:.1f}x torch fused" if f10k else "")
            e10k = get("10000x1000", optimizer, threads, "flatopt", "elements_per_s")
            e1 = get("1x64M", optimizer, threads, "flatopt", "elements_per_s")
            if e10k and e1:
                add("10000x1000 within 20% of 1x64M", e10k / e1, e10k / e1 >= 0.8,
                    f"{e10k / 1e9:.2f} vs {e1 / 1e9:.2f} G elements/s ({100 * e10k / e1:.0f}%)")
            t100 = get("1000x100", optimizer, threads, "flatopt", "median_s")
            add("1000x100 step < 100 us", t100, t100 is not None and t100 < 100e-6,
                f"{t100 * 1e6:.0f} us" if t100 else "")
            f100 = get("1000x100", optimizer, threads, "torch-fused", "speedup_of_flatopt")
            add("1000x100 >= 30x torch fused", f100, f100 is not None and f100 >= 30,
                f"{f100:.0f}x torch fused" if f100 else "")
            fg = get("gpt2", optimizer, threads, "torch-fused", "speedup_of_flatopt")
            add("gpt2 >= torch fused", fg, fg is not None and fg >= 1.0,
                f"{fg:.2f}x torch fused" if fg else "")
    warm = (extras_result or {}).get("compile", {}).get("warm", {})
    if "Adam" in warm:
        first = warm["Adam"]["first_step_s"]
        rows.append({"case": "fresh process", "target": "warm-cache first step < 1 s",
                     "value": first, "met": first < 1.0,
                     "text": f"import {warm['import_s']:.2f} s + first Adam step {first:.3f} s"})
    return rows


def print_targets(rows: list[dict], out=sys.stdout) -> None:
    """Targets are judged with all cores; the 1-thread figures are shown for information."""
    if not rows:
        return
    threads = sorted({int(r["case"].split()[1][:-1]) for r in rows
                      if r["case"].endswith("T")}, reverse=True)
    print(f"\nTargets (issue 4), judged at {threads[0] if threads else '?'} threads "
          "(1-thread figures in brackets, for information):", file=out)
    by_key = {(r["case"], r["target"]): r for r in rows}
    for row in rows:
        case = row["case"]
        if case.endswith("T") and threads and case.split()[1] != f"{threads[0]}T":
            continue
        mark = "met   " if row["met"] else "MISSED"
        info = ""
        if case.endswith("T") and threads and threads[-1] != threads[0]:
            one = by_key.get((f"{case.split()[0]} {threads[-1]}T", row["target"]))
            if one:
                info = f"  [{threads[-1]}T: {one['text']}]"
        print(f"  [{mark}] {case:<14}{row['target']:<34}{row['text']}{info}", file=out)


def report_plots(records: list[dict], out: Path, dtype: str) -> None:
    for optimizer in dict.fromkeys(r["optimizer"] for r in records):
        for n in sorted({r["threads"] for r in records}):
            png = out / f"throughput_{optimizer}_{dtype}_{n}t.png"
            if plot(records, png, optimizer, dtype, n):
                print(f"wrote {png}")


def replay(path: Path, out: Path) -> int:
    """Tables and plots of a saved results.json, without measuring."""
    report = json.loads(path.read_text())
    records = report["records"]
    impls = list(dict.fromkeys(r["impl"] for r in records))
    print(f"machine: {report['machine']}")
    print_tables(records, impls)
    if report.get("extras"):
        extras.print_extras(report["extras"])
    print_targets(check_targets(records, report.get("extras")))
    out.mkdir(parents=True, exist_ok=True)
    report_plots(records, out, report["dtype"])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="Adam only, fewer rounds, smaller extras (a few minutes)")
    parser.add_argument("--profiles", nargs="+", choices=list(PROFILES), default=DEFAULT_ORDER)
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=ELEMENTWISE,
                        help="default: every element-wise optimizer (Muon on request)")
    parser.add_argument("--impls", nargs="+", default=None,
                        help=f"subset of {available_impls()}")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--threads", nargs="+", type=int, default=None,
                        help="thread counts to run (default: 1 and all cores)")
    parser.add_argument("--rounds", type=int, default=None, help="samples per implementation")
    parser.add_argument("--sample-seconds", type=float, default=0.02,
                        help="small steps are repeated to fill a sample of about this long")
    parser.add_argument("--no-extras", action="store_true",
                        help="skip compile time, latency, memory, checkpoint and in-loop "
                             "figures")
    parser.add_argument("--out", type=Path, default=Path("bench/results"),
                        help="folder for results.json and the PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    parser.add_argument("--from-json", type=Path, default=None, metavar="RESULTS_JSON",
                        help="measure nothing: print the tables and draw the plots of a saved "
                             "results.json")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        return replay(args.from_json, args.out)

    if args.quick:
        if args.optimizers == ELEMENTWISE:
            args.optimizers = ["adam"]
    rounds = args.rounds or (3 if args.quick else 7)
    threads = args.threads or sorted({1, max_threads()})
    impls = args.impls or available_impls()
    args.out.mkdir(parents=True, exist_ok=True)

    cases = [(p, o, t) for o in args.optimizers for p in args.profiles for t in threads]
    progress = Progress(len(cases) // len(threads), enabled=not args.quiet)
    records: list[dict] = []
    memory: list[dict] = []
    start = time.perf_counter()
    for profile_name in args.profiles:
        profile = PROFILES[profile_name]
        for optimizer in args.optimizers:
            label = f"{profile_name} {optimizer}"
            progress.show(f"{label}: building")
            case = Case(profile, optimizer, args.dtype)
            for n in threads:
                set_threads(n)
                results = measure_case(case, impls, rounds, args.sample_seconds, progress,
                                       f"{label} {n}T")
                for impl, res in results.items():
                    records.append({"profile": profile_name, "n_tensors": profile.n_tensors,
                                    "n_elements": profile.n_elements, "optimizer": optimizer,
                                    "dtype": args.dtype, "threads": n, "impl": impl,
                                    "bytes_per_element": bytes_per_element(optimizer, args.dtype),
                                    **res})
            memory.append(extras.memory_overhead(case))
            del case
            gc.collect()
            progress.advance()
    set_threads(max_threads())
    progress.finish()
    summarize(records)

    report = {"machine": machine_info(), "dtype": args.dtype, "rounds": rounds,
              "threads": threads, "records": records, "memory": memory,
              "runtime_s": None}
    print_tables(records, impls)
    print("\nMemory: optimizer state bytes per parameter element (flatopt incl. alignment "
          "padding and per-parameter arrays) against the algorithm's minimum")
    for m in memory:
        print(f"  {m['profile']:<12}{m['optimizer']:<7}state {m['state_bytes_per_element']:.3f}"
              f" B/elem (minimum {m['minimum_state_bytes_per_element']}), params+grads+state "
              f"{m['total_bytes_per_element']:.3f} B/elem")
    if not args.no_extras:
        progress = Progress(4, enabled=not args.quiet)
        report["extras"] = extras.run_all(quick=args.quick, dtype=args.dtype,
                                          progress=progress)
        progress.finish()
        extras.print_extras(report["extras"])
        progress = Progress(1, enabled=not args.quiet)
        progress.show("in-loop profiles (bench.inloop)")
        rows, bandwidth = inloop.measure(inloop.PROFILES, steps=20 if args.quick else 40)
        report["inloop"] = {"copy_bandwidth": bandwidth, "rows": rows}
        progress.finish()
        print("\nThe step in a training loop (python -m bench.inloop):")
        inloop.print_rows(rows, bandwidth)
    report["targets"] = check_targets(records, report.get("extras"))
    print_targets(report["targets"])
    report["runtime_s"] = time.perf_counter() - start
    path = args.out / "results.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {path}")
    report_plots(records, args.out, args.dtype)
    print(f"total {report['runtime_s']:.0f} s")
    return 0
