"""The ``flatopt`` command: inspect, diff and verify checkpoints.

    flatopt inspect PATH [--json]   optimizer, groups, hyperparameters, sizes, step range
    flatopt diff A B [--json]       what differs, by path (exit 0 identical, 1 different)
    flatopt verify PATH [--json]    structure, digests and every buffer's checksums
                                    (exit 0 only when the file is sound)

Exit status 2 means the command could not read a file (``inspect``, ``diff``) or was used
wrongly. ``verify`` exits 1 for any unsound file, whatever the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import numpy as np

from .checkpoint import FORMAT, open_checkpoint
from .errors import CheckpointError


def _steps_summary(ck, members) -> dict:
    kind = ck.kind
    if "step" in kind.per_param:
        steps = [e.per_param["step"] for e in members]
        with_state = sum(1 for s in steps if s)
        return {"step_min": min(steps) if steps else None,
                "step_max": max(steps) if steps else None, "with_state": with_state}
    flags = [e.per_param["momentum_initialized"] for e in members]
    return {"step_min": None, "step_max": None, "with_state": sum(flags)}


def inspect_checkpoint(source) -> dict:
    """A summary of a checkpoint (structure and digest checked; buffer data not read)."""
    with open_checkpoint(source) as ck:
        groups = []
        total_bytes = 0
        for number, group in enumerate(ck.groups):
            members = [e for e in ck.params if e.group == number]
            buffers = [b for key, b in ck.buffers.items() if key[0] == number]
            nbytes = sum(b.length * np.dtype(b.dtype).itemsize * len(b.datasets)
                         for b in buffers)
            total_bytes += nbytes
            groups.append({
                "group": number, "label": group["label"],
                "hyperparameters": {k: list(v) if isinstance(v, tuple) else v
                                    for k, v in group["hyperparameters"].items()},
                "parameters": len(members), "elements": sum(e.size for e in members),
                "dtypes": sorted({b.dtype for b in buffers}),
                "slots": sorted({slot for b in buffers for slot in b.datasets}),
                "bytes": nbytes, **_steps_summary(ck, members)})
        return {"path": ck.name, "format": FORMAT,
                "format_version": ck.header["format_version"],
                "flatopt_version": ck.header["flatopt_version"],
                "h5py_version": ck.header["h5py_version"],
                "hdf5_version": ck.header["hdf5_version"],
                "optimizer": ck.kind.name, "parameters": len(ck.params),
                "elements": sum(e.size for e in ck.params), "buffer_bytes": total_bytes,
                "file_bytes": ck.size, **_steps_summary(ck, ck.params), "groups": groups,
                "metadata": ck.metadata, "scheduler_state": ck.scheduler_state}


def verify_checkpoint(source) -> dict:
    """Check structure, digest and every buffer's checksums; ``ok`` only when all are sound."""
    result: dict[str, Any] = {"path": str(source) if not hasattr(source, "read") else
                              getattr(source, "name", "<in-memory checkpoint>"),
                              "ok": False, "problems": [], "buffers": []}
    try:
        with open_checkpoint(source) as ck:
            result["path"] = ck.name
            result["optimizer"] = ck.kind.name
            result["format_version"] = ck.header["format_version"]
            result["parameters"] = len(ck.params)
            for key, saved in ck.buffers.items():
                for slot in saved.datasets:
                    entry = {"buffer": saved.datasets[slot].name,
                             "elements": saved.length, "digest": saved.digests[slot]}
                    try:
                        ck.read(key, slot)
                        entry["ok"] = True
                    except CheckpointError as exc:
                        entry["ok"] = False
                        result["problems"].append(str(exc))
                    result["buffers"].append(entry)
    except CheckpointError as exc:
        result["problems"].append(str(exc))
    result["ok"] = not result["problems"]
    return result


def _slot_values(ck, staged, entry, slot):
    key = (entry.group, entry.dtype)
    if (key, slot) not in staged:
        return None
    return staged[key, slot][entry.offset:entry.offset + entry.size]


