"""One command for a GPU machine: the CUDA tests for real, device results against the CPU
optimizer, the kernels ``bench/cuda_static.py`` compiles run in the configurations that
launch them and compared bit for bit with the CPU's, a training loop whose gradients torch
writes straight into ``opt.grads`` (then a checkpoint from the GPU loaded on the CPU),
reduced-precision buffers on the device against the CPU's bytes and timed against float32,
and the full ``opt.step()`` timed against torch's fused CUDA AdamW and a device copy of the
same bytes. Prints one table; writes ``$OUT/gpu_check.json`` when ``OUT`` is set.

    NUMBA_ENABLE_CUDASIM=0 python -m bench.gpu_check            # on a GPU, < 5 minutes
    python -m bench.gpu_check --simulate                         # small, in Numba's simulator

Every section runs on its own (an error is reported and the next section runs), and nothing is
installed: it uses what the machine has (numba-cuda, torch with CUDA if present).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np

ADAM_BYTES_PER_ELEMENT = 28  # reads p, g, m, v (16 B) and writes p, m, v (12 B) in float32


def gpt2_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small (124M): embeddings, 12 blocks, final layer norm."""
    shapes = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
                   (768, 3072), (3072,), (3072, 768), (768,)]
    return shapes + [(768,), (768,)]


PROFILES = {
    "1 x 64M": [(1 << 26,)],
    "64 x 1M": [(1 << 20,)] * 64,
    "GPT-2 (124M)": gpt2_shapes(),
    "10,000 x 1,000": [(1000,)] * 10_000,
    "1,000 x 100": [(100,)] * 1000,
}
SIMULATED_PROFILES = {"1 x 4K": [(4096,)], "8 x 300": [(300,)] * 8}


def section(report: dict, name: str):
    """Run a section, recording its result or its error (with the traceback's last lines)."""
    def decorate(function):
        start = time.perf_counter()
        try:
            report[name] = {"ok": True, **(function() or {})}
        except Exception as exc:  # each section stands alone: report and go on
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc().splitlines()[-6:]}
            print(f"[{name}] FAILED: {type(exc).__name__}: {exc}", flush=True)
        report[name]["seconds"] = round(time.perf_counter() - start, 1)
        return function
    return decorate


def environment() -> dict:
    from flatopt import _device
    from flatopt.kernels._cuda_import import numba_cuda, simulated
    import numba
    cuda = numba_cuda()
    info = {"python": sys.version.split()[0], "numpy": np.__version__,
            "numba": numba.__version__, "simulated": simulated(),
            "cuda_problem": _device.cuda_problem()}
    try:
        import numba_cuda as package
        info["numba_cuda"] = getattr(package, "__version__", "?")
    except ImportError:
        info["numba_cuda"] = None
    if not simulated():
        device = cuda.get_current_device()
        info["gpu"] = device.name.decode() if isinstance(device.name, bytes) else device.name
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.cuda.is_available()
    except ImportError:
        info["torch"] = None
    return info


