"""Load with bounded memory: buffers are read straight into the optimizer's arrays, verified as
they land; the copy kept to undo a failed load stays within ``staging`` bytes of memory (the
rest goes to a temporary file); any failure after the first overwrite (a checksum, a value
check, the scheduler) puts every array back."""

from __future__ import annotations

import gc
import os
import tempfile
import tracemalloc

import numpy as np
import pytest

import flatopt
from flatopt import _restore as restore_mod
from flatopt import cli
from flatopt.checkpoint import loader as loader_mod
from flatopt.checkpoint import reader
from flatopt.checkpoint import writer as writer_mod
from checkpoint_helpers import data_extent, make_opt, same_snapshot, snapshot, state_equal
from optimizers import slow_beyond

MB = 1 << 20


def big(seed: int, steps: int = 1, n_tensors: int = 16) -> flatopt.Adam:
    """n_tensors x 1M float32 in one buffer (64 MB per slot for 16), Adam."""
    rng = np.random.default_rng(seed)
    opt = flatopt.Adam({f"layer{k}.weight": rng.standard_normal(1 << 20, dtype=np.float32)
                        for k in range(n_tensors)}, lr=1e-3)
    for t in range(steps):
        opt.step({path: rng.standard_normal(view.shape, dtype=np.float32)
                  for path, view in opt.params.items()})
    return opt


def extra_peak(load) -> tuple[int, object]:
    """Bytes allocated at the peak of ``load()`` beyond what is still allocated after it (so
    state slots the load allocates for the optimizer do not count: they are live state)."""
    gc.collect()
    tracemalloc.start()
    try:
        result = load()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - current, result


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("staging") / "big.h5"
    opt = big(0, steps=2)
    flatopt.save(path, opt)
    return path, opt


@pytest.mark.parametrize("stepped", slow_beyond([False, True]), ids=["fresh", "with-state"])
@pytest.mark.parametrize("staging", slow_beyond([None, 16 * MB, 0]))
def test_load_peak_memory_stays_within_the_staging_budget(big_file, stepped, staging):
    path, saved = big_file
    target = big(1, steps=1 if stepped else 0)
    budget = 64 * MB if staging is None else staging  # default: the largest buffer (64 MB)
    extra, result = extra_peak(lambda: flatopt.load(path, target, staging=staging))
    assert state_equal(saved, target)
    # a full staging copy of the file would be 192 MB; the slack covers the index, HDF5's
    # metadata and the Python objects of one load
    assert extra <= budget + 4 * MB, (extra / MB, budget / MB)


def test_fresh_load_of_a_new_optimizer_keeps_no_undo_copy_of_fresh_slots(big_file):
    path, saved = big_file
    target = big(1, steps=0)  # no state slots yet: they are allocated and filled in place
    extra, _ = extra_peak(lambda: flatopt.load(path, target, staging=0))
    assert state_equal(saved, target)
    assert extra <= 4 * MB, extra / MB


def damaged_copies(data: bytes, names):
    for name in names:
        start, size = data_extent(data, name)
        if not size:
            continue
        damaged = bytearray(data)
        damaged[start + size - 1] ^= 0x20
        yield name, bytes(damaged)


@pytest.mark.parametrize("staging", [0, 64, None, 1 << 40],
                         ids=["all-spilled", "mostly-spilled", "default", "all-in-memory"])
def test_a_checksum_failure_in_any_buffer_leaves_the_optimizer_untouched(tmp_path, staging):
    """Every buffer damaged in turn: fills before it have overwritten live arrays, and the
    undo copy (in memory, in the spill file, or both) puts them all back."""
    opt = make_opt("Adam", steps=4)
    flatopt.save(tmp_path / "ck.h5", opt)
    data = (tmp_path / "ck.h5").read_bytes()
    names = [f"/groups/{g}/{d}/{s}" for g, d in ((0, "float32"), (0, "float64"),
                                                    (1, "float32"))
             for s in ("params", "exp_avg", "exp_avg_sq")]
    seen = 0
    for name, damaged in damaged_copies(data, names):
        target = make_opt("Adam", seed=7, steps=2)   # has state: fills overwrite live arrays
        before = snapshot(target)
        with pytest.raises(flatopt.CheckpointCorrupt, match="checksum mismatch") as info:
            flatopt.load(damaged, target, staging=staging)
        assert info.value.buffer == name
        assert same_snapshot(before, snapshot(target)), name
        seen += 1
    assert seen == len(names)
    assert os.listdir(tmp_path) == ["ck.h5"]
    target = make_opt("Adam", seed=7, steps=2)
    flatopt.load(data, target, staging=staging)  # and the sound file loads exactly
    assert state_equal(opt, target)


