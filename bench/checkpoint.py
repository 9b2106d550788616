"""Checkpoint throughput and memory, side by side in one process: ``flatopt.save`` (fsync
included), a background save's pause (the snapshot copy), ``flatopt.load`` into a fresh
optimizer (a resume: state slots allocated by the load) and into one with state (overwritten
in place, with the undo copy, at the default ``staging``), ``flatopt verify``, against
``np.save`` + fsync and ``np.load`` of the same flat buffers (params and every state slot, one
.npy file each). Samples are interleaved, the order rotating each round; medians, and the
best of the rounds. The timed samples run alone, as a user would run them (no sampling thread):
peak RSS is measured in separate, untimed runs of each operation afterwards (sampled on a
thread every 2 ms, the increase over the RSS before the operation). ``os.sync()`` runs
before every sample, so that no sample pays for the writeback of the one before it; the
background save's snapshot memory is allocated once before the samples (it is reused, as in
training).

    python -m bench.checkpoint                       # 1x64M, 32x1M, gpt2; Adam float32
    python -m bench.checkpoint --profiles 32x1M --rounds 5 --ops load --json out.json

The page cache is hot: every file read was just written (the figures measure flatopt's work,
not the disk's read speed); the saves' fsync does go to the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import flatopt
from flatopt.checkpoint import files, verify_checkpoint

from .impls import OPTIMIZERS, Case, settings_of
from .profiles import PROFILES

DEFAULT_PROFILES = ["1x64M", "32x1M", "gpt2"]
OPS = {"save": ["flatopt_save", "np_save", "background_total"],
       "load": ["flatopt_load_fresh", "np_load", "flatopt_load_live"],
       "verify": ["verify"]}
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * _PAGE


class PeakRSS:
    """Context manager: the peak resident memory above the start, sampled on a thread."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.peak = self.start = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def delta(self) -> int:
        return self.peak - self.start


def np_save_all(directory: Path, arrays: list[np.ndarray]) -> list[Path]:
    """np.save each array to its own file, fsync each and the directory (as flatopt does)."""
    paths = []
    for k, array in enumerate(arrays):
        path = directory / f"buffer{k}.npy"
        with open(path, "wb") as handle:
            np.save(handle, array)
            handle.flush()
            os.fsync(handle.fileno())
        paths.append(path)
    files.fsync_path(str(directory), directory=True)
    return paths


def _empty_like_case(case: Case) -> flatopt.Optimizer:
    """An optimizer of the same structure as the case's, without state (a resume target)."""
    cls = type(case.opt)
    params = [(info.path, np.zeros(info.shape, info.dtype)) for info in case.opt.index]
    return cls(params, **settings_of(case.optimizer))


def measure(profile_name: str, optimizer: str = "adam", dtype: str = "float32",
            rounds: int = 3, directory: str | None = None, ops=None,
            memory: bool = True) -> dict:
    case = Case(PROFILES[profile_name], optimizer, dtype)
    opt = case.opt
    opt.step()  # every state slot exists
    arrays = [a for buf in opt.buffers for a in (buf.params, *buf.state.values())]
    nbytes = sum(a.nbytes for a in arrays)
    live = _empty_like_case(case)
    samples: dict[str, list] = {}
    selected = None if ops is None else {name for op in ops for name in OPS[op]}

    peaks: dict[str, int] = {}
    timing = [True]  # False during the memory runs: their times are not recorded

    def record(name: str, seconds: float) -> None:
        if timing[0]:
            samples.setdefault(name, []).append(seconds)

    with tempfile.TemporaryDirectory(prefix="flatopt-bench-ckpt-", dir=directory) as tmp:
        tmp = Path(tmp)
        ckpt = tmp / "ckpt.h5"
        npdir = tmp / "npy"
        npdir.mkdir()
        flatopt.save(ckpt, opt)
        flatopt.load(ckpt, live)  # from now on it has state: loads overwrite it in place
        np_paths = np_save_all(npdir, arrays)

        def background_save():
            t0 = time.perf_counter()
            handle = flatopt.save(ckpt, opt, background=True)
            record("background_pause", time.perf_counter() - t0)  # the training loop's wait
            record("background_copy", handle.copy_seconds)  # of which the buffers' copy
            handle.wait()

        def verified():
            if not verify_checkpoint(ckpt)["ok"]:
                raise RuntimeError(f"{ckpt} does not verify")

        # name -> (what to build before the clock starts, or None; the measured operation)
        ops = {"flatopt_save": (None, lambda _: flatopt.save(ckpt, opt)),
               "np_save": (None, lambda _: np_save_all(npdir, arrays)),
               "background_total": (None, lambda _: background_save()),
               "flatopt_load_fresh": (lambda: _empty_like_case(case),
                                      lambda target: flatopt.load(ckpt, target)),
               "np_load": (None, lambda _: [np.load(path) for path in np_paths]),
               "flatopt_load_live": (None, lambda _: flatopt.load(ckpt, live)),
               "verify": (None, lambda _: verified())}

        def sample(name: str) -> None:
            prepare, operation = ops[name]
            argument = prepare() if prepare else None
            os.sync()  # the previous write's dirty pages go to disk now, not in this sample
            t0 = time.perf_counter()
            result = operation(argument)
            seconds = time.perf_counter() - t0
            record(name, seconds)
            del result, argument

        def sample_memory(name: str) -> None:
            prepare, operation = ops[name]
            argument = prepare() if prepare else None
            os.sync()
            with PeakRSS() as peak:
                result = operation(argument)
            peaks[name] = peak.delta
            del result, argument

        flatopt.save(ckpt, opt, background=True).wait()  # the snapshot memory, allocated
        names = [name for name in ops if selected is None or name in selected]
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                sample(name)
        if memory:
            timing[0] = False
            for name in names:
                sample_memory(name)
        file_bytes = ckpt.stat().st_size
    res = {"profile": profile_name, "optimizer": optimizer, "dtype": dtype, "bytes": nbytes,
           "file_bytes": file_bytes, "rounds": rounds, "io_threads": files.io_threads(),
           "page_cache": "hot"}
    for name, values in samples.items():
        seconds = float(np.median(values))
        res[name] = {"s": seconds, "best_s": float(min(values)), "gbps": nbytes / seconds / 1e9}
        if name in peaks:
            res[name]["peak_rss_mb"] = peaks[name] / 1e6
    for ours, theirs in (("flatopt_save", "np_save"), ("flatopt_load_fresh", "np_load"),
                         ("flatopt_load_live", "np_load")):
        if ours in res and theirs in res:
            res[f"{ours}_over_{theirs}"] = res[ours]["s"] / res[theirs]["s"]
            res[f"{ours}_over_{theirs}_best"] = res[ours]["best_s"] / res[theirs]["best_s"]
    return res


