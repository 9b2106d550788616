"""Data-parallel training over MPI (mpi4py): ZeRO stage 1 over flatopt's flat buffers.

Every rank builds the same optimizer with ``comm=`` (an mpi4py communicator) and passes its own
gradients; ``step()`` then

1. exchanges, in one small ``allgather``, every rank's local validation result (a bad
   gradient or hyperparameter on one rank makes every rank raise, and none waits in a
   collective the failing rank never reaches), a digest of the parameter layout, the groups'
   settings, the step's options and the gradient presence;
2. combines presence: a gradient present on some rank counts as zeros on the ranks where it is
   missing; one missing on every rank is skipped (no state, no step count), as torch DDP with
   ``find_unused_parameters=True`` averages in zeros for unused parameters;
3. averages the gradients: an ``Alltoallv`` hands every rank the pieces of its own shard from
   every other rank, which it sums in rank order, ``((g0 + g1) + g2) + ...``, then divides by
   the world size. MPI's reduce-scatter is not used: its summation order depends on the
   implementation, the rank and the message size, so it is not bit-identical at 3 or more
   ranks;
4. steps only its shard of every flat buffer. Shards are contiguous ranges whose boundaries are
   multiples of the CPU walk's chunk, so each rank's chunks are chunks of the single-process
   walk: totals that walk combines per chunk (the clipping norm, non-finite counts, LAMB's
   per-parameter norms) are computed per chunk on the owning rank, gathered, and combined in
   chunk order on every rank, which gives the single-process bits. Per-parameter columns (step
   counts, bias corrections) are small and kept on every rank. State is allocated for the
   shard only, so optimizer memory per rank falls as 1/P;
5. all-gathers the parameters (an ``Alltoallv`` of each rank's range to every other rank,
   see ``Sharding.gather``), so every rank holds all of them.

The result is bit-identical to one process stepping on the mean gradient summed in rank order,
at any world size, for every rule with an element-wise span, reduced precision included (16-bit
parameters, master weights, stochastic rounding, Kahan, bfloat16 and 8-bit state: see
``_coded.py``; 16-bit gradients are averaged in float32, then rounded to their dtype). Rules that work on whole matrices
(``Rule.per_parameter``, Muon) run replicated instead: the averaged gradients are all-gathered
and every rank updates every parameter with full state (memory does not fall for them).

After a distributed step ``opt.grads`` holds the averaged gradients only inside the rank's own
shard (the rest holds its local gradients, zeroed where they were missing). Under a world size
above one the state is spread over the ranks, so ``state_dict()``, ``state_of()``,
``load_state_dict()`` and ``restore()`` are refused with a pointer to :func:`consolidated`,
``flatopt.save`` and ``flatopt.load``, which are collective. A world size of one behaves
exactly as ``comm=None``.
"""

from __future__ import annotations

from ._common import DistributedError, RankMismatchError, world_size
from ._sharding import BufferShard, Sharding, build_together
from ._whole import consolidated, plain_copy, state_nbytes, take_from

__all__ = ["DistributedError", "RankMismatchError", "Sharding", "BufferShard", "consolidated",
           "plain_copy", "state_nbytes", "take_from", "build_together", "world_size"]