def run_tests(simulate: bool, timeout: float) -> dict:
    """The CUDA test files, on the GPU (or the simulator): pass/fail counts and the tail."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1" if simulate else "0")
    selection = ["-k", "Adam and not AdamW or device_argument"] if simulate else []
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-p", "no:cacheprovider",
               "tests/test_cuda_kernels.py", "tests/test_cuda_device.py",
               "tests/test_cuda_precision.py", *selection]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=root)
    except subprocess.TimeoutExpired as exc:  # keep the budget: report how far it got
        output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise RuntimeError(f"the CUDA tests did not finish in {timeout:.0f} s (raise "
                           f"--tests-timeout); progress so far: {output.strip()[-300:]!r}")
    tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
    if done.returncode:
        raise RuntimeError(f"CUDA tests failed: {' | '.join(tail[-8:])}")
    return {"returncode": done.returncode, "summary": tail[-1] if tail else "", "tail": tail}


def host(array) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.copy_to_host()


def compare_with_cpu(names, steps: int = 3) -> dict:
    """Every registered optimizer, float32, two groups, some gradients missing: the device
    optimizer (plain and bit_exact) against the CPU one. Counts differing elements."""
    import flatopt
    rows = {}
    rng = np.random.default_rng(0)
    for name in names:
        cls = flatopt.registry.lookup(name)
        schema = cls.schema
        shapes = {"w": (64, 300), "b": (300,), "x": (17, 33)}
        if schema.param_problem is not None:
            shapes = {k: s if schema.param_problem(s) is None else (s[0], 1) if len(s) == 1
                      else s for k, s in shapes.items()}
        params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()
                  if k != "x" or step % 2} for step in range(steps)]
        try:
            results = {}
            for label, kwargs in (("cpu", {}), ("cuda", {"device": "cuda"}),
                                  ("cuda_bit_exact", {"device": "cuda", "bit_exact": True})):
                opt = cls({k: v.copy() for k, v in params.items()}, **kwargs)
                for g in grads:
                    opt.step(g)
                results[label] = np.concatenate(
                    [host(opt.params[k]).ravel() for k in shapes] +
                    [np.asarray(v, np.float64).ravel().astype(np.float32)
                     for k in shapes for v in (opt.state_of(k) or ())
                     if isinstance(v, np.ndarray)])
            row = {}
            for label in ("cuda", "cuda_bit_exact"):
                diff = results[label] != results["cpu"]
                row[label] = {"differing": int(diff.sum()), "of": int(diff.size),
                              "max_abs": float(np.max(np.abs(results[label] - results["cpu"]),
                                                      initial=0.0))}
            rows[name] = row
        except Exception as exc:
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
    exact_ok = all(r.get("cuda_bit_exact", {}).get("differing", 1) == 0
                   for n, r in rows.items() if n != "LAMB")  # LAMB: atomic sums, any order
    return {"rows": rows, "bit_exact_equal_except_LAMB": exact_ok}


def stored_bytes(opt, ema) -> np.ndarray:
    """Every byte an optimizer stores (parameters, master weights, compensation, state and
    8-bit block scales, as stored) and its EMA's averages."""
    arrays = [a for buf in opt.host_buffers() for a in (buf.params, buf.master,
              buf.compensation, *buf.state.values(), *buf.absmax.values()) if a is not None]
    arrays += [host(ema.params[path]) for path in opt.index.paths]
    return np.concatenate([np.ascontiguousarray(a).view(np.uint8).ravel() for a in arrays])


def compiled_kernels(every: bool, simulate: bool) -> dict:
    """The kernels ``bench/cuda_static.py`` compiles, run: the configurations
    ``bench/cuda_launches.py`` enumerates them from (the representatives', every storage
    setting's value and flag; ``every``: every optimizer in every layout), each on the device
    with bit_exact and on the CPU through steps, accumulation, scaling, clipping, zeroing, a
    parameter written, an EMA and train()/eval(), every stored byte compared. Totals the
    device adds atomically (in any order: LAMB's trust ratio, caution's share, Prodigy's d)
    may change the bits: those configurations are counted apart."""
    import flatopt
    from bench import cuda_launches
    names = ["Adam"] if simulate else None if every else cuda_launches.representatives()
    chosen = cuda_launches.scenarios(names, complete=every)
    shapes = cuda_launches.HOST_SHAPES if simulate else cuda_launches.SHAPES
    rows, unexpected = {}, []
    for scenario in chosen[:3] if simulate else chosen:
        try:
            cpu = stored_bytes(*cuda_launches.exercise(scenario, "cpu", shapes=shapes))
            opt, ema = cuda_launches.exercise(scenario, "cuda", True, shapes)
            rule, settings = opt.schema.rule, opt.settings()[0]
            totals = rule.reduces(tuple(map(bool, opt.kernel_flags(settings))))
            differing = int((stored_bytes(opt, ema) != cpu).sum())
            rows[scenario.label] = {"differing_bytes": differing, "of": int(cpu.size),
                                    "atomic_totals": totals}
            if differing and not totals and not simulate:  # the simulator's fma rounds twice
                unexpected.append(scenario.label)
        except Exception as exc:
            rows[scenario.label] = {"error": f"{type(exc).__name__}: {exc}"}
            unexpected.append(scenario.label)
    print(f"[kernels] {len(rows)} configurations, unexpected: {unexpected}", flush=True)
    return {"rows": rows, "configurations": len(rows), "unexpected": unexpected,
            "ok": not unexpected, "registered": len(flatopt.registry.names())}


