"""Data-parallel stepping over MPI (flatopt.distributed): real ``mpiexec -n P`` jobs.

One job per world size runs tests/mpi_worker.py, which loops over every registered optimizer
(bit-identity with one process on the rank-order mean gradient, with gradients missing on some
or all ranks, two groups, two dtypes, clipping across ranks, state memory per rank) and then
the error cases (disagreements and one-rank failures raise on every rank, nothing hangs), and
groups added between steps.
Every rank prints one line per check; each check must be reported ok by every rank."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from optimizers import NAMES

WORKER = Path(__file__).with_name("mpi_worker.py")
# a cold Numba cache compiles every rule's kernels in every rank first
TIMEOUT_S = 480


def _mpiexec() -> str | None:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _skip_reason() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    if _mpiexec() is None:
        return "no mpiexec next to the interpreter or on PATH (pip install -e '.[mpi]')"
    return None


pytestmark = [pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason())),
              pytest.mark.mpi, pytest.mark.slow]


def run_job(size: int, *modes: str, succeed: bool = True, worker: str | None = None
            ) -> list[str]:
    """Run the worker (``worker``: another file beside this one) at ``size`` ranks; its
    reports (the job must end in time, and exit 0 when ``succeed``)."""
    script = WORKER if worker is None else WORKER.with_name(worker)
    process = subprocess.Popen([_mpiexec(), "-n", str(size), sys.executable, str(script),
                                *modes], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"mpiexec -n {size} hung (killed after {TIMEOUT_S} s):\n{output[-4000:]}")
    assert (process.returncode == 0) == succeed, \
        f"mpiexec -n {size} exited with {process.returncode}:\n" + output[-6000:]
    # ranks' lines may interleave: split at every report's "[rank R] " prefix
    return [report.strip() for report in re.split(r"(?=\[rank \d+\] )", output)
            if report.startswith("[rank ")]


def checks_by_rank(reports: list[str], size: int) -> dict[str, set[int]]:
    """check text -> the ranks that reported it ok; any FAIL report fails the test."""
    failed = [report for report in reports if re.match(r"\[rank \d+\] FAIL ", report)]
    assert not failed, "\n".join(failed)
    ok: dict[str, set[int]] = {}
    for report in reports:
        match = re.match(r"\[rank (\d+)\] ok (.*)", report)
        if match:
            ok.setdefault(match.group(2), set()).add(int(match.group(1)))
    return ok


@pytest.mark.parametrize("size", [2, 3, 4])
def test_mpi_job_bit_identical_and_errors_on_every_rank(size):
    ok = checks_by_rank(run_job(size, "identity", "mismatch", "groups"), size)
    everyone = set(range(size))
    for name in NAMES:
        assert ok.get(f"identity {name} at {size} ranks") == everyone, name
    expected = ["construction lr mismatch: RankMismatchError",
                "construction path mismatch: RankMismatchError",
                "construction fails on rank 0 only: ParamError",
                "step hyperparameter mismatch: RankMismatchError",
                "bad gradient on rank 0 only: GradientError",
                "invalid lr on rank 1 only: HyperparameterError",
                "max_grad_norm mismatch: RankMismatchError",
                "nothing changed by the refused steps", "a matching step afterwards works",
                "max_grad_norm 1.0 and np.float64(1.0) agree",
                "state_dict refused when sharded: DistributedError",
                "clip_grad_norm refused when sharded: DistributedError",
                "a NaN on rank 1 skips the step on every rank",
                "added group Adagrad", "added group Adam",
                "group added on rank 1 only: RankMismatchError"]
    for check in expected:
        assert ok.get(check) == everyone, check


@pytest.mark.parametrize("size", [2, 3])
def test_schedulefree_train_and_eval_sharded(tmp_path, size):
    """train()/eval() on a sharded schedule-free optimizer (each rank its range, then the
    gather), and a sharded checkpoint saved in eval mode: one process's bits."""
    import mpi_worker
    ok = checks_by_rank(run_job(size, "schedulefree", "--dir", str(tmp_path)), size)
    for name in mpi_worker.SCHEDULE_FREE:
        assert ok.get(f"schedule-free {name} at {size} ranks") == set(range(size)), name


