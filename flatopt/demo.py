"""Demo: train a small NumPy MLP on generated data with flatopt, print the loss curve and the
optimizer's step throughput.

    python -m flatopt.demo [--steps 300] [--hidden 256] [--seed 0] [--checkpoint PATH]

Backprop writes every gradient straight into flatopt's flat gradient buffer (``out=``), so the
optimizer step reads and writes contiguous memory with no copies.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import flatopt


def make_data(rng: np.random.Generator, n: int, d_in: int) -> tuple[np.ndarray, np.ndarray]:
    """A smooth nonlinear regression target the MLP can learn."""
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    w = rng.standard_normal((d_in, 1)).astype(np.float32) / np.sqrt(d_in)
    y = np.sin(2.0 * x @ w) + 0.5 * np.tanh(x[:, :1] * x[:, 1:2])
    return x, y.astype(np.float32)


def init_mlp(rng: np.random.Generator, d_in: int, hidden: int) -> dict[str, np.ndarray]:
    def dense(fan_in, fan_out):
        return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)
    return {
        "encoder.0.weight": dense(d_in, hidden),
        "encoder.0.bias": np.zeros(hidden, np.float32),
        "encoder.norm.scale": np.ones(hidden, np.float32),
        "encoder.1.weight": dense(hidden, hidden),
        "encoder.1.bias": np.zeros(hidden, np.float32),
        "head.weight": dense(hidden, 1),
        "head.bias": np.zeros(1, np.float32),
    }


def forward_backward(p, g, x, y) -> float:
    """Mean squared error of a 2-hidden-layer tanh MLP; writes gradients into ``g``."""
    h0 = np.tanh(x @ p["encoder.0.weight"] + p["encoder.0.bias"])
    s0 = h0 * p["encoder.norm.scale"]
    h1 = np.tanh(s0 @ p["encoder.1.weight"] + p["encoder.1.bias"])
    out = h1 @ p["head.weight"] + p["head.bias"]
    diff = out - y
    loss = float(np.mean(diff * diff))
    d_out = (2.0 / diff.size) * diff
    np.matmul(h1.T, d_out, out=g["head.weight"])
    np.sum(d_out, axis=0, out=g["head.bias"])
    d_h1 = (d_out @ p["head.weight"].T) * (1.0 - h1 * h1)
    np.matmul(s0.T, d_h1, out=g["encoder.1.weight"])
    np.sum(d_h1, axis=0, out=g["encoder.1.bias"])
    d_s0 = d_h1 @ p["encoder.1.weight"].T
    np.sum(d_s0 * h0, axis=0, out=g["encoder.norm.scale"])
    d_h0 = d_s0 * p["encoder.norm.scale"] * (1.0 - h0 * h0)
    np.matmul(x.T, d_h0, out=g["encoder.0.weight"])
    np.sum(d_h0, axis=0, out=g["encoder.0.bias"])
    return loss


def build_optimizer(params: dict[str, np.ndarray], lr: float) -> flatopt.AdamW:
    groups = flatopt.group_by_pattern(params, [
        {"match": ["*.bias", "*norm*"], "weight_decay": 0.0, "label": "no_decay"},
    ], rest={"label": "decay"})
    return flatopt.AdamW(groups, lr=lr, weight_decay=0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save a checkpoint there at the end (inspect it with "
                             "`flatopt inspect PATH`)")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    x, y = make_data(rng, 8192, 32)
    opt = build_optimizer(init_mlp(rng, 32, args.hidden), args.lr)
    p, g = opt.params, opt.grads
    n_elements = sum(info.size for info in opt.index)
    print(f"flatopt {flatopt.__version__} demo: AdamW on a {len(opt.index)}-tensor MLP, "
          f"{n_elements:,} parameters in {len(opt.buffers)} flat buffers")
    for number, group in enumerate(opt.param_groups):
        print(f"  group {number} {group.get('label', '')!r}: {len(group['params'])} tensors, "
              f"lr={group['lr']}, weight_decay={group['weight_decay']}")

    step_seconds = []
    compile_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = rng.integers(0, len(x), args.batch)
        loss = forward_backward(p, g, x[batch], y[batch])
        g.mark_present()
        start = time.perf_counter()
        opt.step()
        elapsed = time.perf_counter() - start
        if step == 1:
            print(f"first step (includes kernel compile or cache load): "
                  f"{time.perf_counter() - compile_start:.2f} s")
        else:
            step_seconds.append(elapsed)
        if step == 1 or step % max(1, args.steps // 15) == 0 or step == args.steps:
            bar = "#" * max(1, int(40 * min(loss, 1.0)))
            print(f"step {step:5d}  loss {loss:.5f}  {bar}")
    median = float(np.median(step_seconds)) if step_seconds else float("nan")
    print(f"optimizer step: median {median * 1e6:.1f} us, "
          f"{n_elements / median / 1e6:.1f} M elements/s")
    if args.checkpoint:
        start = time.perf_counter()
        flatopt.save(args.checkpoint, opt, metadata={"step": args.steps, "seed": args.seed,
                                                      "loss": loss})
        print(f"checkpoint saved to {args.checkpoint} in "
              f"{time.perf_counter() - start:.3f} s (flatopt inspect {args.checkpoint})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