def end_to_end() -> dict:
    """The issue's loop: torch computes gradients straight into ``opt.grads`` (zero-copy views),
    AdamW steps on the device, then a checkpoint from the GPU loads into a CPU optimizer."""
    import tempfile

    import flatopt
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("torch has no CUDA here: the zero-copy loop needs a GPU")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, 32)).astype(np.float32)
    y = x @ rng.standard_normal((32, 1)).astype(np.float32) + 0.5
    opt = flatopt.AdamW({"w": np.zeros((32, 1), np.float32), "b": np.zeros(1, np.float32)},
                        lr=0.05, weight_decay=0.0, device="cuda")
    w, b = (torch.as_tensor(opt.params[k], device="cuda") for k in ("w", "b"))
    gw, gb = (torch.as_tensor(opt.grads[k], device="cuda") for k in ("w", "b"))
    zero_copy = gw.data_ptr() == opt.grads["w"].__cuda_array_interface__["data"][0]
    xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
    losses = []
    for _ in range(300):
        error = xt @ w + b - yt
        losses.append(float((error ** 2).mean()))
        torch.matmul(xt.T, error, out=gw).mul_(2.0 / len(x))  # written in place
        gb.copy_(2.0 * error.mean(0))
        torch.cuda.synchronize()  # torch's stream, then the optimizer's
        opt.grads.mark_present()
        opt.step()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "gpu.h5")
        flatopt.save(path, opt)
        cpu = flatopt.AdamW({"w": np.ones((32, 1), np.float32), "b": np.ones(1, np.float32)},
                            lr=0.05, weight_decay=0.0)
        flatopt.load(path, cpu)
        same = all(np.array_equal(cpu.params[k], host(opt.params[k])) for k in ("w", "b"))
    return {"zero_copy": zero_copy, "first_loss": losses[0], "last_loss": losses[-1],
            "checkpoint_gpu_to_cpu_equal": same}