def test_world_size_one_is_a_plain_optimizer():
    ok = checks_by_rank(run_job(1, "single"), 1)
    assert ok.get("world size 1 is plain (Adam)") == {0}
    assert ok.get("world size 1 is plain (LAMB)") == {0}


@pytest.fixture(scope="module")
def saved_at_3(tmp_path_factory) -> Path:
    """A directory of sharded checkpoints saved by 3 ranks (mpi_worker.check_save)."""
    import mpi_worker  # its names; importing it starts no MPI
    directory = tmp_path_factory.mktemp("saved_at_3")
    ok = checks_by_rank(run_job(3, "save", "--dir", str(directory)), 3)
    assert ok.get("a sharded save refuses a file's path: CheckpointError") == {0, 1, 2}
    assert ok.get("a sharded save refuses bad state on one rank: CheckpointError") == {0, 1, 2}
    assert not (directory / "poisoned.h5").exists()  # refused before the target was touched
    for name in mpi_worker.CHECKPOINTED:
        assert ok.get(f"saved {name}") == {0, 1, 2}
    return directory


def test_checkpoint_saved_at_3_ranks_resumes_exactly_at_1_2_and_4(saved_at_3):
    import mpi_worker
    for size in (1, 2, 4):
        ok = checks_by_rank(run_job(size, "resume", "partial", "--dir", str(saved_at_3)), size)
        for name in mpi_worker.CHECKPOINTED:
            assert ok.get(f"resumed {name}.h5 at {size} ranks") == set(range(size)), (name, size)
        assert ok.get(f"partial load at {size} ranks") == set(range(size)), size
        assert ok.get(f"saved hyperparameters at {size} ranks") == set(range(size)), size


def test_single_file_checkpoint_resumes_sharded_at_3_ranks(tmp_path):
    import flatopt
    import mpi_worker
    for name in mpi_worker.CHECKPOINTED:
        opt = mpi_worker.checkpointed(name, None)
        for step in range(mpi_worker.SAVED_AT):
            opt.step(mpi_worker.exact_gradients(opt, step))
        flatopt.save(tmp_path / f"{name}.file.h5", opt, metadata={"step": mpi_worker.SAVED_AT},
                     arrays={"rank": [0]})
    ok = checks_by_rank(run_job(3, "resume_file", "--dir", str(tmp_path)), 3)
    for name in mpi_worker.CHECKPOINTED:
        assert ok.get(f"resumed {name}.file.h5 at 3 ranks") == {0, 1, 2}, name


def test_a_scheduler_failing_on_one_rank_leaves_the_others_unchanged(tmp_path):
    ok = checks_by_rank(run_job(3, "scheduler", "--dir", str(tmp_path)), 3)
    assert ok.get("a scheduler failing on one rank: CheckpointError") == {0, 1, 2}
    assert ok.get("the other ranks' schedulers are unchanged") == {0, 2}
    assert ok.get("a load that works takes the scheduler's state") == {0, 2}


def test_a_partial_sharded_resume_verifies_the_buffers_it_does_not_use(tmp_path):
    import flatopt
    import numpy as np
    params = {"w": np.arange(40000, dtype=np.float32), "x": np.arange(30000, dtype=np.float64)}
    opt = flatopt.Adam(params, lr=0.1)
    opt.step({path: np.ones_like(value) for path, value in params.items()})
    flatopt.save(tmp_path / "sound.h5", opt)
    shutil.copyfile(tmp_path / "sound.h5", tmp_path / "unused.h5")
    _flip_byte_in(tmp_path / "unused.h5", "/groups/0/float64/exp_avg", 100)
    ok = checks_by_rank(run_job(2, "unused", "--dir", str(tmp_path)), 2)
    assert ok.get("a damaged unused buffer is refused: CheckpointCorrupt") == {0, 1}
    assert ok.get("the sound file loads") == {0, 1}


def _reference(name: str, steps: int):
    import mpi_worker
    opt = mpi_worker.checkpointed(name, None)
    for step in range(steps):
        opt.step(mpi_worker.exact_gradients(opt, step))
    return opt


