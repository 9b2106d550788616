"""The step where users run it: right after a NumPy forward/backward, against the same step back
to back and after a single-threaded pass over as much memory (the cache effect alone), also while
another process keeps a core busy.

Each profile is an AdamW optimizer in two groups (weights with decay, the rest without) whose
gradients are present every step:

- ``mlp74k``: the demo's MLP (74,753 parameters); its real forward/backward writes the gradients.
- ``1000x100``, ``64x16K``, ``1x4M``: synthetic tensors; the "forward/backward" is two 512 x 512
  float32 matmuls (BLAS on every core, its threads still spinning when the step starts).

Variants: ``step``; ``clip`` (``step(max_grad_norm=1.0)``); ``clip+sched`` (clipping, and a
cosine schedule changing ``lr`` of both groups before every step). Conditions, each timed over
the step call alone (median of ``--steps`` steps):

- ``b2b``: back to back.
- ``flush``: after a single-threaded pass that reads and writes as many bytes as the
  forward/backward's arrays hold.
- ``matmul``: after the forward/backward.
- ``flush+busy`` / ``matmul+busy``: the same while another process spins on one core.

``cold bound`` is the step's bytes (``Schema.bytes_per_element``, plus one gradient read per
clipping norm pass) at this machine's single-threaded copy bandwidth, twice, plus 100 us: the most
a step cold in cache should cost when nothing else (thread wake-ups, parallel launches) is added.

``--storage`` runs the synthetic profiles with reduced-precision storage (the rows of
``python -m bench.precision``): ``bf16`` (bfloat16 parameters and gradients, bfloat16 state,
stochastic rounding) or ``int8`` (float32 parameters, 8-bit state); the cold bound then counts
the stored bytes (``bench.precision.traffic``).

Run: ``python -m bench.inloop [--profiles ...] [--steps 40] [--storage float32|bf16|int8]``;
``--json PATH`` keeps the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time

import numpy as np

import flatopt
from flatopt import demo

from .precision import BFLOAT16, format_bytes, traffic

SYNTHETIC = {"1000x100": (1000, 100), "64x16K": (64, 1 << 14), "1x4M": (1, 1 << 22)}
PROFILES = ["mlp74k", *SYNTHETIC]
VARIANTS = ["step", "clip", "clip+sched"]
CONDITIONS = ["b2b", "flush", "matmul", "flush+busy", "matmul+busy"]
MATMUL_N = 512
STORAGES = {"float32": ("float32", {}),
            "bf16": ("bfloat16", {"state_dtype": "bfloat16", "rounding": "stochastic"}),
            "int8": ("float32", {"state_dtype": "int8"})}
"""``--storage``: the parameters' dtype and the optimizer's storage settings."""


class Loop:
    """One profile's optimizer and its forward/backward."""

    def __init__(self, profile: str, seed: int = 0, storage: str = "float32"):
        rng = np.random.default_rng(seed)
        self.param_dtype, options = STORAGES[storage]
        self.options = options
        if profile == "mlp74k" and storage != "float32":
            raise ValueError("the mlp74k profile computes in float32: --storage takes the "
                             "synthetic profiles")
        if profile == "mlp74k":
            params = demo.init_mlp(rng, 32, 256)
            x, y = demo.make_data(rng, 8192, 32)
            self.opt = demo.build_optimizer(params, 3e-3)
            p, g = self.opt.params, self.opt.grads

            def forward_backward():
                batch = rng.integers(0, len(x), 512)
                demo.forward_backward(p, g, x[batch], y[batch])
            # x, the activations of both layers and their gradients (float32)
            self.fb_bytes = 4 * (512 * 32 + 10 * 512 * 256)
        else:
            count, size = SYNTHETIC[profile]
            dtype = BFLOAT16 if self.param_dtype == "bfloat16" else np.float32
            params = {f"layer{k}.weight" if k % 2 == 0 else f"layer{k}.bias":
                      rng.standard_normal(size).astype(dtype) for k in range(count)}
            if count == 1:
                params["final.bias"] = np.zeros(16, dtype)  # a second group, as every model has
            groups = flatopt.group_by_pattern(params, [
                {"match": ["*.bias"], "weight_decay": 0.0}], rest={})
            self.opt = flatopt.AdamW(groups, lr=1e-3, weight_decay=0.05, **options)
            for path, view in self.opt.grads.items():
                view[...] = rng.standard_normal(view.shape, dtype=np.float32) * 1e-3
            a, b, c = (rng.standard_normal((MATMUL_N, MATMUL_N)).astype(np.float32)
                       for _ in range(3))
            out = np.empty_like(a)

            def forward_backward():
                np.matmul(a, b, out=out)
                np.matmul(out, c, out=out)
            self.fb_bytes = 4 * 4 * MATMUL_N * MATMUL_N
        self.forward_backward = forward_backward
        self.flush_buffer = np.ones(self.fb_bytes // 8, np.float64)
        self.n_elements = sum(info.size for info in self.opt.index)

    def flush(self) -> None:
        np.add(self.flush_buffer, 1.0, out=self.flush_buffer)  # one thread, reads and writes

    def step_bytes(self, clip: bool) -> float:
        """The bytes a step reads and writes (one more gradient read for the clipping norm)."""
        grad = format_bytes(self.param_dtype)
        if self.options:
            sizes = tuple(info.size for info in self.opt.index)
            per = traffic(self.param_dtype, self.options["state_dtype"],
                          rounding=self.options.get("rounding", "nearest"), sizes=sizes)
        else:
            per = self.opt.schema.bytes_per_element(self.opt.settings()[0], 4)
        return (per + (grad if clip else 0)) * self.n_elements


def copy_bandwidth() -> float:
    """Single-threaded copy bandwidth (bytes read + written per second), 256 MiB arrays."""
    src = np.ones(1 << 25)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


@contextlib.contextmanager
def busy_core():
    """Another process spinning on one core (a data-loading worker)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.2)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def time_condition(loop: Loop, variant: str, condition: str, steps: int) -> float:
    opt = loop.opt
    clip = 1.0 if variant != "step" else None
    sched = None
    if variant == "clip+sched":
        sched = flatopt.lr_scheduler.CosineAnnealingLR(opt, T_max=1000, eta_min=1e-5)
    before = {"b2b": None, "flush": loop.flush, "matmul": loop.forward_backward}[
        condition.split("+")[0]]
    opt.grads.mark_present()
    opt.step(max_grad_norm=clip)  # warm: kernels loaded, state allocated
    samples = []
    for _ in range(steps):
        if before is not None:
            before()
        opt.grads.mark_present()
        t0 = time.perf_counter()
        opt.step(max_grad_norm=clip)
        samples.append(time.perf_counter() - t0)
        if sched is not None:
            sched.step()
    if sched is not None:
        for group in opt.param_groups:  # the next variant starts from the same lr
            group["lr"] = group["initial_lr"]
    return float(np.median(samples))


def python_cost(steps: int = 20000) -> dict:
    """Seconds per step of a 2-group AdamW over 12 elements (the kernels' own work is nil):
    ``opt.step()`` with fixed values, and ``opt.step(); sched.step()`` with a cosine schedule
    changing both groups' ``lr`` every step."""
    params = {"w": np.ones(8, np.float32), "b": np.ones(4, np.float32)}
    opt = flatopt.AdamW(flatopt.group_by_pattern(params, [{"match": ["b"], "weight_decay": 0.0}],
                                                 rest={}), lr=1e-3, weight_decay=0.05)
    opt.grads.mark_present()
    sched = flatopt.lr_scheduler.CosineAnnealingLR(opt, T_max=10 * steps)

    def scheduled():
        opt.step()
        sched.step()

    result = {}
    for name, step in (("fixed", opt.step), ("scheduled", scheduled)):
        for _ in range(100):
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        result[name] = (time.perf_counter() - start) / steps
    return result


def measure(profiles: list[str], steps: int, storage: str = "float32"
            ) -> tuple[list[dict], float]:
    bandwidth = copy_bandwidth()
    rows = []
    for profile in profiles:
        loop = Loop(profile, storage=storage)
        for variant in VARIANTS:
            row = {"profile": profile, "variant": variant, "elements": loop.n_elements,
                   "storage": storage}
            for condition in CONDITIONS:
                with busy_core() if condition.endswith("+busy") else contextlib.nullcontext():
                    row[condition] = time_condition(loop, variant, condition, steps)
            row["cold_bound"] = 2 * loop.step_bytes(variant != "step") / bandwidth + 100e-6
            rows.append(row)
    return rows, bandwidth


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:8.0f}"


def print_rows(rows: list[dict], bandwidth: float) -> None:
    print(f"single-threaded copy bandwidth {bandwidth / 1e9:.1f} GB/s; times in us (median)")
    print(f"{'profile':<9}{'variant':<11}" + "".join(f"{c:>12}" for c in CONDITIONS)
          + f"{'cold bound':>12}{'mm/flush':>10}{'busy':>7}{'mm/bound':>10}{'busy':>7}")
    for row in rows:
        ratios = (row["matmul"] / row["flush"], row["matmul+busy"] / row["flush+busy"],
                  row["matmul"] / row["cold_bound"], row["matmul+busy"] / row["cold_bound"])
        print(f"{row['profile']:<9}{row['variant']:<11}"
              + "".join(f"{_us(row[c]):>12}" for c in CONDITIONS)
              + f"{_us(row['cold_bound']):>12}"
              + "".join(f"{r:>{w}.2f}" for r, w in zip(ratios, (10, 7, 10, 7))))
    print("targets: mm/flush <= 1.3 (after the matmuls vs after a single-threaded pass); "
          "mm/bound <= 1 (within the cold bound); 'busy': the same with a core busy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inloop",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", choices=PROFILES, default=None,
                        help="default: all (the synthetic ones with --storage)")
    parser.add_argument("--steps", type=int, default=40, help="steps timed per condition")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows there")
    parser.add_argument("--storage", choices=list(STORAGES), default="float32",
                        help="reduced-precision storage (see the module docstring)")
    args = parser.parse_args(argv)
    profiles = args.profiles or (PROFILES if args.storage == "float32" else list(SYNTHETIC))
    if args.storage != "float32" and "mlp74k" in profiles:
        parser.error("the mlp74k profile computes in float32: --storage takes the synthetic "
                     "profiles")
    rows, bandwidth = measure(profiles, args.steps, args.storage)
    print_rows(rows, bandwidth)
    cost = python_cost()
    print(f"per-step cost of a 2-group AdamW over 12 elements (Python, and two kernel calls of "
          f"nothing): {cost['fixed'] * 1e6:.1f} us; with a scheduler changing lr every step "
          f"(sched.step() included): {cost['scheduled'] * 1e6:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth": bandwidth, "rows": rows, "python_cost": cost}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
