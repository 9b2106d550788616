"""Shared helpers for the checkpoint tests: small optimizers, snapshots, resealing edited files."""

from __future__ import annotations

import io
import os

import h5py
import numpy as np

import flatopt
from flatopt.checkpoint.format import (BLOCK_BYTES, hash_block, hashes_digest, manifest_digest,
                                       n_blocks)
from flatopt.checkpoint.h5write import create_contiguous, set_text
from optimizers import fit_params, info, rich_settings


def model_params(seed: int = 0, extra: dict | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    params = {
        "enc.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "enc.bias": rng.standard_normal(3).astype(np.float32),
        "mix.weight": rng.standard_normal((3, 3)).astype(np.float32),  # same shape as dec.weight
        "dec.weight": rng.standard_normal((3, 3)).astype(np.float32),
        "dec.bias": rng.standard_normal(3).astype(np.float64),
        "norm.scale": np.array(1.5, dtype=np.float64),                 # 0-d
        "empty": np.zeros((0, 2), dtype=np.float32),                   # zero-size
    }
    if extra:
        params.update(extra)
    return params


DEFAULT_RULES = [{"match": ["*.bias", "norm.*", "empty"], "weight_decay": 0.0, "lr": 0.02,
                  "label": "no_decay"}]


def grouped(params: dict, rules=None, allow_unused_rules: bool = False) -> list[dict]:
    if rules is None:
        rules = DEFAULT_RULES
    return flatopt.group_by_pattern(params, rules, rest={"label": "decay"},
                                    allow_unused_rules=allow_unused_rules)


def make_opt(kind: str = "Adam", seed: int = 0, steps: int = 3, params=None, rules=None,
             **hyper) -> flatopt.Optimizer:
    """A small optimizer with two groups, two dtypes, a 0-d and a zero-size parameter, stepped
    ``steps`` times with some gradients missing (so step counts differ per parameter)."""
    params = fit_params(kind, model_params(seed) if params is None else params)
    cls = flatopt.registry.lookup(kind)
    known = (*cls.schema.hyperparameters, "match", "label")
    rules = [{k: v for k, v in rule.items() if k in known}
             for rule in (rules if rules is not None else DEFAULT_RULES)]
    defaults = info(kind).checkpoint_settings or rich_settings(kind)
    opt = cls(grouped(params, rules), **{**defaults, **hyper})
    step_with_grads(opt, seed, steps)
    return opt


def step_with_grads(opt, seed: int, steps: int, start: int = 0) -> None:
    for t in range(start, start + steps):
        rng = np.random.default_rng(1000 * seed + t)
        grads = {}
        for k, (path, view) in enumerate(opt.params.items()):
            if (k + t) % 4 == 3:
                continue  # a missing gradient
            grads[path] = rng.standard_normal(view.shape).astype(view.dtype)
        opt.step(grads)


def snapshot(opt) -> dict:
    """Everything load may change: buffers, state slots, persistent per-parameter arrays,
    param groups."""
    snap = {"groups": [dict(g) for g in opt.param_groups], "buffers": []}
    for buf in opt.buffers:
        snap["buffers"].append({
            "params": buf.params.copy(),
            "state": {k: v.copy() for k, v in buf.state.items()},
            "per_param": {k: v.copy() for k, v in buf.columns.items()},
        })
    return snap


def same_snapshot(a: dict, b: dict) -> bool:
    if a["groups"] != b["groups"] or len(a["buffers"]) != len(b["buffers"]):
        return False
    for x, y in zip(a["buffers"], b["buffers"]):
        if x["params"].tobytes() != y["params"].tobytes():
            return False
        if set(x["state"]) != set(y["state"]) or set(x["per_param"]) != set(y["per_param"]):
            return False
        for k in x["state"]:
            if x["state"][k].tobytes() != y["state"][k].tobytes():
                return False
        for k in x["per_param"]:
            if x["per_param"][k].tobytes() != y["per_param"][k].tobytes():
                return False
    return True


def state_equal(a, b) -> bool:
    """Parameters, step counts and state of two optimizers agree bit for bit, by path."""
    if sorted(a.params) != sorted(b.params):
        return False
    for path in a.params:
        if a.params[path].tobytes() != b.params[path].tobytes():
            return False
        sa, sb = a.state_of(path), b.state_of(path)
        if (sa is None) != (sb is None):
            return False
        if sa is None:
            continue
        for x, y in zip(sa, sb):
            if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
                if x is None or y is None or x.tobytes() != y.tobytes():
                    return False
            elif x != y:
                return False
    return True


def saved_bytes(opt, tmp_path, name="ck.h5", **kwargs) -> bytes:
    path = tmp_path / name
    flatopt.save(path, opt, **kwargs)
    return path.read_bytes()


def _plain(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.integer):
        return int(value)
    return value if isinstance(value, (str, int)) else repr(value)


def block_hashes_of(values: np.ndarray) -> np.ndarray:
    raw = memoryview(np.ascontiguousarray(values).reshape(-1).view(np.uint8))
    return np.array([hash_block(raw[k * BLOCK_BYTES:(k + 1) * BLOCK_BYTES])
                     for k in range(n_blocks(len(raw)))], dtype="<u8")


def rehash(ds) -> None:
    """Recompute a format-2 dataset's block checksums and digest from its data, as an
    attacker (or a tool that rewrote the data through HDF5) could."""
    hashes = block_hashes_of(ds[...])
    ds.attrs.create("checksums", data=hashes)
    set_text(ds, "digest", hashes_digest(hashes))


def add_buffer(parent, name: str, values: np.ndarray):
    """A format-2 buffer dataset (contiguous, checksummed) with ``values``."""
    ds = create_contiguous(parent, name, values.shape, values.dtype)
    ds[...] = values
    rehash(ds)
    return ds


def data_extent(data: bytes, name: str) -> tuple[int, int]:
    """(byte offset, size) of a buffer's data in a checkpoint file."""
    with h5py.File(io.BytesIO(data), "r") as f:
        ds = f[name]
        if ds.chunks:  # format version 1
            chunk = ds.id.get_chunk_info(0)
            return chunk.byte_offset, chunk.size
        return ds.id.get_offset(), ds.id.get_storage_size()


def reseal(data: bytes) -> bytes:
    """Recompute the commit digest of an edited checkpoint, as an attacker could, so that the
    loader's structural and semantic checks (not only the digest) are exercised."""
    bio = io.BytesIO(data)
    with h5py.File(bio, "r+") as f:
        header = {key: _plain(f.attrs[key]) for key in f.attrs if key != "digest"}
        for key in ("metadata", "scheduler"):
            if key in f:
                header[key] = _plain(f[key][()])
        groups = []
        buffers = {}
        for number in sorted(f["groups"], key=int):
            g = f["groups"][number]
            label = g.attrs.get("label")
            groups.append({"hyperparameters": _plain(g.attrs["hyperparameters"]),
                           "label": None if label is None else _plain(label)})
            if "storage" in g.attrs:  # format 5: reduced-precision storage
                groups[-1]["storage"] = _plain(g.attrs["storage"])
            for dtype in g:
                for slot in g[dtype]:
                    try:  # hostile edits may have put links or groups here
                        ds = g[dtype][slot]
                        digest = ds.attrs.get("digest")
                        buffers[ds.name] = [ds.dtype.name, int(ds.shape[0]),
                                            None if digest is None else _plain(digest)]
                    except Exception:
                        continue
        columns = {}
        for name in f["index"]:
            ds = f["index"][name]
            if ds.dtype.kind == "S":
                columns[name] = [v.decode("utf-8", "replace") for v in ds[...]]
            elif ds.ndim == 2:
                columns[name] = [[int(d) for d in row] for row in ds[...]]
            else:
                columns[name] = [int(v) for v in ds[...]]
        if "shape" in columns and "ndim" in columns:
            columns["shape"] = [row[:n] if 0 <= n <= len(row) else row
                                for row, n in zip(columns["shape"], columns["ndim"])]
        arrays = None
        if header.get("format_version", 1) != 1:
            arrays = {}
            for number in f.get("arrays", {}):
                try:
                    ds = f["arrays"][number]
                    arrays[ds.name] = [_plain(ds.attrs.get("name")),
                                       _plain(ds.attrs.get("dtype")),
                                       [int(d) for d in (ds.shape or ())],
                                       _plain(ds.attrs.get("digest"))]
                except Exception:
                    continue
        set_text(f, "digest", manifest_digest(header, groups, columns, buffers, arrays))
    return bio.getvalue()


def edit(data: bytes, fn, seal: bool = True) -> bytes:
    """Apply ``fn(h5py.File)`` to a copy of a checkpoint in memory; reseal the digest."""
    bio = io.BytesIO(data)
    with h5py.File(bio, "r+") as f:
        fn(f)
    out = bio.getvalue()
    return reseal(out) if seal else out


def check_round_trip(kind: str, tmp_path, **hyper) -> None:
    """Save, load into another optimizer of the same structure: bit-identical state; saving
    again gives the same buffers; the file verifies; no temporary file is left."""
    from flatopt.checkpoint import verify_checkpoint
    opt = make_opt(kind, steps=5, **hyper)
    path = tmp_path / "ck.h5"
    assert flatopt.save(path, opt, metadata={"epoch": 5}) == str(path)
    other = make_opt(kind, seed=7, steps=2, **hyper)
    assert not state_equal(opt, other)
    result = flatopt.load(path, other)
    assert state_equal(opt, other)
    assert result.metadata == {"epoch": 5}
    assert result.loaded == list(opt.params) and result.fresh == [] and result.unused == []
    assert sorted(os.listdir(tmp_path)) == ["ck.h5"]  # no temporary file left
    flatopt.save(tmp_path / "again.h5", other, metadata={"epoch": 5})
    with h5py.File(path) as a, h5py.File(tmp_path / "again.h5") as b:
        assert a.attrs["digest"] == b.attrs["digest"]
    assert verify_checkpoint(path)["ok"]
    (tmp_path / "again.h5").unlink()
