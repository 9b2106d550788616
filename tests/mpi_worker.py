"""The MPI side of tests/test_mpi.py: run as ``mpiexec -n P python tests/mpi_worker.py MODE``.

Every rank checks its own results and prints ``[rank R] ok <what>`` or ``[rank R] FAIL <what>``
lines; the process exits non-zero on any failure. Each rank's gradients come from a seed of
(step, rank), so every rank can also compute the single-process reference by itself."""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
for _position, _argument in enumerate(sys.argv[:-1]):  # --plugin MODULE: registers more
    if _argument == "--plugin":                        # optimizers, before NAMES is read
        importlib.import_module(sys.argv[_position + 1])

import flatopt  # noqa: E402
from flatopt import distributed  # noqa: E402
from optimizers import INFO, NAMES, build, random_settings, rich_settings  # noqa: E402

# set when run under mpiexec (importing this module, as test_mpi.py does, starts no MPI)
COMM, RANK, SIZE = None, 0, 1
FAILURES: list[str] = []
ONLY: list[str] = []  # --only NAME...: the optimizers of check_identity and check_schedulefree
                      # (default: every one)


def report(ok: bool, what: str) -> None:
    print(f"[rank {RANK}] {'ok' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILURES.append(what)


# Two groups, two dtypes, buffers of several 16K-element chunks (so every rank owns some at
# 4 ranks) next to small and empty ones; "frozen" never gets a gradient on any rank.
SHAPES = [("body.w1", (300, 250), np.float32, 0), ("body.b1", (250,), np.float32, 0),
          ("body.w2", (40, 30), np.float32, 0), ("body.empty", (0, 4), np.float32, 0),
          ("body.frozen", (64,), np.float32, 0),
          ("head.w", (200, 180), np.float64, 1), ("head.b", (180,), np.float32, 1)]
STEP_OPTIONS = [{}, {"max_grad_norm": 1.0}, {}, {"max_grad_norm": 0.5, "norm_type": np.inf},
                {"grad_scale": 4.0, "max_grad_norm": 2.0, "norm_type": 3.0}]


def initial_params() -> dict:
    rng = np.random.default_rng(7)
    return {path: rng.standard_normal(shape).astype(dtype) for path, shape, dtype, _ in SHAPES}


def groups_for(name: str, params: dict) -> list[dict]:
    settings = [rich_settings(name, 0), random_settings(name, np.random.default_rng(1))]
    if "caution" in settings[0]:  # one cautious group (a reduce over the shards), one plain
        settings[1]["caution"] = not settings[0]["caution"]
    return [{**settings[group], "label": f"g{group}",
             "params": {path: params[path] for path, _, _, g in SHAPES if g == group}}
            for group in range(2)]


def present(path: str, step: int, rank: int) -> bool:
    """Who has which gradient: b1 is missing on some ranks, w2 is present on rank 0 only at
    step 1 (missing everywhere else then), frozen never."""
    if path == "body.frozen":
        return False
    if path == "body.b1":
        return (step + rank) % 3 != 0
    if path == "body.w2":
        return step != 1 or rank == 0
    return True


def local_gradients(opt, step: int, rank: int) -> dict:
    rng = np.random.default_rng(1000 * step + rank)
    grads = {}
    for path in opt.index.paths:
        value = opt.params[path]
        g = rng.standard_normal(value.shape).astype(value.dtype)
        if present(path, step, rank):
            grads[path] = g
    return grads


def mean_gradients(opt, step: int, size: int) -> dict:
    """The rank-order sum ((g0 + g1) + g2) ... divided by the world size; a gradient missing
    on some ranks counts as zeros there, one missing on every rank stays missing."""
    per_rank = [local_gradients(opt, step, rank) for rank in range(size)]
    mean = {}
    for path in opt.index.paths:
        if not any(path in grads for grads in per_rank):
            continue
        zeros = np.zeros_like(opt.params[path])
        total = per_rank[0].get(path, zeros).copy()
        for grads in per_rank[1:]:
            total = total + grads.get(path, zeros)
        mean[path] = total / total.dtype.type(size)
    return mean


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def state_differences(got: dict, want: dict) -> list[str]:
    problems = []
    if set(got["state"]) != set(want["state"]):
        problems.append(f"state paths {sorted(got['state'])} != {sorted(want['state'])}")
    for path in set(got["state"]) & set(want["state"]):
        for key, value in want["state"][path].items():
            if not same_bits(got["state"][path][key], value):
                problems.append(f"state {path}.{key} differs")
    return problems


def check_identity() -> None:
    """Every registered optimizer: parameters and state after several steps equal one
    process's bits on the rank-order mean gradient; optimizer memory per rank ~ 1/P."""
    params = initial_params()
    for name in ONLY or NAMES:
        try:
            groups = groups_for(name, params)
            opt = build(name, groups, comm=COMM)
            # the single-process reference runs on rank 0 (the ranks would only repeat it)
            reference = build(name, groups) if RANK == 0 else None
            problems = []
            for step, options in enumerate(STEP_OPTIONS):
                result = opt.step(local_gradients(opt, step, RANK), **options)
                if reference is None:
                    continue
                expected = reference.step(mean_gradients(reference, step, SIZE), **options)
                if not same_bits(np.float64(result.grad_norm or 0.0),
                                 np.float64(expected.grad_norm or 0.0)):
                    problems.append(f"step {step}: grad_norm {result.grad_norm!r} != "
                                    f"{expected.grad_norm!r}")
            whole = distributed.consolidated(opt, root=0)
            if reference is not None:
                problems += [f"parameter {path} differs on rank 0"
                             for path in reference.index.paths
                             if not same_bits(opt.params[path], reference.params[path])]
                problems += state_differences(whole.state_dict(), reference.state_dict())
            # every rank holds the gathered parameters: the same bits as rank 0's
            digests = COMM.allgather(b"".join(opt.params[p].tobytes() for p in opt.index.paths))
            if len(set(digests)) > 1:
                problems.append("the ranks hold different parameters")
            if SIZE > 1 and opt._sharding is not None and not opt._sharding.replicated:
                full = sum(buf.length * buf.dtype.itemsize * len(opt.schema.used_slots(
                    opt.settings()[buf.group])) for buf in opt.buffers)
                mine = distributed.state_nbytes(opt)
                # the largest buffer's shards differ by at most one chunk
                slack = 2 * 16384 * 8 * len(opt.schema.slots) * len(opt.buffers)
                if not mine <= full / SIZE + slack:
                    problems.append(f"state bytes {mine} on this rank of {full} in all")
            problems = COMM.bcast(problems if RANK == 0 else None) + (
                problems if RANK else [])
            report(not problems, f"identity {name} at {SIZE} ranks" +
                   "".join(f"\n    {p}" for p in problems[:8]))
        except Exception:
            report(False, f"identity {name}: {traceback.format_exc()}")


def expect_everywhere(error_type, what, action) -> None:
    try:
        action()
    except error_type as error:
        report(True, f"{what}: {type(error).__name__}")
        return error
    except Exception as error:
        report(False, f"{what}: {type(error).__name__} {error}")
    else:
        report(False, f"{what}: no error")


def check_mismatches() -> None:
    """Disagreements and local failures raise on every rank (and nothing hangs)."""
    params = {"w": np.ones((200, 100), np.float32), "b": np.zeros(100, np.float32)}
    lr = 0.1 if RANK != SIZE - 1 else 0.2
    error = expect_everywhere(distributed.RankMismatchError, "construction lr mismatch",
                              lambda: flatopt.Adam(params, lr=lr, comm=COMM))
    if error is not None and "lr" not in str(error):
        report(False, f"the message names lr: {error}")
    local = dict(params)
    if RANK == 1:
        local["extra"] = np.ones(3, np.float32)
    expect_everywhere(distributed.RankMismatchError, "construction path mismatch",
                      lambda: flatopt.SGD(local, lr=0.1, comm=COMM))
    bad = dict(params)
    if RANK == 0:
        bad["w"] = np.ones((200, 100), np.int32)
    expect_everywhere(flatopt.ParamError, "construction fails on rank 0 only",
                      lambda: flatopt.SGD(bad, lr=0.1, comm=COMM))
    opt = flatopt.AdamW(params, lr=0.1, comm=COMM)
    before = {path: opt.params[path].copy() for path in params}
    grads = {path: np.ones_like(value) for path, value in params.items()}
    if RANK == SIZE - 1:
        opt.param_groups[0]["weight_decay"] = 0.5
    error = expect_everywhere(distributed.RankMismatchError, "step hyperparameter mismatch",
                              lambda: opt.step(grads))
    if error is not None and "weight_decay" not in str(error):
        report(False, f"the message names weight_decay: {error}")
    opt.param_groups[0]["weight_decay"] = 0.01
    wrong = dict(grads)
    if RANK == 0:
        wrong["w"] = np.ones((3, 3), np.float32)
    expect_everywhere(flatopt.GradientError, "bad gradient on rank 0 only",
                      lambda: opt.step(wrong))
    if RANK == 1:
        opt.param_groups[0]["lr"] = -1.0
    expect_everywhere(flatopt.HyperparameterError, "invalid lr on rank 1 only",
                      lambda: opt.step(grads))
    opt.param_groups[0]["lr"] = 0.1
    clip = 1.0 if RANK else 2.0
    expect_everywhere(distributed.RankMismatchError, "max_grad_norm mismatch",
                      lambda: opt.step(grads, max_grad_norm=clip))
    report(all(same_bits(opt.params[p], before[p]) for p in params),
           "nothing changed by the refused steps")
    report(opt.step(grads).skipped is False, "a matching step afterwards works")
    same = np.float64(1.0) if RANK else 1.0  # the same value in another type agrees
    report(opt.step(grads, max_grad_norm=same).grad_norm is not None,
           "max_grad_norm 1.0 and np.float64(1.0) agree")
    expect_everywhere(distributed.DistributedError, "state_dict refused when sharded",
                      opt.state_dict)
    expect_everywhere(distributed.DistributedError, "clip_grad_norm refused when sharded",
                      lambda: flatopt.clip_grad_norm(opt, 1.0))
    nan = {path: np.full_like(value, np.nan if RANK == 1 else 1.0) for path, value in
           params.items()}
    after = {path: opt.params[path].copy() for path in params}
    result = opt.step(nan, skip_nonfinite=True)
    report(result.skipped and all(same_bits(opt.params[p], after[p]) for p in params),
           "a NaN on rank 1 skips the step on every rank")


def check_added_group() -> None:
    """add_param_group on every rank between steps: the new buffers are sharded (Adagrad's
    eager state too) and the steps stay bit-identical; added on one rank only, the next
    step raises on every rank."""
    for name in ("Adagrad", "Adam"):
        params = initial_params()
        first = {path: params[path] for path in ("body.w1", "body.b1")}
        later = {"head": {"head.w": params["head.w"]}}
        opt = flatopt.registry.lookup(name)(first, comm=COMM)
        reference = flatopt.registry.lookup(name)(first)
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": later["head"], "lr": 0.5})
                reference.add_param_group({"params": later["head"], "lr": 0.5})
            opt.step(local_gradients(opt, step, RANK))
            reference.step(mean_gradients(reference, step, SIZE))
        whole = distributed.consolidated(opt)
        problems = [f"parameter {path} differs" for path in reference.index.paths
                    if not same_bits(opt.params[path], reference.params[path])]
        problems += state_differences(whole.state_dict(), reference.state_dict())
        if distributed.state_nbytes(opt) >= distributed.state_nbytes(whole):
            problems.append("the added group's state is not sharded")
        report(not problems, f"added group {name}" + "".join(f"\n    {p}" for p in problems))
    if RANK == 1:
        opt.add_param_group({"params": {"late": np.ones(5, np.float32)}})
    expect_everywhere(distributed.RankMismatchError, "group added on rank 1 only",
                      lambda: opt.step(local_gradients(opt, 0, RANK)))


def check_world_size_one() -> None:
    """A communicator of one rank is a plain optimizer."""
    from mpi4py import MPI as mpi
    params = initial_params()
    for name in ("Adam", "LAMB"):
        groups = groups_for(name, params)
        opt = build(name, groups, comm=mpi.COMM_SELF)
        reference = build(name, groups)
        for step, options in enumerate(STEP_OPTIONS):
            grads = local_gradients(opt, step, RANK)
            opt.step(grads, **options)
            reference.step(grads, **options)
        report(opt._sharding is None and all(
            same_bits(opt.params[p], reference.params[p]) for p in reference.index.paths)
            and not state_differences(opt.state_dict(), reference.state_dict()),
            f"world size 1 is plain ({name})")


# ---------------------------------------------------------------- checkpoints
CHECKPOINTED = ("Adam", "LAMB", "Adagrad", "Muon", "Adafactor")
SAVED_AT, STEPS = 3, 6


def exact_gradients(opt, step: int) -> dict:
    """The same gradients on every rank, multiples of 1/256 below 2 in magnitude: their sum
    over up to 4 ranks and its division by the world size are exact, so the mean gradient is
    these values at any world size and a run can resume at another one."""
    rng = np.random.default_rng(step)
    grads = {}
    for path in opt.index.paths:
        value = opt.params[path]
        g = (rng.integers(-512, 512, value.shape) / 256).astype(value.dtype)
        if present(path, step, 0):
            grads[path] = g
    return grads


def checkpointed(name: str, comm):
    params = initial_params()
    return build(name, groups_for(name, params), comm=comm)


def check_save(directory: str) -> None:
    """Save at this world size after SAVED_AT steps: every rank writes its part file, rank 0
    the manifest. Adam's path is saved once before (the later save replaces it); a path that
    is a file is refused on every rank."""
    plain = os.path.join(directory, "plain.h5")
    if RANK == 0:
        with open(plain, "wb") as handle:
            handle.write(b"a file, not a directory")
    COMM.Barrier()
    expect_everywhere(flatopt.CheckpointError, "a sharded save refuses a file's path",
                      lambda: flatopt.save(plain, checkpointed("Adam", COMM)))
    poisoned = checkpointed("Adam", COMM)
    poisoned.step(exact_gradients(poisoned, 0))
    if RANK == SIZE - 1:  # a second moment no honest step writes, on one rank only
        shard = next(s for s in poisoned._sharding.shards if s.state["exp_avg_sq"].size)
        shard.state["exp_avg_sq"][0] = -1.0
    expect_everywhere(flatopt.CheckpointError, "a sharded save refuses bad state on one rank",
                      lambda: flatopt.save(os.path.join(directory, "poisoned.h5"), poisoned))
    for name in CHECKPOINTED:
        opt = checkpointed(name, COMM)
        path = os.path.join(directory, f"{name}.h5")
        for step in range(SAVED_AT):
            opt.step(exact_gradients(opt, step))
            if name == "Adam" and step == 0:
                flatopt.save(path, opt, metadata={"step": 1})
        flatopt.save(path, opt, metadata={"step": SAVED_AT},
                     arrays={"rank": np.array([RANK])})
        report(True, f"saved {name}")


def check_resume(directory: str, suffix: str = ".h5") -> None:
    """Load what another world size saved (or one process, ``suffix`` ".file.h5"), step on:
    the parameters and state equal an uninterrupted single-process run's bits."""
    for name in CHECKPOINTED:
        try:
            opt = checkpointed(name, COMM)
            result = flatopt.load(os.path.join(directory, name + suffix), opt)
            for step in range(SAVED_AT, STEPS):
                opt.step(exact_gradients(opt, step))
            reference = checkpointed(name, None)
            for step in range(STEPS):
                reference.step(exact_gradients(reference, step))
            problems = differences_from(opt, reference)
            if result.metadata != {"step": SAVED_AT}:
                problems.append(f"metadata {result.metadata}")
            if result.arrays["rank"].tolist() != [0]:
                problems.append(f"extra arrays {result.arrays} (rank 0's are saved)")
            report(not problems, f"resumed {name}{suffix} at {SIZE} ranks" +
                   "".join(f"\n    {p}" for p in problems[:8]))
        except Exception:
            report(False, f"resumed {name}{suffix}: {traceback.format_exc()}")


def differences_from(opt, reference) -> list[str]:
    """Parameters and state of (sharded) ``opt`` that differ from a one-process
    ``reference``."""
    problems = [f"parameter {path} differs" for path in reference.index.paths
                if not same_bits(opt.params[path], reference.params[path])]
    return problems + state_differences(distributed.consolidated(opt).state_dict(),
                                        reference.state_dict())


def check_partial_load(directory: str) -> None:
    """Load options pass through, exactly as one process takes them: strict=False with a
    saved path dropped by rename leaves that live parameter its value with fresh state (its
    live state is not kept); hyperparameters="saved" on a resume (each rank reads its
    ranges) takes the file's lr."""
    def loaded(comm):
        opt = checkpointed("Adam", comm)
        for step in range(2):  # live state that the load must replace or reset
            opt.step(exact_gradients(opt, 10 + step))
        return opt, flatopt.load(os.path.join(directory, "Adam.h5"), opt, strict=False,
                                 rename={"body.w1": None})

    def saved_settings(comm):
        opt = checkpointed("Adam", comm)
        for group in opt.param_groups:
            group["lr"] *= 3
        return opt, flatopt.load(os.path.join(directory, "Adam.h5"), opt,
                                 hyperparameters="saved")

    for what, load in (("partial load", loaded), ("saved hyperparameters", saved_settings)):
        runs = []
        for comm in (COMM, None):
            opt, result = load(comm)
            opt.step(exact_gradients(opt, SAVED_AT))
            runs.append((opt, result))
        (opt, result), (reference, expected) = runs
        problems = differences_from(opt, reference)
        problems += [f"group {n} lr {a['lr']} != {b['lr']}" for n, (a, b) in enumerate(
            zip(opt.param_groups, reference.param_groups)) if a["lr"] != b["lr"]]
        if [(d.kind, d.where) for d in result.differences] != [
                (d.kind, d.where) for d in expected.differences]:
            problems.append(f"differences {result.differences} != {expected.differences}")
        if result.fresh != expected.fresh:
            problems.append(f"fresh {result.fresh} != {expected.fresh}")
        if load is loaded and "body.w1" not in result.fresh:
            problems.append(f"body.w1 not fresh: {result.fresh}")
        report(not problems, f"{what} at {SIZE} ranks" + "".join(f"\n    {p}"
                                                               for p in problems))


def check_killed_save(directory: str, killed: int) -> None:
    """Save, step, then save again with rank ``killed`` killed in the middle (rank 0: its
    part file complete but not yet renamed into place; another rank: before it writes its
    part file)."""
    import signal
    opt = checkpointed("Adam", COMM)
    for step in range(SAVED_AT):
        opt.step(exact_gradients(opt, step))
    path = os.path.join(directory, "killed.h5")
    flatopt.save(path, opt, metadata={"step": SAVED_AT})
    opt.step(exact_gradients(opt, SAVED_AT))
    report(True, "first save")
    if RANK == killed == 0:
        import flatopt.checkpoint.files as files
        files.os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    elif RANK == killed:
        os.kill(os.getpid(), signal.SIGKILL)
    flatopt.save(path, opt, metadata={"step": SAVED_AT + 1})
    report(False, "the job went on after a rank was killed")


def check_scheduler_undo(directory: str) -> None:
    """A scheduler whose load fails on one rank: every rank raises, every other rank's
    scheduler keeps its state; the same load without the failure takes the saved state."""
    from flatopt.lr_scheduler import StepLR
    opt = checkpointed("Adam", COMM)
    scheduler = StepLR(opt, step_size=2, gamma=0.5)
    for step in range(3):
        opt.step(exact_gradients(opt, step))
        scheduler.step()
    path = os.path.join(directory, "scheduled.h5")
    flatopt.save(path, opt, scheduler=scheduler)
    fresh = checkpointed("Adam", COMM)
    fresh_scheduler = StepLR(fresh, step_size=2, gamma=0.5)
    before = fresh_scheduler.state_dict()
    if RANK == 1:
        def refuse(state):
            raise RuntimeError("refused on rank 1")
        fresh_scheduler.load_state_dict = refuse
    expect_everywhere(flatopt.CheckpointError, "a scheduler failing on one rank",
                      lambda: flatopt.load(path, fresh, scheduler=fresh_scheduler))
    if RANK != 1:
        report(fresh_scheduler.state_dict() == before,
               "the other ranks' schedulers are unchanged")
        flatopt.load(path, fresh, scheduler=fresh_scheduler)
        report(fresh_scheduler.state_dict() == scheduler.state_dict(),
               "a load that works takes the scheduler's state")
    else:
        del fresh_scheduler.load_state_dict
        flatopt.load(path, fresh, scheduler=fresh_scheduler)


def check_unused(directory: str) -> None:
    """A partial resume (each rank reads its ranges) still verifies the file's buffers it
    does not use, as one process does: a damaged one is refused on every rank."""
    def build():
        return flatopt.Adam({"w": np.arange(40000, dtype=np.float32)}, lr=0.1, comm=COMM)
    expect_everywhere(flatopt.CheckpointCorrupt, "a damaged unused buffer is refused",
                      lambda: flatopt.load(os.path.join(directory, "unused.h5"), build(),
                                           strict=False))
    result = flatopt.load(os.path.join(directory, "sound.h5"), build(), strict=False)
    report(result.unused == ["x"], "the sound file loads")


def check_disagreements(directory: str) -> None:
    """Ranks given different paths for one save, or different checkpoints
    for one load, are refused on every rank before anything is written or loaded."""
    def frozen(opt) -> tuple:
        whole = distributed.consolidated(opt)
        return {path: view.copy() for path, view in whole.params.items()}, whole.state_dict()

    opt = checkpointed("Adam", COMM)
    opt.step(exact_gradients(opt, 0))
    a, b = os.path.join(directory, "a.h5"), os.path.join(directory, "b.h5")
    flatopt.save(a, opt, metadata={"save": "a"})
    opt.step(exact_gradients(opt, 1))
    flatopt.save(b, opt, metadata={"save": "b"})
    COMM.Barrier()
    before = sorted(os.listdir(a)), sorted(os.listdir(b))
    COMM.Barrier()
    expect_everywhere(flatopt.CheckpointError, "ranks given different paths to save",
                      lambda: flatopt.save(b if RANK == 1 else a, opt))
    COMM.Barrier()
    report((sorted(os.listdir(a)), sorted(os.listdir(b))) == before,
           "the split save wrote nothing")
    fresh = checkpointed("Adam", COMM)
    unchanged = frozen(fresh)
    error = expect_everywhere(flatopt.CheckpointError, "ranks given different checkpoints to load",
                              lambda: flatopt.load(b if RANK == 1 else a, fresh))
    report(error is not None and "rank 1: " + b in str(error), "the error names each rank's")
    after = frozen(fresh)
    report(state_differences(after[1], unchanged[1]) == [] and
           all(same_bits(after[0][p], unchanged[0][p]) for p in unchanged[0]),
           "the split load changed nothing")
    report(flatopt.load(a, fresh).metadata == {"save": "a"}, "the same checkpoint loads")


def check_resave(directory: str) -> None:
    """Save again where a save was killed (its leftovers are removed once this one commits)."""
    opt = checkpointed("Adam", COMM)
    for step in range(SAVED_AT):
        opt.step(exact_gradients(opt, step))
    flatopt.save(os.path.join(directory, "killed.h5"), opt, metadata={"step": SAVED_AT})
    report(True, "saved again")


SCHEDULE_FREE = tuple(name for name in NAMES if INFO[name].train_eval)  # train()/eval()


def check_schedulefree(directory: str) -> None:
    """Schedule-free train()/eval() sharded: each rank moves its own range of the parameters
    that have state (its shard of z), then the parameters are gathered: after steps with
    switches between them every rank holds one process's bits; a sharded save in eval mode,
    loaded into a fresh sharded optimizer, steps on exactly."""
    params = initial_params()
    for name in [n for n in SCHEDULE_FREE if not ONLY or n in ONLY]:
        try:
            groups = groups_for(name, params)
            opt = build(name, groups, comm=COMM)
            reference = build(name, groups)  # on every rank: each compares its own bits
            problems = []

            def compare(what, sharded):
                for path in reference.index.paths:
                    if not same_bits(sharded.params[path], reference.params[path]):
                        problems.append(f"{what}: parameter {path} differs")
                for number, (a, b) in enumerate(zip(sharded.param_groups,
                                                    reference.param_groups)):
                    if {k: a[k] for k in b if k != "params"} != \
                            {k: b[k] for k in b if k != "params"}:
                        problems.append(f"{what}: group {number} values differ")
            for step in range(4):
                opt.step(local_gradients(opt, step, RANK))
                reference.step(mean_gradients(reference, step, SIZE))
                if step in (1, 3):
                    opt.eval()
                    reference.eval()
                    compare(f"eval after step {step}", opt)
                if step == 1:
                    opt.train()
                    reference.train()
                    compare("train after step 1", opt)
            path = os.path.join(directory, f"{name}.h5")
            flatopt.save(path, opt)
            resumed = build(name, groups, comm=COMM)
            flatopt.load(path, resumed)
            compare("loaded in eval mode", resumed)
            for step in range(4, 6):
                for sharded in (opt, resumed):
                    sharded.train()
                    sharded.step(local_gradients(sharded, step, RANK))
                reference.train()
                reference.step(mean_gradients(reference, step, SIZE))
            compare("stepped on", opt)
            compare("stepped on after the load", resumed)
            whole = distributed.consolidated(resumed, root=0)  # collective
            if RANK == 0:
                problems += state_differences(whole.state_dict(), reference.state_dict())
            report(not problems, f"schedule-free {name} at {SIZE} ranks" +
                   "".join(f"\n    {p}" for p in problems[:8]))
        except Exception:
            report(False, f"schedule-free {name}: {traceback.format_exc()}")


if __name__ == "__main__":
    from mpi4py import MPI
    COMM = MPI.COMM_WORLD
    RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
    arguments = sys.argv[1:]
    directory = arguments.pop(arguments.index("--dir") + 1) if "--dir" in arguments else ""
    arguments = [a for a in arguments if a != "--dir"]
    while "--plugin" in arguments:  # imported above
        del arguments[arguments.index("--plugin"):arguments.index("--plugin") + 2]
    if "--only" in arguments:  # identity for these optimizers only (a focused job)
        ONLY[:] = arguments[arguments.index("--only") + 1:]
        arguments = arguments[:arguments.index("--only")]
    for mode in arguments:
        if mode.startswith("kill"):
            check_killed_save(directory, int(mode[len("kill"):]))
            continue
        {"identity": check_identity, "mismatch": check_mismatches,
         "single": check_world_size_one, "groups": check_added_group,
         "save": lambda: check_save(directory),
         "resave": lambda: check_resave(directory),
         "disagree": lambda: check_disagreements(directory),
         "unused": lambda: check_unused(directory),
         "scheduler": lambda: check_scheduler_undo(directory),
         "resume": lambda: check_resume(directory),
         "resume_file": lambda: check_resume(directory, ".file.h5"),
         "partial": lambda: check_partial_load(directory),
         "schedulefree": lambda: check_schedulefree(directory)}[mode]()
    COMM.Barrier()
    sys.exit(1 if FAILURES else 0)
