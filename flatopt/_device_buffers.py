"""The device side of one :class:`FlatBuffer` for ``device="cuda"`` (``flatopt._device``):
its arrays in GPU memory under the buffer's own names, and the layout the CUDA walks read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _codec
from ._layout import FlatBuffer


# ----------------------------------------------------------------------------- buffers
@dataclass
class DeviceLayout:
    """A buffer's layout as the CUDA walk reads it, with device copies of its arrays."""

    present: Any
    offsets: Any
    sizes: Any
    chunk_first: Any
    chunk_size: int
    length: int


def _packed_views(packed, arrays) -> list:
    """Views of ``packed`` (uint8, host or device) holding ``arrays`` back to back, each
    starting on an 8-byte boundary."""
    views, position = [], 0
    for array in arrays:
        views.append(packed[position:position + array.nbytes].view(array.dtype))
        position += -(-array.nbytes // 8) * 8
    return views


def _packed(cuda, arrays, stream):
    """(host staging array, device array, device views) for ``arrays`` packed together."""
    size = sum(-(-array.nbytes // 8) * 8 for array in arrays)
    staging = np.zeros(max(size, 8), np.uint8)
    for view, array in zip(_packed_views(staging, arrays), arrays):
        view[...] = array
    packed = cuda.to_device(staging, stream=stream)
    return staging, packed, _packed_views(packed, arrays)


class DeviceBuffer:
    """The device side of one :class:`FlatBuffer`: the same arrays by the same names
    (``params``, ``grads``, ``state``; a reduced-precision buffer's ``master``,
    ``compensation`` and 8-bit ``absmax`` too), 16-bit ones as bit patterns
    (``_codec.bits_dtype``: Numba has no bfloat16)."""

    def __init__(self, cuda, buf: FlatBuffer, stream):
        upload = lambda flat: cuda.to_device(_codec.as_bits(flat), stream=stream)  # noqa: E731
        self.params = upload(buf.params)
        self.grads = upload(buf.grads)
        self.state = {name: upload(flat) for name, flat in buf.state.items()}
        self.absmax = {name: upload(flat) for name, flat in buf.absmax.items()}
        self.master = None if buf.master is None else upload(buf.master)
        self.compensation = None if buf.compensation is None else upload(buf.compensation)
        # a coded plan's stand-ins for unused positions, and the 8-bit code tables
        self.empty = _codec.HostArrays(cuda.to_device(np.zeros(0, np.uint8), stream=stream),
                                       cuda.to_device(np.zeros(0, np.float32), stream=stream),
                                       cuda.to_device(_codec.HostArrays().tables, stream=stream))
        self.coded = None  # the _codec.CodedPlan over the arrays above (coded buffers)
        self.kernels = None  # what steps the buffer: the rule's plain or coded kernels
        self.decoded = None  # float32 scratch: 16-bit parameters decoded for an EMA
        # presence and the columns change every step: they travel in one copy, packed
        self.staging, self.packed, views = _packed(cuda, (buf.present, *buf.kernel_columns),
                                                   stream)
        self.staged = _packed_views(self.staging, (buf.present, *buf.kernel_columns))
        present, self.columns = views[0], tuple(views[1:])
        self.layout = DeviceLayout(present,
                                   cuda.to_device(buf.offsets, stream=stream),
                                   cuda.to_device(buf.sizes, stream=stream),
                                   cuda.to_device(buf.chunk_first, stream=stream),
                                   buf.chunk_size, buf.length)
        self.plan = None  # the host _Plan the cached device arguments were made for
        self.arrays = self.scalars = self.prepare_scalars = self.sums = self.zero_sums = None
        self.no_scalars = cuda.to_device(np.zeros(0, buf.dtype), stream=stream)

    def mirrored(self, buf: FlatBuffer):
        """(device array, host array) of every array of ``buf`` the host mirrors (all but the
        gradients): parameters, master copy, compensation, state and block scales."""
        for name in ("params", "master", "compensation"):
            if getattr(buf, name) is not None:
                yield getattr(self, name), getattr(buf, name)
        for device, host in ((self.state, buf.state), (self.absmax, buf.absmax)):
            for name, flat in device.items():
                yield flat, host[name]