def diff_checkpoints(a, b) -> dict:
    """Every difference between two checkpoints: header, groups, and per path."""
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        header = []
        for key in ("format_version", "optimizer", "flatopt_version", "h5py_version",
                    "hdf5_version", "metadata", "scheduler"):
            va, vb = ca.header.get(key), cb.header.get(key)
            if va != vb:
                header.append({"field": key, "a": va, "b": vb})
        groups = []
        for number in range(max(len(ca.groups), len(cb.groups))):
            ga = ca.groups[number] if number < len(ca.groups) else None
            gb = cb.groups[number] if number < len(cb.groups) else None
            if ga is None or gb is None:
                groups.append({"group": number, "field": "exists", "a": ga is not None,
                               "b": gb is not None})
                continue
            if ga["label"] != gb["label"]:
                groups.append({"group": number, "field": "label", "a": ga["label"],
                               "b": gb["label"]})
            ha, hb = ga["hyperparameters"], gb["hyperparameters"]
            for key in sorted(set(ha) | set(hb)):
                if ha.get(key) != hb.get(key):
                    groups.append({"group": number, "field": key, "a": _plain(ha.get(key)),
                                   "b": _plain(hb.get(key))})
        only_a = [e.path for e in ca.params if e.path not in cb.by_path]
        only_b = [e.path for e in cb.params if e.path not in ca.by_path]
        staged_a = ca.read_all(sorted(ca.buffers))
        staged_b = cb.read_all(sorted(cb.buffers))
        params = []
        slots = sorted({s for buf in (*ca.buffers.values(), *cb.buffers.values())
                        for s in buf.datasets})
        for ea in ca.params:
            eb = cb.by_path.get(ea.path)
            if eb is None:
                continue
            for field in ("id", "shape", "dtype", "group"):
                if getattr(ea, field) != getattr(eb, field):
                    params.append({"path": ea.path, "field": field,
                                   "a": _plain(getattr(ea, field)),
                                   "b": _plain(getattr(eb, field))})
            for name in sorted(set(ea.per_param) | set(eb.per_param)):
                if ea.per_param.get(name) != eb.per_param.get(name):
                    params.append({"path": ea.path, "field": name,
                                   "a": ea.per_param.get(name), "b": eb.per_param.get(name)})
            if ea.shape != eb.shape:
                continue
            for slot in slots:
                va = _slot_values(ca, staged_a, ea, slot)
                vb = _slot_values(cb, staged_b, eb, slot)
                if va is None and vb is None:
                    continue
                if va is None or vb is None:
                    params.append({"path": ea.path, "field": slot, "a": va is not None,
                                   "b": vb is not None, "note": "present"})
                    continue
                if not np.array_equal(va, vb, equal_nan=True):
                    both_nan = np.isnan(va) & np.isnan(vb)
                    delta = np.abs(va.astype(np.float64) - vb.astype(np.float64))
                    delta[both_nan] = 0.0
                    # NaN against a number: the difference is unbounded (null in --json)
                    params.append({"path": ea.path, "field": slot,
                                   "max_abs_diff": float(np.max(delta)),
                                   "elements_differing": int(np.count_nonzero(
                                       ~((va == vb) | both_nan)))})
        identical = not (header or groups or only_a or only_b or params)
        return {"a": ca.name, "b": cb.name, "identical": identical, "header": header,
                "groups": groups, "only_in_a": only_a, "only_in_b": only_b, "params": params}


