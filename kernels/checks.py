"""Single-pass checks over flat buffers, used where state is saved or loaded (no temporary
arrays the size of a buffer). Serial on purpose: save may run in a forked child, where a
parallel kernel of the parent's threading layer can hang. ``count_negative_or_nonfinite``
releases the GIL: a load runs it on its reading threads, on each block as it lands."""

from numba import njit


@njit(cache=True, nogil=True)
def count_negative_or_nonfinite(flat):
    """How many values are negative, NaN or infinite (second moments must be none)."""
    bad = 0
    for i in range(flat.size):
        value = flat[i]
        if not (value >= 0 and value - value == 0):  # NaN fails both; inf fails the second
            bad += 1
    return bad


@njit(cache=True)
def first_nonzero_segment(flat, offsets, sizes, selected):
    """The index of the first selected segment ``[offsets[k], offsets[k] + sizes[k])`` of
    ``flat`` holding a non-zero value, or -1."""
    for k in range(offsets.size):
        if selected[k]:
            for i in range(offsets[k], offsets[k] + sizes[k]):
                if flat[i] != 0:
                    return k
    return -1
