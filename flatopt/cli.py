"""The ``flatopt`` command: inspect, diff and verify checkpoints.

    flatopt inspect PATH [--json] [--tensors]
                                    optimizer, groups, hyperparameters, sizes, step range,
                                    extra arrays; with --tensors every parameter's path,
                                    shape, dtype, group and persisted columns (step)
    flatopt diff A B [--json]       what differs, by path and extra array (exit 0 identical,
                                    1 different)
    flatopt verify PATH [--json]    structure, digests and every buffer's checksums
                                    (exit 0 only when the file is sound)

Exit status 2 means the command could not read a file (``inspect``, ``diff``) or was used
wrongly. ``verify`` exits 1 for any unsound file, whatever the reason. Every command exits 1
when its output pipe closes before it has written everything (``| head -1``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .checkpoint import diff_checkpoints, inspect_checkpoint, run, verify_checkpoint
from .errors import CheckpointError, CheckpointOptionError


def _escaped(text: str) -> str:
    """``text`` with every unprintable character (escape sequences, bells, control bytes) shown
    as a Python escape: a hostile path or label cannot retitle or clear the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _say(text: str = "", file=None) -> None:
    """Print one line of human-readable output, escaped (``--json`` output is JSON, which
    escapes control characters itself)."""
    print(_escaped(str(text)), file=file or sys.stdout)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its error messages escaped: they quote the command line, whose
    file names may carry terminal escape sequences. (Subcommand parsers are of this class
    too: argparse makes them of their parent's.)"""

    def exit(self, status: int = 0, message: str | None = None):
        if message is not None:
            message = "\n".join(_escaped(line) for line in message.split("\n"))
        super().exit(status, message)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_inspect(info: dict) -> None:
    _say(f"{info['path']}")
    _say(f"  format       {info['format']} version {info['format_version']} "
          f"(flatopt {info['flatopt_version']}, h5py {info['h5py_version']}, "
          f"HDF5 {info['hdf5_version']})")
    if "world_size" in info:
        _say(f"  sharded      saved by {info['world_size']} ranks: manifest.h5 and one file "
             f"per rank (save {info['save_id']})")
    _say(f"  optimizer    {info['optimizer']}")
    _say(f"  parameters   {info['parameters']} tensors, {info['elements']:,} elements, "
          f"{_human_bytes(info['buffer_bytes'])} of buffers (file "
          f"{_human_bytes(info['file_bytes'])})")
    if info["step_min"] is not None:
        _say(f"  step counts  {info['step_min']}..{info['step_max']} "
              f"({info['with_state']} tensors with state)")
    else:
        _say(f"  state        {info['with_state']} tensors with momentum")
    for group in info["groups"]:
        label = f" {group['label']!r}" if group["label"] else ""
        _say(f"  group {group['group']}{label}: {group['parameters']} tensors, "
              f"{group['elements']:,} elements, {', '.join(group['dtypes']) or 'no buffers'}, "
              f"buffers {', '.join(group['slots'])}")
        hyper = ", ".join(f"{k}={v}" for k, v in group["hyperparameters"].items())
        _say(f"      {hyper}")
        if group["step_min"] is not None:
            _say(f"      step counts {group['step_min']}..{group['step_max']}")
    if info["metadata"] is not None:
        _say(f"  metadata     {_cut(json.dumps(info['metadata']))}")
    if info["scheduler_state"] is not None:
        _say(f"  scheduler    {_cut(json.dumps(info['scheduler_state']))}")
    if info["arrays"]:
        _say(f"  arrays       {len(info['arrays'])} extra arrays")
        _print_table(["name", "shape", "dtype", "bytes"],
                     [[a["name"], _shape(a["shape"]), a["dtype"], f"{a['bytes']:,}"]
                      for a in info["arrays"]])
    if "tensors" in info:
        _say(f"  tensors      {len(info['tensors'])}")
        columns = info["columns"]
        _print_table(["path", "shape", "dtype", "group", *columns],
                     [[t["path"], _shape(t["shape"]), t["dtype"],
                       f"{t['group']}" + (f" {t['label']!r}" if t["label"] else ""),
                       *(str(t[c]) for c in columns)] for t in info["tensors"]])


SHOWN_CHARACTERS = 200


def _cut(text: str) -> str:
    """``text``, or its first SHOWN_CHARACTERS with a mark saying how much is left out (a cut
    number must not read as a whole one)."""
    if len(text) <= SHOWN_CHARACTERS:
        return text
    return (f"{text[:SHOWN_CHARACTERS]}... ({len(text) - SHOWN_CHARACTERS:,} more characters; "
            "--json prints all of it)")


def _shape(shape: list) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    """Rows indented under a header, columns as wide as their widest (escaped) cell."""
    cells = [[_escaped(str(cell)) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[k]) for row in cells) for k in range(len(header))]
    for row in cells:
        _say("    " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _print_verify(result: dict) -> None:
    for entry in result["buffers"]:
        status = "ok  " if entry["ok"] else "BAD "
        what = f"array {entry['array']!r}" if "array" in entry else entry["buffer"]
        _say(f"  {status} {what}  {entry['elements']:,} elements  {entry['digest']}")
    if result["ok"]:
        _say(f"{result['path']}: OK ({result.get('optimizer')}, {result.get('parameters')} "
              f"parameters, {len(result['buffers'])} buffers verified)")
    else:
        _say(f"{result['path']}: NOT SOUND")
        for problem in result["problems"]:
            _say(f"  {problem}")


def _print_diff(result: dict) -> None:
    if result["identical"]:
        _say(f"{result['a']} and {result['b']}: identical")
        return
    _say(f"--- {result['a']}")
    _say(f"+++ {result['b']}")
    for item in result["header"]:
        _say(f"  file: {item['field']}: {item['a']!r} -> {item['b']!r}")
    for item in result["groups"]:
        _say(f"  group {item['group']}: {item['field']}: {item['a']} -> {item['b']}")
    for path in result["only_in_a"]:
        _say(f"- {path}: only in {result['a']}")
    for path in result["only_in_b"]:
        _say(f"+ {path}: only in {result['b']}")
    for item in result["params"]:
        if "max_abs_diff" in item:
            count = item["elements_differing"]
            _say(f"  {item['path']}: {item['field']} differs in {count} "
                  f"element{'s' if count != 1 else ''} (max abs diff {item['max_abs_diff']:.6g})")
        else:
            _say(f"  {item['path']}: {item['field']}: {item['a']} -> {item['b']}")
    for item in result.get("arrays", []):
        if "elements_differing" in item:
            count = item["elements_differing"]
            largest = (f" (max abs diff {item['max_abs_diff']:.6g})" if "max_abs_diff" in item
                       else "")
            _say(f"  array {item['array']!r}: values differ in {count} "
                 f"element{'s' if count != 1 else ''}{largest}")
        else:
            _say(f"  array {item['array']!r}: {item['field']}: {item['a']} -> {item['b']}")


def _strict_json(value):
    """NaN and infinities become null (JSON has no such numbers); containers are walked."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(item) for item in value]
    return value


def _run(args: argparse.Namespace, emit) -> int:
    """The command's output and exit status."""
    if args.command == "verify":
        result = (run.verify_run(args.path) if run.is_run(args.path) else
                  verify_checkpoint(args.path))
        emit(result) if args.json else _each_member(result, _print_verify)
        return 0 if result["ok"] else 1
    if args.command == "inspect":
        info = (run.inspect_run(args.path, tensors=args.tensors) if run.is_run(args.path) else
                inspect_checkpoint(args.path, tensors=args.tensors))
        emit(info) if args.json else _each_member(info, _print_inspect)
        return 0
    if run.is_run(args.a) != run.is_run(args.b):
        raise CheckpointOptionError("diff compares two runs of several optimizers, or two "
                                    "checkpoints of one, not one of each")
    result = (run.diff_runs(args.a, args.b) if run.is_run(args.a) else
              diff_checkpoints(args.a, args.b))
    emit(result) if args.json else _each_member(result, _print_diff)
    return 0 if result["identical"] else 1


def _each_member(result: dict, show) -> None:
    """``show(result)``, or for a run each member's under its name."""
    if "members" not in result:
        show(result)
        return
    for name, member in result["members"].items():
        _say(f"== optimizer {name!r}")
        show(member)
    for key, where in (("only_in_a", "a"), ("only_in_b", "b")):
        for name in result.get(key, ()):
            _say(f"optimizer {name!r}: only in {result[where]}")
    for problem in result.get("problems", ()):
        _say(f"{result['path']}: NOT SOUND: {problem}")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="flatopt", description="Inspect, compare and verify flatopt HDF5 "
                     "checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("inspect", "summarise a checkpoint"),
                            ("verify", "check structure and every checksum (exit 0 if sound)")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("path")
        sub.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "inspect":
            sub.add_argument("--tensors", action="store_true",
                             help="also list every parameter: path, shape, dtype, group and "
                             "its persisted per-parameter values (e.g. Adam's step)")
    sub = commands.add_parser("diff", help="what differs between two checkpoints, by path")
    sub.add_argument("a")
    sub.add_argument("b")
    sub.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    def emit(obj) -> None:
        print(json.dumps(_strict_json(obj), indent=2, default=str, allow_nan=False))

    try:
        status = _run(args, emit)
        sys.stdout.flush()  # a closed pipe fails here, inside the try, not at exit
        return status
    except BrokenPipeError:
        # the reader (e.g. `| head -1`) went away before reading everything: the result was
        # not delivered, so exit 1 as Python's documentation recommends (a verify that says
        # "OK" only to a closed pipe is no success); the final flush goes to /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except CheckpointError as exc:
        if args.json:
            emit({"error": type(exc).__name__, "message": str(exc)})
        else:
            _say(f"flatopt {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
