"""The training-loop tools around the step, against torch's equivalents: AdamW's step alone,
with global-norm clipping, and with clipping and an EMA of the weights, per profile.

flatopt: ``opt.step(max_grad_norm=1.0)`` (the norm pass, then the update with the clip factor
inside its own pass) and ``EMA.update()`` (one fused lerp per buffer). torch (CPU, fused AdamW):
``torch.nn.utils.clip_grad_norm_`` (foreach), ``opt.step()``, and the EMA as
``torch.optim.swa_utils.get_ema_multi_avg_fn`` computes it (``torch._foreach_lerp_``).

Run: ``python -m bench.training [--profiles 64x1M 10000x1000 1000x100] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import flatopt

from .impls import Case, torch, torch_settings
from .profiles import make_profiles

PROFILES = make_profiles()
DEFAULT_PROFILES = ["64x1M", "gpt2", "10000x1000", "1000x100"]
MAX_NORM = 1.0
DECAY = 0.999


def _median_seconds(step, rounds: int, min_seconds: float = 0.2) -> float:
    step()
    start = time.perf_counter()
    inner = 0
    while time.perf_counter() - start < 0.05 or inner < 3:
        step()
        inner += 1
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(inner):
            step()
        samples.append((time.perf_counter() - t0) / inner)
    return float(np.median(samples))


def flatopt_variants(case: Case) -> dict:
    opt = case.opt
    ema = flatopt.EMA(opt, decay=DECAY)

    def step_clip_ema():
        opt.step(max_grad_norm=MAX_NORM)
        ema.update()

    return {"step": lambda: opt.step(),
            "step+clip": lambda: opt.step(max_grad_norm=MAX_NORM),
            "step+clip+ema": step_clip_ema}


def torch_variants(case: Case) -> dict:
    params = []
    for path, view in case.opt.params.items():
        t = torch.from_numpy(view.copy()).requires_grad_(True)
        t.grad = torch.from_numpy(case.grads[path])
        params.append(t)
    opt = torch.optim.AdamW(params, **torch_settings(torch.optim.AdamW, case.settings),
                            fused=True)
    averages = [p.detach().clone() for p in params]

    @torch.no_grad()
    def step():
        opt.step()

    @torch.no_grad()
    def step_clip():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        opt.step()

    @torch.no_grad()
    def step_clip_ema():
        step_clip()
        torch._foreach_lerp_(averages, [p.detach() for p in params], 1.0 - DECAY)

    return {"step": step, "step+clip": step_clip, "step+clip+ema": step_clip_ema}


def measure(profile_names: list[str], rounds: int) -> list[dict]:
    rows = []
    for name in profile_names:
        case = Case(PROFILES[name], "adamw", "float32")
        ours = {k: _median_seconds(f, rounds) for k, f in flatopt_variants(case).items()}
        theirs = ({k: _median_seconds(f, rounds) for k, f in torch_variants(case).items()}
                  if torch is not None else {})
        rows.append({"profile": name, "flatopt": ours, "torch": theirs})
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:9.0f} us"


def print_rows(rows: list[dict]) -> None:
    variants = ["step", "step+clip", "step+clip+ema"]
    print("AdamW float32, all threads: flatopt vs torch fused AdamW + clip_grad_norm_ (foreach) "
          "+ foreach lerp EMA")
    print(f"{'profile':<12}" + "".join(f"{v:>30}" for v in variants))
    for row in rows:
        cells = []
        for v in variants:
            ours = row["flatopt"][v]
            theirs = row["torch"].get(v)
            ratio = f" ({theirs / ours:5.1f}x)" if theirs else ""
            cells.append(f"{_ms(ours)}{ratio}")
        print(f"{row['profile']:<12}" + "".join(f"{c:>30}" for c in cells))
    print("(Nx) = torch time / flatopt time; above 1, flatopt is faster.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.training",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", choices=list(PROFILES),
                        default=DEFAULT_PROFILES)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print_rows(measure(args.profiles, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
