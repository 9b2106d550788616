"""Writing HDF5 objects as flatopt's files store them: fixed-length UTF-8 text attributes,
index columns, contiguous datasets whose bytes are written later at their offset, and a
manifest's fragment tables. Shared by ``writer`` (checkpoint files) and ``manifest`` (a
sharded checkpoint's part files and manifest)."""

from __future__ import annotations

import h5py
import numpy as np

from .format import stored_dtype, text_dtype


def set_text(obj, name: str, text: str) -> None:
    """A fixed-length UTF-8 string attribute (stored inside the checksummed object header)."""
    raw = text.encode("utf-8")
    obj.attrs.create(name, data=np.array(raw, dtype=text_dtype(raw)))


def write_column(parent: h5py.Group, name: str, values: list, dtype) -> None:
    if dtype == "str":
        raw = [v.encode("utf-8") for v in values]
        parent.create_dataset(name, data=np.array(raw, dtype=text_dtype(raw)),
                              shape=(len(values),))
    elif dtype == "shape":
        width = max([1] + [len(shape) for shape in values])
        data = np.full((len(values), width), -1, dtype=np.int64)
        for k, shape in enumerate(values):
            data[k, :len(shape)] = shape
        parent.create_dataset(name, data=data)
    else:
        parent.create_dataset(name, data=np.asarray(values, dtype=dtype).reshape(-1))


def create_contiguous(parent: h5py.Group, name: str, shape: tuple, dtype: np.dtype):
    """A contiguous dataset without filters whose storage HDF5 allocates now and never fills:
    its bytes are written straight to ``ds.id.get_offset()``."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    space = (h5py.h5s.create(h5py.h5s.SCALAR) if shape == ()
             else h5py.h5s.create_simple(tuple(shape)))
    tid = h5py.h5t.py_create(np.dtype(dtype), logical=True)
    return h5py.Dataset(h5py.h5d.create(parent.id, name.encode("utf-8"), tid, space,
                                        dcpl=dcpl))


def write_buffer(parent: h5py.Group, name: str, array: np.ndarray) -> tuple:
    """Create the dataset for one buffer (or extra array); its bytes are written later."""
    ds = create_contiguous(parent, name, array.shape, stored_dtype(array.dtype))
    return ds, array


def fragment_array(rows: list) -> np.ndarray:
    """Rows ``[rank, start, stop, "xxh3:<hex>"]`` as the manifest stores them (int64, the
    digest's 64 bits reinterpreted)."""
    data = np.zeros((len(rows), 4), np.int64)
    for k, (rank, start, stop, digest) in enumerate(rows):
        data[k, :3] = (rank, start, stop)
        data[k, 3] = np.array(int(digest[5:], 16), np.uint64).view(np.int64)
    return data
