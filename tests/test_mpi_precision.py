"""ZeRO-1 over reduced-precision buffers (flatopt.distributed): real ``mpiexec -n P`` jobs of
tests/mpi_precision_worker.py. At world sizes 1, 2 and 3, bfloat16 parameters with stochastic
rounding and bfloat16 state, 8-bit blockwise state (float32, bfloat16 and float16 parameters),
master weights with float32 gradients, and LAMB with Kahan summation give one process's bits
on the average gradient (parameters, stored state, block scales, master weights,
compensation), and each rank holds only its range of the state and master weights. Saved
(one file, gathered on rank 0) and loaded at the job's world size, into one process, and from
one process's file, the resumed runs continue bit for bit."""

from __future__ import annotations

import pytest

from test_mpi import _skip_reason, checks_by_rank, run_job

WORKER = "mpi_precision_worker.py"

pytestmark = [pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason())),
              pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_reduced_precision_sharded_is_one_process_bit_for_bit(size):
    import mpi_precision_worker
    ok = checks_by_rank(run_job(size, worker=WORKER), size)
    for case in mpi_precision_worker.CASES:
        assert ok.get(f"precision {case} at {size} ranks") == set(range(size)), case