def _plain(value):
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_inspect(info: dict) -> None:
    print(f"{info['path']}")
    print(f"  format       {info['format']} version {info['format_version']} "
          f"(flatopt {info['flatopt_version']}, h5py {info['h5py_version']}, "
          f"HDF5 {info['hdf5_version']})")
    print(f"  optimizer    {info['optimizer']}")
    print(f"  parameters   {info['parameters']} tensors, {info['elements']:,} elements, "
          f"{_human_bytes(info['buffer_bytes'])} of buffers (file "
          f"{_human_bytes(info['file_bytes'])})")
    if info["step_min"] is not None:
        print(f"  step counts  {info['step_min']}..{info['step_max']} "
              f"({info['with_state']} tensors with state)")
    else:
        print(f"  state        {info['with_state']} tensors with momentum")
    for group in info["groups"]:
        label = f" {group['label']!r}" if group["label"] else ""
        print(f"  group {group['group']}{label}: {group['parameters']} tensors, "
              f"{group['elements']:,} elements, {', '.join(group['dtypes']) or 'no buffers'}, "
              f"buffers {', '.join(group['slots'])}")
        hyper = ", ".join(f"{k}={v}" for k, v in group["hyperparameters"].items())
        print(f"      {hyper}")
        if group["step_min"] is not None:
            print(f"      step counts {group['step_min']}..{group['step_max']}")
    if info["metadata"] is not None:
        print(f"  metadata     {json.dumps(info['metadata'])[:200]}")
    if info["scheduler_state"] is not None:
        print(f"  scheduler    {json.dumps(info['scheduler_state'])[:200]}")


def _print_verify(result: dict) -> None:
    for entry in result["buffers"]:
        status = "ok  " if entry["ok"] else "BAD "
        print(f"  {status} {entry['buffer']}  {entry['elements']:,} elements  {entry['digest']}")
    if result["ok"]:
        print(f"{result['path']}: OK ({result.get('optimizer')}, {result.get('parameters')} "
              f"parameters, {len(result['buffers'])} buffers verified)")
    else:
        print(f"{result['path']}: NOT SOUND")
        for problem in result["problems"]:
            print(f"  {problem}")


def _print_diff(result: dict) -> None:
    if result["identical"]:
        print(f"{result['a']} and {result['b']}: identical")
        return
    print(f"--- {result['a']}\n+++ {result['b']}")
    for item in result["header"]:
        print(f"  file: {item['field']}: {item['a']!r} -> {item['b']!r}")
    for item in result["groups"]:
        print(f"  group {item['group']}: {item['field']}: {item['a']} -> {item['b']}")
    for path in result["only_in_a"]:
        print(f"- {path}: only in {result['a']}")
    for path in result["only_in_b"]:
        print(f"+ {path}: only in {result['b']}")
    for item in result["params"]:
        if "max_abs_diff" in item:
            count = item["elements_differing"]
            print(f"  {item['path']}: {item['field']} differs in {count} "
                  f"element{'s' if count != 1 else ''} (max abs diff {item['max_abs_diff']:.6g})")
        else:
            print(f"  {item['path']}: {item['field']}: {item['a']} -> {item['b']}")


def _strict_json(value):
    """NaN and infinities become null (JSON has no such numbers); containers are walked."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(item) for item in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flatopt", description="Inspect, compare and verify "
                                     "flatopt HDF5 checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("inspect", "summarise a checkpoint"),
                            ("verify", "check structure and every checksum (exit 0 if sound)")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("path")
        sub.add_argument("--json", action="store_true", help="machine-readable output")
    sub = commands.add_parser("diff", help="what differs between two checkpoints, by path")
    sub.add_argument("a")
    sub.add_argument("b")
    sub.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    def emit(obj) -> None:
        print(json.dumps(_strict_json(obj), indent=2, default=str, allow_nan=False))

    try:
        if args.command == "verify":
            result = verify_checkpoint(args.path)
            emit(result) if args.json else _print_verify(result)
            return 0 if result["ok"] else 1
        if args.command == "inspect":
            info = inspect_checkpoint(args.path)
            emit(info) if args.json else _print_inspect(info)
            return 0
        result = diff_checkpoints(args.a, args.b)
        emit(result) if args.json else _print_diff(result)
        return 0 if result["identical"] else 1
    except BrokenPipeError:
        # the reader (e.g. `| head`) went away: not an error of ours; silence the final flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CheckpointError as exc:
        if args.json:
            emit({"error": type(exc).__name__, "message": str(exc)})
        else:
            print(f"flatopt {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
