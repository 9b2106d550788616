"""Packing parameters into flat buffers, and the index that describes the packing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

# Each parameter starts on a 64-byte boundary (a cache line, a full AVX-512 vector), so a
# parameter's elements never share a cache line with its neighbour's.
ALIGN_BYTES = 64
# Elements per unit of parallel work: small enough to spread one 1,000-element tensor list or
# one 64M-element tensor evenly over the threads, large enough that scheduling is negligible.
CHUNK_ELEMENTS = 1 << 14

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class ParamInfo:
    """Where one parameter lives: a record of the optimizer's index."""

    id: int
    """Stable integer id, assigned in construction order (and continued by add_param_group)."""
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    group: int
    """Index into ``opt.param_groups``."""
    buffer: int
    """Index into ``opt.buffers`` (one buffer per group and dtype)."""
    slot: int
    """Position of the parameter within its buffer's per-parameter arrays."""
    offset: int
    """First element of the parameter in its buffer (and in the gradient and state buffers)."""
    size: int


class ParamIndex(Sequence[ParamInfo]):
    """Every parameter's :class:`ParamInfo`, in id order; also looked up by path."""

    def __init__(self, infos: Sequence[ParamInfo] = ()):
        self._infos: list[ParamInfo] = []
        self._by_path: dict[str, ParamInfo] = {}
        self._extend(infos)

    def _extend(self, infos: Sequence[ParamInfo]) -> None:
        for info in infos:
            self._infos.append(info)
            self._by_path[info.path] = info

    def __len__(self) -> int:
        return len(self._infos)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._by_path[key]
        return self._infos[key]

    def __iter__(self) -> Iterator[ParamInfo]:
        return iter(self._infos)

    def __contains__(self, key) -> bool:
        if isinstance(key, str):
            return key in self._by_path
        return key in self._infos

    @property
    def paths(self) -> list[str]:
        return [info.path for info in self._infos]

    def get(self, path: str, default=None):
        return self._by_path.get(path, default)

    def __repr__(self) -> str:
        rows = [f"  {i.id:>5}  {i.path}  {i.shape}  {i.dtype}  group={i.group} "
                f"buffer={i.buffer} offset={i.offset} size={i.size}" for i in self._infos[:20]]
        more = f"\n  ... {len(self) - 20} more" if len(self) > 20 else ""
        return "ParamIndex(\n" + "\n".join(rows) + more + "\n)"