@pytest.mark.slow
def test_a_late_checksum_failure_in_a_large_load_puts_back_spilled_buffers(big_file, tmp_path):
    path, _ = big_file
    data = path.read_bytes()
    (name, damaged), = damaged_copies(data, ["/groups/0/float32/exp_avg_sq"])
    (tmp_path / "bad.h5").write_bytes(damaged)
    target = big(1, steps=1)
    before = snapshot(target)
    with pytest.raises(flatopt.CheckpointCorrupt, match="checksum mismatch"):
        flatopt.load(tmp_path / "bad.h5", target, staging=16 * MB)  # params and exp_avg spill
    assert same_snapshot(before, snapshot(target))


def test_a_value_check_failure_after_the_fill_leaves_the_optimizer_untouched(tmp_path,
                                                                             monkeypatch):
    opt = make_opt("Adam", steps=3)
    opt.buffers[-1].state["exp_avg_sq"][1] = np.nan  # checksums match: only the value check
    with monkeypatch.context() as patch:
        patch.setattr(writer_mod.Snapshot, "value_problems", lambda self: [])
        flatopt.save(tmp_path / "ck.h5", opt)
    for staging in (0, None):
        target = make_opt("Adam", seed=7, steps=2)
        before = snapshot(target)
        with pytest.raises(flatopt.CheckpointCorrupt, match="exp_avg_sq"):
            flatopt.load(tmp_path / "ck.h5", target, staging=staging)
        assert same_snapshot(before, snapshot(target))


def test_a_failing_scheduler_load_undoes_the_filled_buffers(tmp_path):
    class Scheduler:
        def state_dict(self):
            return {"last_epoch": 3}

        def load_state_dict(self, state):
            raise ValueError("this scheduler refuses")

    opt = make_opt("Adam", steps=3)
    flatopt.save(tmp_path / "ck.h5", opt, scheduler=Scheduler())
    target = make_opt("Adam", seed=7, steps=2)
    before = snapshot(target)
    with pytest.raises(flatopt.CheckpointError, match="this scheduler refuses.*unchanged"):
        flatopt.load(tmp_path / "ck.h5", target, scheduler=Scheduler(), staging=0)
    assert same_snapshot(before, snapshot(target))


def test_staging_must_be_a_number_of_bytes(tmp_path):
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "ck.h5", opt)
    target = make_opt("Adam", seed=7, steps=2)
    before = snapshot(target)
    for bad in (-1, "1GB", float("nan"), np.float32("nan"), True, np.bool_(False), 1j):
        with pytest.raises(flatopt.CheckpointOptionError, match="staging") as info:
            flatopt.load(tmp_path / "ck.h5", target, staging=bad)
        assert isinstance(info.value, ValueError)
        # checked up front: before the file is even looked for
        with pytest.raises(flatopt.CheckpointOptionError, match="staging"):
            flatopt.load(tmp_path / "absent.h5", target, staging=bad)
    assert same_snapshot(before, snapshot(target))
    for good in (np.int64(1000), np.uint8(0), 2.5e9, float("inf")):  # any size a number can say
        flatopt.load(tmp_path / "ck.h5", target, staging=good)
        assert state_equal(opt, target)


