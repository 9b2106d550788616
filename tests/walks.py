"""The check that a rule's parallel chunk walk gives its serial walk's bits, shared by the
kernel, caution and user-rule tests."""

from __future__ import annotations

import numpy as np

from flatopt._layout import chunk_table
from flatopt.kernels import threads

SHAPES = {"a": (300,), "b": (), "c": (0,), "d": (17, 9), "e": (64,)}


def serial_and_chunked(make, monkeypatch, shapes=SHAPES, seed: int = 5):
    """Two optimizers ``make(params)`` over the same float32 parameters, stepped 4 times
    alike: one serially, one threaded over 64-element chunks that cut every parameter (a
    different third of the parameters missing their gradient at each step). Asserts their
    parameters' bits are the same; returns (serial, chunked)."""
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    serial, chunked = make(params), make(params)
    for buf in chunked.buffers:
        buf.chunk_size = 64
        buf.chunk_first = chunk_table(buf.offsets, buf.sizes, buf.length, 64)
    for step in range(4):
        grads = {k: rng.standard_normal(s).astype(np.float32)
                 for i, (k, s) in enumerate(shapes.items()) if (step + i) % 3}
        monkeypatch.setattr(threads, "_policy", "never")
        serial.step(grads)
        monkeypatch.setattr(threads, "PARALLEL_MIN_ELEMENTS", 0)
        monkeypatch.setattr(threads, "_policy", "always")
        chunked.step(grads)
        monkeypatch.undo()
    for path in shapes:
        assert chunked.params[path].tobytes() == serial.params[path].tobytes(), path
    return serial, chunked