def aligned_zeros(n_elements: int, dtype: np.dtype) -> np.ndarray:
    """A zero-filled 1-D array whose first element sits on an ALIGN_BYTES boundary."""
    dtype = np.dtype(dtype)
    raw = np.zeros(n_elements * dtype.itemsize + ALIGN_BYTES, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN_BYTES
    return raw[start:start + n_elements * dtype.itemsize].view(dtype)


def aligned_offsets(sizes: Sequence[int], dtype: np.dtype,
                    align: int | None = None) -> tuple[np.ndarray, int]:
    """Offsets that start each parameter on an aligned element (every ``align`` elements;
    by default ALIGN_BYTES of ``dtype``), and the buffer's total length."""
    align = align or ALIGN_BYTES // np.dtype(dtype).itemsize
    offsets = np.empty(len(sizes), dtype=np.int64)
    position = 0
    for k, size in enumerate(sizes):
        offsets[k] = position
        position += -(-int(size) // align) * align
    return offsets, position


def chunk_table(offsets: np.ndarray, sizes: np.ndarray, total: int,
                chunk: int = CHUNK_ELEMENTS) -> np.ndarray:
    """For each chunk of ``chunk`` elements, the slot of the first parameter ending inside it."""
    n_chunks = -(-total // chunk)
    starts = np.arange(n_chunks, dtype=np.int64) * chunk
    ends = offsets + sizes
    return np.searchsorted(ends, starts, side="right").astype(np.int64)


class WalkLayout(NamedTuple):
    """What the backends' chunk walks read of a buffer's layout (``present`` marking the
    parameters a walk visits): a shard's range (``flatopt.distributed``), or a buffer walked
    with another presence (``Optimizer._map_state``)."""

    present: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    chunk_first: np.ndarray
    chunk_size: int
    length: int


class SlotLayout:
    """The packing of a shaped state slot (:attr:`flatopt.Slot.shape`) of one buffer: each
    parameter's entry shape (None: no entry), size, aligned offset, and the slot's length. A
    :class:`FlatBuffer` has the same four attributes for everything parallel to the
    parameters, so code reading a slot takes either."""

    def __init__(self, entry_shapes: Sequence[tuple | None], dtype: np.dtype):
        self.shapes = [None if s is None else tuple(s) for s in entry_shapes]
        self.sizes = np.array([0 if s is None else int(np.prod(s, dtype=np.int64))
                               for s in self.shapes], dtype=np.int64)
        self.offsets, self.length = aligned_offsets(self.sizes, dtype)

    def __eq__(self, other) -> bool:
        return isinstance(other, SlotLayout) and self.shapes == other.shapes \
            and self.length == other.length


class RangeLayout:
    """The elements ``[start, stop)`` of a slot laid out as ``layout`` (a FlatBuffer or a
    SlotLayout): every parameter's entry clipped to the range, offsets relative to ``start``
    (an entry outside it has size 0). What a rank's piece of a sharded checkpoint is checked
    with, by the one value check whole slots get."""

    def __init__(self, layout, start: int, stop: int):
        self.start, self.stop = int(start), int(stop)
        self.length = self.stop - self.start
        starts = np.clip(layout.offsets - self.start, 0, self.length)
        ends = np.clip(layout.offsets + layout.sizes - self.start, 0, self.length)
        self.offsets = starts.astype(np.int64)
        self.sizes = (ends - starts).astype(np.int64)


class FlatBuffer:
    """One contiguous buffer holding every parameter of one group, dtype and storage.

    ``params`` and ``grads`` are aligned 1-D arrays of the same length; every state slot
    (``state[name]``) is another such array, allocated when first needed. Parameter ``slot``
    occupies ``[offsets[slot], offsets[slot] + sizes[slot])`` in all of them.
    ``present[slot]`` marks whether that parameter has a gradient for the next step;
    ``stale[slot]`` that its gradient values are left over from before it went missing
    (``opt.grads[path]`` zeroes them when the view is next taken);
    ``columns`` holds the rule's per-parameter arrays (step counts, flags, bias corrections),
    ``kernel_columns`` the same arrays in the order the rule's kernels take them;
    ``constants`` (name -> path -> value) fills columns that are constants of each
    parameter (``Optimizer.path_columns``: a chain's masks), which loads leave alone.

    ``storage`` (a :class:`flatopt._storage.BufferStorage`) says how they are stored: by
    default everything in the parameters' dtype; with reduced precision ``params`` and
    ``grads`` may be 16-bit, state slots bfloat16 or 8-bit codes (``absmax[name]``: a float32
    scale per 256-element block), ``master`` a float32 copy of 16-bit parameters,
    ``compensation`` their Kahan compensation, and ``draws`` counts the steps whose
    stochastic rounding this buffer has drawn (0 for a buffer stored as computed). ``dtype`` is always what the kernels compute
    in (float32 or float64): scalars, columns and decoded state values.

    Treat every array as read-only outside the optimizer: it changes them in place.
    """

    def __init__(self, number: int, group: int, dtype: np.dtype, ids: Sequence[int],
                 paths: Sequence[str], shapes: Sequence[tuple[int, ...]],
                 columns: dict[str, np.dtype] | None = None,
                 shaped_slots: dict[str, Callable[[tuple], tuple | None]] | None = None,
                 storage=None, constants: Mapping[str, Mapping[str, float]] | None = None):
        self.number = number
        self.group = group
        self.storage = storage
        self.dtype = np.dtype(dtype) if storage is None else storage.compute
        self.ids = np.asarray(ids, dtype=np.int64)
        self.paths = list(paths)
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = np.array([int(np.prod(s, dtype=np.int64)) for s in self.shapes],
                              dtype=np.int64)
        param_dtype = self.dtype if storage is None else storage.param
        grad_dtype = self.dtype if storage is None else storage.grad
        align = None
        if storage is not None and not storage.plain:
            # every array of the buffer starts each parameter on a cache line, and int8
            # state's blocks start at each parameter (bitsandbytes quantizes each tensor)
            smallest = min(param_dtype.itemsize, grad_dtype.itemsize,
                           storage.state_array_dtype.itemsize)
            align = max(ALIGN_BYTES // smallest, storage.alignment or 0)
        self.offsets, self.length = aligned_offsets(self.sizes, self.dtype, align)
        self.chunk_first = chunk_table(self.offsets, self.sizes, self.length)
        self.chunk_size = CHUNK_ELEMENTS
        self.params = aligned_zeros(self.length, param_dtype)
        self.grads = aligned_zeros(self.length, grad_dtype)
        self.master = None
        self.compensation = None
        self.absmax: dict[str, np.ndarray] = {}
        self.draws = 0
        self.coded = storage is not None and not storage.plain
        """Whether the buffer is stored otherwise than it is computed (reduced precision);
        an attribute, as every step asks it of every buffer."""
        self.part = None  # a ZeRO-1 rank's shard holding its master and compensation
        if storage is not None and storage.master:
            self.master = aligned_zeros(self.length, self.dtype)
        if storage is not None and storage.rounding == "kahan":
            self.compensation = aligned_zeros(self.length, param_dtype)
        self.present = np.zeros(len(self.paths), dtype=np.uint8)
        self.stale = np.zeros(len(self.paths), dtype=np.uint8)
        # the gradient buffer starts as zeros: nothing is stale
        self.state: dict[str, np.ndarray] = {}
        self.columns: dict[str, np.ndarray] = {
            name: np.zeros(len(self.paths), dtype=column_dtype)
            for name, column_dtype in (columns or {}).items()}
        for name, values in (constants or {}).items():  # Optimizer.path_columns
            self.columns[name][...] = [values[path] for path in self.paths]
        self.kernel_columns = tuple(self.columns.values())
        self.slot_layouts = {name: SlotLayout([shape_of(s) for s in self.shapes], self.dtype)
                             for name, shape_of in (shaped_slots or {}).items()}

    def __len__(self) -> int:
        return len(self.paths)

    def mark_present(self, slot: int | None = None) -> None:
        """The gradient of ``slot`` (all when None) holds what the next step uses."""
        where = slice(None) if slot is None else slot
        self.present[where] = 1
        self.stale[where] = 0

    def mark_missing(self, slot: int | None = None) -> None:
        """The gradient of ``slot`` (all when None) is missing; its values are stale."""
        where = slice(None) if slot is None else slot
        self.present[where] = 0
        self.stale[where] = 1

    def view(self, flat: np.ndarray, slot: int) -> np.ndarray:
        """The parameter at ``slot`` as a view into ``flat`` with its own shape."""
        start = int(self.offsets[slot])
        return flat[start:start + int(self.sizes[slot])].reshape(self.shapes[slot])

    def layout(self, name: str):
        """Where each parameter's entry lies in state slot ``name`` (or ``"params"``): the
        buffer itself for slots parallel to the parameters, else the slot's
        :class:`SlotLayout`; both have ``shapes``, ``sizes``, ``offsets`` and ``length``."""
        return self.slot_layouts.get(name, self)

    def state_view(self, name: str, slot: int, flat: np.ndarray | None = None):
        """Parameter ``slot``'s entry of state slot ``name`` (of ``flat``, by default the
        slot's buffer) with its own shape, or None when a shaped slot has no entry for it."""
        layout = self.layout(name)
        shape = layout.shapes[slot]
        if shape is None:
            return None
        flat = self.state[name] if flat is None else flat
        start = int(layout.offsets[slot])
        return flat[start:start + int(layout.sizes[slot])].reshape(shape)

    def state_buffer(self, name: str) -> np.ndarray:
        """The flat state buffer ``name``, allocated zero-filled on first use."""
        flat = self.state.get(name)
        if flat is None:
            flat = self.state[name] = aligned_zeros(self.layout(name).length, self.dtype)
        return flat

    def memory(self) -> dict[str, int]:
        """Bytes by kind: parameters, gradients, master weights (and Kahan compensation),
        state (with int8 scales)."""
        extra = [a for a in (self.master, self.compensation) if a is not None]
        return {"params": self.params.nbytes, "grads": self.grads.nbytes,
                "master": sum(a.nbytes for a in extra),
                "state": sum(a.nbytes for a in (*self.state.values(), *self.absmax.values()))}

    @property
    def nbytes(self) -> int:
        return sum(self.memory().values())

    def __repr__(self) -> str:
        return (f"FlatBuffer(number={self.number}, group={self.group}, dtype={self.dtype}, "
                f"params={len(self)}, elements={self.length}, state={sorted(self.state)})")