def test_too_little_memory_to_read_a_buffer_is_a_typed_error(tmp_path, monkeypatch):
    """A sound checkpoint whose buffers do not fit in memory (160 GB sparse
    under an address-space limit): verify reports it, diff and load raise CheckpointError (not
    "damaged"), and the optimizer is unchanged."""
    opt = make_opt("Adam")
    flatopt.save(tmp_path / "ck.h5", opt)

    def no_memory(n_elements, dtype):
        raise MemoryError(f"Unable to allocate {n_elements * 4 / 2 ** 30:.0f} GiB")

    monkeypatch.setattr(reader, "aligned_zeros", no_memory)
    monkeypatch.setattr(loader_mod, "aligned_zeros", no_memory)
    report = flatopt.checkpoint.verify_checkpoint(tmp_path / "ck.h5")
    assert not report["ok"] and "not enough memory" in report["problems"][0]
    assert cli.main(["verify", str(tmp_path / "ck.h5")]) == 1
    for call in (lambda: flatopt.checkpoint.diff_checkpoints(tmp_path / "ck.h5",
                                                             tmp_path / "ck.h5"),
                 lambda: flatopt.read(tmp_path / "ck.h5")):
        with pytest.raises(flatopt.CheckpointError, match="not enough memory") as info:
            call()
        assert not isinstance(info.value, flatopt.CheckpointCorrupt)
    target = make_opt("Adam", seed=7, steps=2, rules=[])  # other groups: read per path
    before = snapshot(target)
    with pytest.raises(flatopt.CheckpointError, match="not enough memory") as info:
        flatopt.load(tmp_path / "ck.h5", target, strict=False, regroup=True,
                     hyperparameters="live")
    assert not isinstance(info.value, flatopt.CheckpointCorrupt)
    assert same_snapshot(before, snapshot(target))


def test_the_undo_copy_spills_to_the_temporary_directory_not_beside_the_checkpoint(
        tmp_path, monkeypatch):
    """A sound checkpoint in a read-only directory (or on a full disk) loads
    into an optimizer with state: the undo copy beyond staging= goes to tempfile's directory
    ($TMPDIR), never beside the checkpoint."""
    opt = make_opt("Adam")
    (tmp_path / "checkpoints").mkdir()
    path = flatopt.save(tmp_path / "checkpoints" / "ck.h5", opt)
    spill = tmp_path / "spill"
    spill.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill))
    directories = []
    real = tempfile.TemporaryFile

    def recorded(*args, **kwargs):
        directories.append(kwargs.get("dir"))
        return real(*args, **kwargs)

    monkeypatch.setattr(restore_mod.tempfile, "TemporaryFile", recorded)
    target = make_opt("Adam", seed=7, steps=2)  # has state: the undo copy spills (staging=0)
    flatopt.load(path, target, staging=0)
    assert state_equal(opt, target)
    assert directories and all(d in (None, str(spill)) for d in directories), directories


@pytest.mark.parametrize("budget", [None, 0], ids=["in-memory", "spilled"])
def test_the_undo_copy_made_piece_by_piece_puts_back_only_the_pieces_kept(budget):
    """A fill that keeps its undo copy block by block (on the reading threads) and fails
    part-way: the blocks it overwrote come back, and the rest, which it never kept (nor
    overwrote), is not written from a copy that was never made."""
    target = np.arange(1 << 16, dtype=np.float32)
    original = target.copy()
    undo = restore_mod._Undo(budget, None)
    try:
        keep = undo.keeper(target)
        keep(4096, 8192)  # bytes [4096, 8192): elements 1024..2047
        target[1024:2048] = -1
        target[40000:] = 7  # overwritten elsewhere, never kept: restore leaves it
        undo.restore()
    finally:
        undo.close()
    assert np.array_equal(target[:40000], original[:40000])
    assert (target[40000:] == 7).all()


