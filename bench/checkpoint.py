"""Checkpoint throughput and memory, side by side in one process: ``flatopt.save`` (fsync
included), a background save's pause (the snapshot copy), ``flatopt.load`` into a fresh
optimizer (a resume: state slots allocated by the load) and into one with state (overwritten
in place, with the undo copy), ``flatopt verify``, against ``np.save`` + fsync and ``np.load``
of the same flat buffers (params and every state slot, one .npy file each). Samples are
interleaved, the order rotating each round; medians. Peak RSS is sampled on a thread (every
2 ms) and reported as the increase over the RSS before the operation. ``os.sync()`` runs
before every sample, so that no sample pays for the writeback of the one before it; the
background save's snapshot memory is allocated once before the samples (it is reused, as in
training).

    python -m bench.checkpoint                       # 1x64M, 64x1M, gpt2; Adam float32
    python -m bench.checkpoint --profiles 64x1M --rounds 5 --json out.json

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

DEFAULT_PROFILES = ["1x64M", "64x1M", "gpt2"]
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
            rounds: int = 3, directory: str | None = None) -> dict:
    case = Case(PROFILES[profile_name], optimizer, dtype)
    opt = case.opt
    opt.step()  # every state slot exists
    arrays = [a for buf in opt.buffers for a in (buf.params, *buf.state.values())]
    nbytes = sum(a.nbytes for a in arrays)
    live = _empty_like_case(case)
    samples: dict[str, list] = {}

    def record(name: str, seconds: float, peak: PeakRSS | None = None) -> None:
        samples.setdefault(name, []).append((seconds, peak.delta if peak else 0))

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
            with PeakRSS() as peak:
                t0 = time.perf_counter()
                result = operation(argument)
                seconds = time.perf_counter() - t0
            record(name, seconds, peak)
            del result, argument

        flatopt.save(ckpt, opt, background=True).wait()  # the snapshot memory, allocated
        names = list(ops)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                sample(name)
        file_bytes = ckpt.stat().st_size
    res = {"profile": profile_name, "optimizer": optimizer, "dtype": dtype, "bytes": nbytes,
           "file_bytes": file_bytes, "rounds": rounds, "io_threads": files.io_threads(),
           "page_cache": "hot"}
    for name, values in samples.items():
        seconds = float(np.median([s for s, _ in values]))
        res[name] = {"s": seconds, "gbps": nbytes / seconds / 1e9,
                     "peak_rss_mb": max(m for _, m in values) / 1e6}
    for ours, theirs in (("flatopt_save", "np_save"), ("flatopt_load_fresh", "np_load"),
                         ("flatopt_load_live", "np_load")):
        res[f"{ours}_over_{theirs}"] = res[ours]["s"] / res[theirs]["s"]
    return res


def run(profiles=None, rounds: int = 3, optimizer: str = "adam", dtype: str = "float32",
        directory: str | None = None, progress=None) -> list[dict]:
    out = []
    for name in profiles or DEFAULT_PROFILES:
        if progress is not None:
            progress(f"checkpoint {name}")
        out.append(measure(name, optimizer, dtype, rounds, directory))
    return out


def print_table(results: list[dict]) -> None:
    print("\nCheckpoint throughput (median; GB/s of buffers; peak RSS increase; page cache "
          "hot, fsync included in saves):")
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
            memory = ("" if key in ("background_pause", "background_copy")
                      else f"{r['peak_rss_mb']:8.0f} MB")
            print(f"    {label:<34} {r['s'] * 1e3:9.1f} ms {r['gbps']:7.2f} GB/s {memory}")
        print(f"    save / np.save {res['flatopt_save_over_np_save']:.2f}x; load / np.load "
              f"{res['flatopt_load_fresh_over_np_load']:.2f}x (fresh), "
              f"{res['flatopt_load_live_over_np_load']:.2f}x (state overwritten)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=DEFAULT_PROFILES,
                        choices=sorted(PROFILES), help="shape profiles to measure")
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--rounds", type=int, default=3, help="samples per measurement")
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    results = run(args.profiles, args.rounds, args.optimizer, args.dtype, args.dir,
                  progress=lambda text: print(f"... {text}", flush=True))
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