def test_sharded_checkpoint_is_a_directory_that_one_process_reads(saved_at_3):
    """One part file per rank of the last save only, plus the manifest; inspect and verify
    read it; a plain optimizer loads it with the bits of a single-process run."""
    import flatopt
    import mpi_worker
    from flatopt import checkpoint
    for name in mpi_worker.CHECKPOINTED:
        directory = saved_at_3 / f"{name}.h5"
        entries = sorted(os.listdir(directory))
        save_ids = {entry.split(".")[0] for entry in entries if entry != "manifest.h5"}
        assert "manifest.h5" in entries and len(save_ids) == 1, entries
        (save_id,) = save_ids
        assert entries == sorted(["manifest.h5"] + [f"{save_id}.rank{r}-of-3.h5"
                                                    for r in range(3)])
        info = checkpoint.inspect_checkpoint(directory)
        assert (info["format"], info["world_size"], info["save_id"]) == (
            "flatopt.checkpoint.sharded", 3, save_id)
        report = checkpoint.verify_checkpoint(directory)
        assert report["ok"], report["problems"]
        opt = mpi_worker.checkpointed(name, None)
        result = flatopt.load(directory, opt)
        reference = _reference(name, mpi_worker.SAVED_AT)
        assert result.metadata == {"step": mpi_worker.SAVED_AT}
        for path in reference.index.paths:
            assert mpi_worker.same_bits(opt.params[path], reference.params[path]), path
        assert not mpi_worker.state_differences(opt.state_dict(), reference.state_dict())
        # the same state in one file: diff finds the format only
        single = flatopt.save(saved_at_3 / f"{name}.single.h5", reference,
                              metadata={"step": mpi_worker.SAVED_AT}, arrays={"rank": [0]})
        found = checkpoint.diff_checkpoints(directory, single)
        assert not (found["params"] or found["groups"] or found["arrays"]), found
        assert {d["field"] for d in found["header"]} <= {"format", "format_version",
                                                          "world_size"}, found["header"]


def _damaged_copy(saved_at_3: Path, tmp_path: Path, name: str = "Adam") -> Path:
    target = tmp_path / f"{name}.h5"
    shutil.copytree(saved_at_3 / f"{name}.h5", target)
    return target


def _part(directory: Path, rank: int) -> Path:
    (path,) = directory.glob(f"*.rank{rank}-of-3.h5")
    return path


def _flip_byte_in(path: Path, dataset: str, at: int) -> None:
    import h5py
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as handle:
        handle.seek(offset + at)
        value = handle.read(1)[0]
        handle.seek(offset + at)
        handle.write(bytes([value ^ 0x10]))


def test_a_damaged_missing_or_foreign_part_file_is_refused_by_name(saved_at_3, tmp_path):
    import flatopt
    import h5py
    import mpi_worker
    import numpy as np
    from flatopt import checkpoint

    def refused(directory, error, *words):
        opt = _reference("Adam", 1)
        before = {path: opt.params[path].copy() for path in opt.index.paths}
        state = opt.state_dict()
        with pytest.raises(error) as caught:
            flatopt.load(directory, opt)
        for word in words:
            assert word in str(caught.value), (word, str(caught.value))
        assert all(mpi_worker.same_bits(opt.params[p], before[p]) for p in before)
        assert not mpi_worker.state_differences(opt.state_dict(), state)
        assert not checkpoint.verify_checkpoint(directory)["ok"]

    damaged = _damaged_copy(saved_at_3, tmp_path / "damaged")
    _flip_byte_in(_part(damaged, 1), "/fragments/0/float32/exp_avg_sq", 8)
    refused(damaged, flatopt.CheckpointCorrupt, "rank1-of-3", "checksum mismatch")

    missing = _damaged_copy(saved_at_3, tmp_path / "missing")
    _part(missing, 2).unlink()
    refused(missing, flatopt.CheckpointCorrupt, "rank 2's file", "is missing")

    foreign = _damaged_copy(saved_at_3, tmp_path / "foreign")
    shutil.copyfile(_part(saved_at_3 / "LAMB.h5", 1), _part(foreign, 1))  # a smaller file
    refused(foreign, flatopt.CheckpointCorrupt, "rank 1's file", "more than its")

    relabelled = _damaged_copy(saved_at_3, tmp_path / "relabelled")
    with h5py.File(_part(relabelled, 1), "r+") as f:
        f.attrs["save_id"] = np.bytes_("0" * 16)
    refused(relabelled, flatopt.CheckpointCorrupt, "save_id", "rank1-of-3")

    uncommitted = _damaged_copy(saved_at_3, tmp_path / "uncommitted")
    (uncommitted / "manifest.h5").unlink()
    refused(uncommitted, flatopt.CheckpointError, "no manifest.h5")

    edited = _damaged_copy(saved_at_3, tmp_path / "edited")
    with h5py.File(edited / "manifest.h5", "r+") as f:
        table = f["/groups/0/float32/exp_avg"]
        rows = table[...]
        rows[0, 2] -= 1  # first fragment one element shorter
        table[...] = rows
    refused(edited, flatopt.CheckpointCorrupt, "/groups/0/float32/exp_avg")

    newer = _damaged_copy(saved_at_3, tmp_path / "newer")
    with h5py.File(newer / "manifest.h5", "r+") as f:
        f.attrs["format_version"] = 2
    refused(newer, flatopt.CheckpointMismatch, "format version 2", "upgrade flatopt")