@pytest.mark.slow
def test_a_damaged_block_in_the_middle_of_a_buffer_read_in_place_undoes_every_block(
        big_file, tmp_path):
    """The undo copy of a buffer read in place is made block by block as each one lands:
    a block damaged in the middle of a multi-block buffer (the blocks after it read on other
    threads, before and after it) still leaves every array as it was, in memory or spilled."""
    path, _ = big_file
    data = bytearray(path.read_bytes())
    with loader_mod.open_checkpoint(path) as ck:
        saved = ck.buffers[0, "float32"]
        offset, length = saved.offsets["exp_avg"], saved.lengths["exp_avg"] * 4
    assert length > 4 * reader.BLOCK_BYTES
    data[offset + length // 2] ^= 0x40
    (tmp_path / "bad.h5").write_bytes(bytes(data))
    for staging in (0, 16 * MB, None, 1 << 40):
        target = big(1, steps=1)
        before = snapshot(target)
        with pytest.raises(flatopt.CheckpointCorrupt, match="checksum mismatch"):
            flatopt.load(tmp_path / "bad.h5", target, staging=staging)
        assert same_snapshot(before, snapshot(target)), staging


def test_a_failed_block_read_returns_only_once_every_block_has_finished():
    """The pool's map raises the first error only when every call has finished: a read that
    failed in one block must not start putting arrays back while another thread is still
    writing a later block into them."""
    import threading
    import time
    from flatopt.checkpoint import files
    finished = threading.Event()

    def one(item):
        if item == 0:
            raise OSError("block 0 failed")
        time.sleep(0.2)
        finished.set()
        return item

    with files.pool(2) as workers:
        with pytest.raises(OSError, match="block 0"):
            workers.map(one, [0, 1])
        assert finished.is_set()


@pytest.mark.slow
def test_second_moments_are_checked_block_by_block_as_they_land(tmp_path, monkeypatch):
    """The value check of a slot read in place runs on each block as it lands (on the
    reading threads): bad values in the first, a middle and the last block are all counted,
    into a fresh optimizer and over state, and the optimizer is left as it was."""
    opt = big(2, steps=1)
    flat = opt.buffers[0].state["exp_avg_sq"]
    per_block = reader.BLOCK_BYTES // flat.itemsize
    flat[[3, per_block * 2 + 5, flat.size - 1]] = [np.nan, -1.0, np.inf]
    with monkeypatch.context() as patch:
        patch.setattr(writer_mod.Snapshot, "value_problems", lambda self: [])
        flatopt.save(tmp_path / "ck.h5", opt)
    for target in (big(3, steps=0), big(3, steps=1)):
        before = snapshot(target)
        with pytest.raises(flatopt.CheckpointCorrupt,
                           match="exp_avg_sq holds 3 negative, NaN or infinite"):
            flatopt.load(tmp_path / "ck.h5", target)
        assert same_snapshot(before, snapshot(target))


def test_blocks_are_read_in_cache_sized_pieces_that_the_hooks_see_once():
    """``read_hashed`` streams each block's hash over pieces of READ_PIECE bytes: the hashes
    are the blocks' own, and ``before`` / ``after`` see every byte once, before it is
    overwritten and after it has landed, in pieces no larger than READ_PIECE."""
    from flatopt.checkpoint import files
    from flatopt.checkpoint.format import hash_block
    data = np.random.default_rng(5).integers(0, 256, reader.BLOCK_BYTES * 2 + 12345,
                                             dtype=np.uint8)
    out = np.zeros_like(data)
    seen_before, seen_after = [], []

    def before(start, stop):
        assert not out[start:stop].any()  # not overwritten yet
        seen_before.append((start, stop))

    def after(start, stop):
        assert np.array_equal(out[start:stop], data[start:stop])
        seen_after.append((start, stop))

    with files.pool(2) as workers:
        got = files.read_hashed(files._MemoryReader(memoryview(data.tobytes())), 0,
                                memoryview(out), workers, before, after)
    assert np.array_equal(out, data)
    assert list(got) == [hash_block(data[k:k + reader.BLOCK_BYTES])
                         for k in range(0, data.size, reader.BLOCK_BYTES)]
    for seen in (seen_before, seen_after):
        assert max(stop - start for start, stop in seen) <= files.READ_PIECE
        covered = np.zeros(data.size, np.int64)
        for start, stop in seen:
            covered[start:stop] += 1
        assert (covered == 1).all()


def test_a_full_disk_while_spilling_the_undo_copy_is_reported_as_such(big_file, monkeypatch):
    """The spilled undo copy is written on the reading threads: a full disk there is the
    undo copy's error (a CheckpointError naming it, with the staging= hint), not a damaged
    checkpoint, and the optimizer is left as it was."""
    import errno
    path, _ = big_file
    calls = []

    def full(fd, view, offset):
        calls.append(offset)
        if len(calls) > 3:  # some pieces kept, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        os.pwrite(fd, view, offset)

    monkeypatch.setattr(restore_mod, "pwrite_all", full)
    target = big(1, steps=1)
    before = snapshot(target)
    with pytest.raises(flatopt.CheckpointError, match="keeping a copy of the state") as info:
        flatopt.load(path, target, staging=0)
    assert not isinstance(info.value, flatopt.CheckpointCorrupt)
    assert "larger staging=" in str(info.value)
    assert same_snapshot(before, snapshot(target))
