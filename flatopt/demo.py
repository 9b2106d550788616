"""Demo: train a small NumPy MLP with flatopt (AdamW, warm-up + cosine schedule, gradient
clipping inside the step, an EMA of the weights) and print the loss curve and the optimizer's
step time.

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


def forward(p, x) -> tuple[np.ndarray, tuple]:
    h0 = np.tanh(x @ p["encoder.0.weight"] + p["encoder.0.bias"])
    s0 = h0 * p["encoder.norm.scale"]
    h1 = np.tanh(s0 @ p["encoder.1.weight"] + p["encoder.1.bias"])
    return h1 @ p["head.weight"] + p["head.bias"], (h0, s0, h1)


def forward_backward(p, g, x, y) -> float:
    """Mean squared error of a 2-hidden-layer tanh MLP; writes gradients into ``g``."""
    out, (h0, s0, h1) = forward(p, x)
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


def build_schedule(opt: flatopt.Optimizer, steps: int):
    """Linear warm-up over the first 5% of the steps, then cosine decay to 1% of the lr."""
    schedulers = flatopt.lr_scheduler
    warmup = max(1, steps // 20)
    cosine_steps = max(1, steps - warmup)
    eta_min = 0.01 * opt.param_groups[0]["lr"]
    return schedulers.SequentialLR(opt, [
        schedulers.LinearLR(opt, start_factor=0.01, total_iters=warmup),
        schedulers.CosineAnnealingLR(opt, T_max=cosine_steps, eta_min=eta_min)],
        milestones=[warmup])


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flatopt.demo",
        description="Train a small NumPy MLP with flatopt: AdamW with warm-up + cosine, "
                    "gradient clipping inside the step and an EMA of the weights; prints the "
                    "loss curve and the optimizer's step time.")
    parser.add_argument("--steps", type=_positive_int, default=300,
                        help="training steps (default 300)")
    parser.add_argument("--hidden", type=_positive_int, default=256,
                        help="hidden layer width (default 256)")
    parser.add_argument("--batch", type=_positive_int, default=512,
                        help="examples per step (default 512)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="max gradient norm, clipped inside the step (default 1.0)")
    parser.add_argument("--ema", type=float, default=0.99,
                        help="EMA decay of the weights, with warm-up (default 0.99)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save a checkpoint there at the end (inspect it with "
                             "`flatopt inspect PATH`)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    x, y = make_data(rng, 8192 + 2048, 32)
    x, y, x_eval, y_eval = x[:8192], y[:8192], x[8192:], y[8192:]  # a held-out split
    opt = build_optimizer(init_mlp(rng, 32, args.hidden), args.lr)
    sched = build_schedule(opt, args.steps)
    ema = flatopt.EMA(opt, decay=args.ema, warmup=True)
    p, g = opt.params, opt.grads
    n_elements = sum(info.size for info in opt.index)
    print(f"flatopt {flatopt.__version__} demo: AdamW on a {len(opt.index)}-tensor MLP, "
          f"{n_elements:,} parameters in {len(opt.buffers)} flat buffers; warm-up + cosine, "
          f"clip {args.clip}, EMA {args.ema}")
    for number, group in enumerate(opt.param_groups):
        print(f"  group {number} {group.get('label', '')!r}: {len(group['params'])} tensors, "
              f"weight_decay={group['weight_decay']}")

    step_seconds = []
    start = time.perf_counter()
    loss = float("nan")
    for step in range(1, args.steps + 1):
        batch = rng.integers(0, len(x), args.batch)
        loss = forward_backward(p, g, x[batch], y[batch])
        g.mark_present()
        t0 = time.perf_counter()
        result = opt.step(max_grad_norm=args.clip)
        elapsed = time.perf_counter() - t0
        ema.update()
        sched.step()
        if step == 1:
            print(f"first step (includes loading or compiling the kernels): "
                  f"{time.perf_counter() - start:.2f} s")
        else:
            step_seconds.append(elapsed)
        if step == 1 or step % max(1, args.steps // 15) == 0 or step == args.steps:
            bar = "#" * max(1, int(40 * min(loss, 1.0)))
            print(f"step {step:5d}  loss {loss:.5f}  |g| {result.grad_norm:7.3f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}  {bar}")
    eval_loss = float(np.mean((forward(p, x_eval)[0] - y_eval) ** 2))
    with ema.swapped():
        ema_loss = float(np.mean((forward(p, x_eval)[0] - y_eval) ** 2))
    print(f"held-out loss: weights {eval_loss:.5f}, EMA weights {ema_loss:.5f}")
    if step_seconds:
        median = float(np.median(step_seconds))
        print(f"optimizer step (AdamW + clipping): median {median * 1e6:.1f} us, "
              f"{n_elements / median / 1e6:.1f} M elements/s")
    else:
        print("optimizer step: one step only, no steady-state timing (use --steps 2 or more)")
    if args.checkpoint:
        t0 = time.perf_counter()
        flatopt.save(args.checkpoint, opt, scheduler=sched,
                     metadata={"step": args.steps, "seed": args.seed, "loss": loss})
        print(f"checkpoint saved to {args.checkpoint} in {time.perf_counter() - t0:.3f} s "
              f"(flatopt inspect {args.checkpoint})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
