"""Data-parallel stepping over MPI (flatopt.distributed): real ``mpiexec -n P`` jobs.

One job per world size runs tests/mpi_worker.py, which loops over every registered optimizer
(bit-identity with one process on the rank-order mean gradient, with gradients missing on some
or all ranks, two groups, two dtypes, clipping across ranks, state memory per rank) and then
the error cases (disagreements and one-rank failures raise on every rank, nothing hangs), and
groups added between steps.
Every rank prints one line per check; each check must be reported ok by every rank."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from optimizers import NAMES

WORKER = Path(__file__).with_name("mpi_worker.py")
# a cold Numba cache compiles every rule's kernels in every rank first
TIMEOUT_S = 480


def _mpiexec() -> str | None:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _skip_reason() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    if _mpiexec() is None:
        return "no mpiexec next to the interpreter or on PATH (pip install -e '.[mpi]')"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def run_job(size: int, *modes: str, succeed: bool = True) -> list[str]:
    """Run the worker at ``size`` ranks; its reports (the job must end in time, and exit 0
    when ``succeed``)."""
    process = subprocess.Popen([_mpiexec(), "-n", str(size), sys.executable, str(WORKER),
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


def test_world_size_one_is_a_plain_optimizer():
    ok = checks_by_rank(run_job(1, "single"), 1)
    assert ok.get("world size 1 is plain (Adam)") == {0}
    assert ok.get("world size 1 is plain (LAMB)") == {0}


def test_checkpoint_saved_at_3_ranks_resumes_exactly_at_1_2_and_4(tmp_path):
    ok = checks_by_rank(run_job(3, "save", "--dir", str(tmp_path)), 3)
    import mpi_worker  # its names; importing it starts no MPI
    for name in mpi_worker.CHECKPOINTED:
        assert ok.get(f"saved {name}") == {0, 1, 2}
    for size in (1, 2, 4):
        ok = checks_by_rank(run_job(size, "resume", "partial", "--dir", str(tmp_path)), size)
        for name in mpi_worker.CHECKPOINTED:
            assert ok.get(f"resumed {name} at {size} ranks") == set(range(size)), (name, size)
        assert ok.get(f"partial load at {size} ranks") == set(range(size)), size


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
    result = flatopt.load(tmp_path / "killed.h5", opt)
    assert result.metadata == {"step": mpi_worker.SAVED_AT}
    reference = mpi_worker.checkpointed("Adam", None)
    for step in range(mpi_worker.SAVED_AT):
        reference.step(mpi_worker.exact_gradients(reference, step))
    for path in reference.index.paths:
        assert mpi_worker.same_bits(opt.params[path], reference.params[path]), path