def test_a_part_file_that_is_a_symlink_is_refused_without_reading_it(saved_at_3, tmp_path):
    """flatopt writes part files as regular files in the directory; a symlink
    (to the real part moved outside, or to an unrelated file) is refused by name, and the
    error discloses nothing about the file it points at."""
    import flatopt
    import mpi_worker
    from flatopt import checkpoint
    outside = tmp_path / "outside"
    outside.mkdir()
    moved = _damaged_copy(saved_at_3, tmp_path / "moved")
    part = _part(moved, 1)
    part.rename(outside / part.name)
    part.symlink_to(outside / part.name)
    unrelated = _damaged_copy(saved_at_3, tmp_path / "unrelated")
    secret = outside / "secret"
    secret.write_bytes(b"s" * 1_234_567)
    replaced = _part(unrelated, 1)
    replaced.unlink()
    replaced.symlink_to(secret)
    for directory in (moved, unrelated):
        opt = _reference("Adam", 1)
        before = opt.state_dict()
        with pytest.raises(flatopt.CheckpointCorrupt, match="rank 1's file .* is a symlink") \
                as caught:
            flatopt.load(directory, opt)
        assert "1,234,567" not in str(caught.value) and "1234567" not in str(caught.value)
        assert not mpi_worker.state_differences(opt.state_dict(), before)
        report = checkpoint.verify_checkpoint(directory)
        assert not report["ok"] and "symlink" in " ".join(report["problems"])


def _commit_other_save(directory: Path, other: Path) -> None:
    """What a save committing in ``directory`` does: its part files, the manifest renamed into
    place, then the part files of the save it replaces removed."""
    old = [entry for entry in directory.iterdir() if entry.name != "manifest.h5"]
    for entry in other.iterdir():
        if entry.name != "manifest.h5":
            shutil.copyfile(entry, directory / entry.name)
    shutil.copyfile(other / "manifest.h5", directory / ".manifest.h5.tmp")
    os.replace(directory / ".manifest.h5.tmp", directory / "manifest.h5")
    for entry in old:
        entry.unlink()


def test_a_reader_keeps_the_save_it_parsed_while_another_commits(saved_at_3, tmp_path,
                                                                 monkeypatch):
    """A reader holds the part files of the save it parsed, so a commit in the
    same directory cannot pull them away; one that lands while the reader opens them makes
    it read the newer save instead."""
    from flatopt import checkpoint
    from flatopt.checkpoint import manifest
    with checkpoint.open_checkpoint(saved_at_3 / "Adam.h5") as ck:
        expected = ck.read_all()
    directory = _damaged_copy(saved_at_3, tmp_path / "during")
    with checkpoint.open_checkpoint(directory) as ck:
        _commit_other_save(directory, saved_at_3 / "LAMB.h5")
        got = ck.read_all()
    assert sorted(got) == sorted(expected)
    assert all(np.array_equal(got[key], expected[key]) for key in expected)
    directory = _damaged_copy(saved_at_3, tmp_path / "opening")
    real = manifest._check_part_sizes

    def commit_first(ck):  # the commit lands between the manifest's and the parts' opening
        monkeypatch.setattr(manifest, "_check_part_sizes", real)
        _commit_other_save(directory, saved_at_3 / "LAMB.h5")
        real(ck)

    monkeypatch.setattr(manifest, "_check_part_sizes", commit_first)
    with checkpoint.open_checkpoint(directory) as ck:
        assert ck.schema.name == "LAMB" and ck.read_all()