def timed(run, sync, repeats: int) -> float:
    """Median seconds of ``run`` (after two warm-up calls), each timed to a device sync."""
    for _ in range(2):
        run()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def timings(profiles: dict, simulate: bool) -> dict:
    import flatopt
    from flatopt.kernels._cuda_import import numba_cuda
    cuda = numba_cuda()
    sync = cuda.synchronize
    rows = {}
    for label, shapes in profiles.items():
        n = int(sum(np.prod(s) for s in shapes))
        row = {"elements": n, "tensors": len(shapes)}
        repeats = 3 if simulate else (20 if n > 1 << 24 else 50)
        rng = np.random.default_rng(1)
        params = {f"p{k}": rng.standard_normal(s).astype(np.float32) * 0.02
                  for k, s in enumerate(shapes)}
        for key, kwargs in (("flatopt_ms", {}), ("flatopt_bit_exact_ms", {"bit_exact": True})):
            try:
                opt = flatopt.AdamW(params, lr=1e-3, device="cuda", **kwargs)
                for path, value in params.items():
                    opt.grads[path] = value  # copied in once; every step reuses them
                row[key] = 1e3 * timed(opt.step, sync, repeats)
                del opt
            except Exception as exc:
                row[key] = None
                row[key + "_error"] = f"{type(exc).__name__}: {exc}"
        try:  # a device copy of the bytes Adam moves: read 14 B/elem, write 14 B/elem
            source = cuda.device_array(ADAM_BYTES_PER_ELEMENT // 2 * n // 4, np.float32)
            target = cuda.device_array_like(source)
            row["copy_floor_ms"] = 1e3 * timed(lambda: target.copy_to_device(source), sync,
                                               repeats)
            source = target = None  # free the device memory before the next profile
        except Exception as exc:
            row["copy_floor_ms"] = None
            row["copy_error"] = f"{type(exc).__name__}: {exc}"
        try:
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("torch has no CUDA here")
            tensors = [torch.from_numpy(v).cuda().requires_grad_() for v in params.values()]
            for t in tensors:
                t.grad = torch.randn_like(t)
            fused = torch.optim.AdamW(tensors, lr=1e-3, fused=True)
            row["torch_fused_ms"] = 1e3 * timed(fused.step, torch.cuda.synchronize, repeats)
            del tensors, fused
            torch.cuda.empty_cache()
        except Exception as exc:
            row["torch_fused_ms"] = None
            row["torch_error"] = f"{type(exc).__name__}: {exc}"
        ms = row.get("flatopt_ms")
        if ms:
            row["flatopt_TBps"] = ADAM_BYTES_PER_ELEMENT * n / (ms * 1e-3) / 1e12
            if row.get("copy_floor_ms"):
                row["percent_of_copy"] = 100.0 * row["copy_floor_ms"] / ms
            if row.get("torch_fused_ms"):
                row["torch_over_flatopt"] = row["torch_fused_ms"] / ms
        rows[label] = row
        print(f"[timings] {label}: {row}", flush=True)
    return {"rows": rows}


PRECISION_MODES = {  # (parameter dtype name, storage keywords)
    "float32": ("float32", {}),
    "bf16 params + bf16 state": ("bfloat16", {"rounding": "stochastic",
                                              "state_dtype": "bfloat16"}),
    "bf16 master weights": ("bfloat16", {"master_weights": True}),
    "int8 state": ("float32", {"state_dtype": "int8"}),
}


def precision_on_device(simulate: bool) -> dict:
    """Reduced-precision buffers with ``device="cuda"``: every stored byte after 3 AdamW
    steps (bit_exact) against the CPU optimizer's, and one step's time per mode against
    float32 on one tensor (16M elements). In the simulator the sizes are tiny (8-bit state
    then stays float32: tensors under 4,096 elements keep it)."""
    import ml_dtypes

    import flatopt
    from flatopt.kernels._cuda_import import numba_cuda
    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
    rows = {}
    rng = np.random.default_rng(5)
    for label, (dtype_name, kwargs) in PRECISION_MODES.items():
        dtype = dtypes[dtype_name]
        row = {}
        try:
            shapes = {"w": (8, 40), "b": (300,)} if simulate else {"w": (64, 300),
                                                                   "b": (5000,)}
            params = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
            grads = [{k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
                     for _ in range(3)]
            stored = {}
            for device in ("cpu", "cuda"):
                opt = flatopt.AdamW({k: v.copy() for k, v in params.items()}, lr=1e-3,
                                    device=device, **({"bit_exact": True} if device == "cuda"
                                                      else {}), **kwargs)
                for g in grads:
                    opt.step(g, max_grad_norm=1.0)
                stored[device] = np.concatenate(
                    [a.view(np.uint8).ravel() for buf in opt.host_buffers()
                     for a in (buf.params, buf.master, buf.compensation,
                               *buf.state.values(), *buf.absmax.values()) if a is not None])
            row["differing_bytes"] = int((stored["cpu"] != stored["cuda"]).sum())
            row["of"] = int(stored["cpu"].size)
            n = 1 << 10 if simulate else 1 << 24
            big = {"w": (rng.standard_normal(n) * 0.02).astype(dtype)}
            opt = flatopt.AdamW(big, lr=1e-3, device="cuda", **kwargs)
            opt.grads["w"] = big["w"]
            row["step_ms"] = 1e3 * timed(opt.step, numba_cuda().synchronize,
                                         3 if simulate else 50)
            del opt
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows[label] = row
        print(f"[precision] {label}: {row}", flush=True)
    base = rows["float32"].get("step_ms")
    for row in rows.values():
        if base and row.get("step_ms"):
            row["speed_vs_float32"] = base / row["step_ms"]
    return {"rows": rows, "ok": all("error" not in row for row in rows.values())}


def table(report: dict) -> str:
    rows = report.get("timings", {}).get("rows", {})
    lines = ["| profile | flatopt step | bit_exact step | torch fused AdamW | device copy "
             "(28 B/elem) | % of copy | torch / flatopt |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def ms(value):
        return "n/a" if value is None else f"{value:.3f} ms"
    for label, row in rows.items():
        lines.append(
            f"| {label} | {ms(row.get('flatopt_ms'))} | {ms(row.get('flatopt_bit_exact_ms'))} "
            f"| {ms(row.get('torch_fused_ms'))} | {ms(row.get('copy_floor_ms'))} | "
            + (f"{row['percent_of_copy']:.0f}%" if "percent_of_copy" in row else "n/a") + " | "
            + (f"{row['torch_over_flatopt']:.1f}x" if "torch_over_flatopt" in row else "n/a")
            + " |")
    precision = report.get("precision", {}).get("rows", {})
    if precision:
        lines += ["", "| storage | step (1 x 16M) | vs float32 | bytes differing from the CPU |",
                  "| --- | --- | --- | --- |"]
        for label, row in precision.items():
            speed = row.get("speed_vs_float32")
            lines.append(f"| {label} | {ms(row.get('step_ms'))} | "
                         + ("n/a" if speed is None else f"{speed:.2f}x") + " | "
                         + (f"{row['differing_bytes']} of {row['of']}" if "of" in row
                            else row.get("error", "n/a")) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true",
                        help="Numba's CUDA simulator, small profiles (no GPU needed)")
    parser.add_argument("--skip-tests", action="store_true", help="skip the pytest section")
    parser.add_argument("--tests-timeout", type=float, default=120.0,
                        help="seconds allowed for the CUDA test files (default 120)")
    parser.add_argument("--all-kernels", action="store_true",
                        help="run every optimizer in every storage layout against the CPU "
                             "(default: the representatives, bench/cuda_launches.py)")
    args = parser.parse_args(argv)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if args.simulate else \
        os.environ.get("NUMBA_ENABLE_CUDASIM", "0")
    report: dict = {"simulate": args.simulate}

    section(report, "environment")(environment)
    print(json.dumps(report["environment"], indent=1), flush=True)
    if not args.skip_tests:
        section(report, "tests")(lambda: run_tests(args.simulate, args.tests_timeout))
        print(f"[tests] {report['tests'].get('summary', report['tests'].get('error'))}",
              flush=True)
    import flatopt
    names = ["Adam", "SGD", "LAMB"] if args.simulate else flatopt.registry.names()
    section(report, "correctness")(lambda: compare_with_cpu(names))
    print(f"[correctness] {json.dumps(report['correctness'], indent=1)}", flush=True)
    section(report, "kernels")(lambda: compiled_kernels(args.all_kernels, args.simulate))
    if not args.simulate:  # torch wrapping device views needs a GPU
        section(report, "end_to_end")(end_to_end)
        print(f"[end_to_end] {report['end_to_end']}", flush=True)
    section(report, "precision")(lambda: precision_on_device(args.simulate))
    section(report, "timings")(
        lambda: timings(SIMULATED_PROFILES if args.simulate else PROFILES, args.simulate))
    print(table(report))
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if all(report[k].get("ok") for k in report if isinstance(report[k], dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