def run(profiles=None, rounds: int = 3, optimizer: str = "adam", dtype: str = "float32",
        directory: str | None = None, progress=None, ops=None, memory: bool = True
        ) -> list[dict]:
    out = []
    for name in profiles or DEFAULT_PROFILES:
        if progress is not None:
            progress(f"checkpoint {name}")
        out.append(measure(name, optimizer, dtype, rounds, directory, ops, memory))
    return out


def print_table(results: list[dict]) -> None:
    print("\nCheckpoint throughput (median and best; GB/s of buffers at the median; peak RSS "
          "increase, from separate runs; page cache hot, fsync included in saves):")
    rows = [("flatopt.save", "flatopt_save"), ("np.save + fsync", "np_save"),
            ("background save: pause", "background_pause"),
            ("  of which the copy", "background_copy"),
            ("background save: committed", "background_total"),
            ("flatopt.load (fresh optimizer)", "flatopt_load_fresh"),
            ("flatopt.load (state overwritten)", "flatopt_load_live"),
            ("np.load", "np_load"), ("flatopt verify", "verify")]
    for res in results:
        print(f"  {res['profile']} {res['optimizer']} {res['dtype']}: {res['bytes'] / 1e6:.0f} "
              f"MB of buffers, file {res['file_bytes'] / 1e6:.0f} MB, {res['rounds']} rounds, "
              f"{res['io_threads']} I/O threads")
        for label, key in rows:
            r = res.get(key)
            if r is None:
                continue
            memory = ("" if "peak_rss_mb" not in r else f"{r['peak_rss_mb']:8.0f} MB")
            print(f"    {label:<34} {r['s'] * 1e3:9.1f} ms (best {r['best_s'] * 1e3:9.1f}) "
                  f"{r['gbps']:7.2f} GB/s {memory}")
        for ours, theirs, label in (("flatopt_save", "np_save", "save / np.save"),
                                    ("flatopt_load_fresh", "np_load", "load / np.load (fresh)"),
                                    ("flatopt_load_live", "np_load",
                                     "load / np.load (state overwritten)")):
            key = f"{ours}_over_{theirs}"
            if key in res:
                print(f"    {label:<34} {res[key]:.2f}x median, {res[key + '_best']:.2f}x best")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=DEFAULT_PROFILES,
                        choices=sorted(PROFILES), help="shape profiles to measure")
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--rounds", type=int, default=3, help="samples per measurement")
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--ops", nargs="+", default=None, choices=sorted(OPS),
                        help="operations to measure (default: all)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the separate peak-RSS runs")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    results = run(args.profiles, args.rounds, args.optimizer, args.dtype, args.dir,
                  progress=lambda text: print(f"... {text}", flush=True), ops=args.ops,
                  memory=not args.no_memory)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