def test_range_reads_read_and_check_only_the_blocks_they_need(saved_at_3, tmp_path):
    import flatopt
    import numpy as np
    from flatopt import checkpoint
    from flatopt.checkpoint.format import BLOCK_BYTES
    # a file: 3 blocks of parameters; the third damaged
    n = 3 * BLOCK_BYTES // 4 - 1000
    opt = flatopt.SGD({"w": np.arange(n, dtype=np.float32)}, lr=0.1)
    path = flatopt.save(tmp_path / "sgd.h5", opt)
    _flip_byte_in(Path(path), "/groups/0/float32/params", 2 * BLOCK_BYTES + 5)
    with checkpoint.open_checkpoint(path) as ck:
        key = next(iter(ck.buffers))
        for start, stop in [(0, 10), (5, BLOCK_BYTES // 4 + 7), (BLOCK_BYTES // 4 - 1,
                                                                  2 * BLOCK_BYTES // 4)]:
            assert np.array_equal(ck.read_range(key, "params", start, stop),
                                  np.arange(start, stop, dtype=np.float32))
        with pytest.raises(flatopt.CheckpointCorrupt, match="checksum mismatch"):
            ck.read_range(key, "params", 2 * BLOCK_BYTES // 4 - 1, 2 * BLOCK_BYTES // 4 + 1)
    # a sharded checkpoint with rank 2's fragment damaged: ranges of ranks 0 and 1 still read
    whole = checkpoint.open_checkpoint(saved_at_3 / "Adam.h5")
    partial = _damaged_copy(saved_at_3, tmp_path / "partial")
    _flip_byte_in(_part(partial, 2), "/fragments/0/float32/exp_avg", 4)
    with whole as full, checkpoint.open_checkpoint(partial) as ck:
        key = (0, "float32")
        rows = ck.buffers[key].datasets["exp_avg"].rows
        assert [row[0] for row in rows] == [0, 1, 2]
        expected = full.read(key, "exp_avg")
        end_of_1 = rows[1][2]
        assert np.array_equal(ck.read_range(key, "exp_avg", 3, end_of_1),
                              expected[3:end_of_1])
        with pytest.raises(flatopt.CheckpointCorrupt, match="rank2-of-3.*checksum mismatch"):
            ck.read_range(key, "exp_avg", 3, end_of_1 + 1)


def test_ranks_given_different_paths_or_checkpoints_are_refused_on_every_rank(tmp_path):
    ok = checks_by_rank(run_job(3, "disagree", "--dir", str(tmp_path)), 3)
    for check in ("ranks given different paths to save: CheckpointError",
                  "the split save wrote nothing",
                  "ranks given different checkpoints to load: CheckpointError",
                  "the error names each rank's", "the split load changed nothing",
                  "the same checkpoint loads"):
        assert ok.get(check) == {0, 1, 2}, check


@pytest.mark.parametrize("killed", [0, 2])
def test_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path, killed):
    import flatopt
    import mpi_worker
    reports = run_job(3, f"kill{killed}", "--dir", str(tmp_path), succeed=False)
    ok = checks_by_rank(reports, 3)
    assert ok.get("first save") == {0, 1, 2}
    if killed == 0:  # killed with its new part file written but not yet renamed into place
        assert list((tmp_path / "killed.h5").glob(".*.rank0-of-3.h5.*.tmp"))
    opt = mpi_worker.checkpointed("Adam", None)
    result = flatopt.load(tmp_path / "killed.h5", opt)  # the first save's manifest and parts
    assert result.metadata == {"step": mpi_worker.SAVED_AT}
    reference = mpi_worker.checkpointed("Adam", None)
    for step in range(mpi_worker.SAVED_AT):
        reference.step(mpi_worker.exact_gradients(reference, step))
    for path in reference.index.paths:
        assert mpi_worker.same_bits(opt.params[path], reference.params[path]), path
    # the next save that commits removes the killed save's part and temporary files
    ok = checks_by_rank(run_job(3, "resave", "--dir", str(tmp_path)), 3)
    assert ok.get("saved again") == {0, 1, 2}
    entries = sorted(os.listdir(tmp_path / "killed.h5"))
    assert len(entries) == 4 and entries[-1] == "manifest.h5", entries
