"""Worker of tests/test_checkpoint_stress.py: for SECONDS, steps two small optimizers, saves
them as a run to RUN_DIR and one of them to FILE, and loads both back into other optimizers,
checking that what loads is one whole save (every member's parameters hash to the digest the
save's metadata recorded). Prints one JSON line of counts; exits 1 on any failure.

    python checkpoint_stress_worker.py RUN_DIR FILE SECONDS SEED
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback

import numpy as np

import flatopt


def build(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"sgd": flatopt.SGD({"w": rng.standard_normal((64, 32)).astype(np.float32),
                                "b": rng.standard_normal(32).astype(np.float32)},
                               lr=0.01, momentum=0.9),
            "adamw": flatopt.AdamW({"emb": rng.standard_normal((200, 16)).astype(np.float32)},
                                   lr=1e-3)}


def digest(optimizers: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(optimizers):
        for path in sorted(optimizers[name].params):
            h.update(optimizers[name].params[path].tobytes())
    return h.hexdigest()


def step(optimizers: dict, rng) -> None:
    for opt in optimizers.values():
        opt.step({p: rng.standard_normal(v.shape).astype(v.dtype)
                  for p, v in opt.params.items()})


def main(run_dir: str, file: str, seconds: float, seed: int) -> int:
    rng = np.random.default_rng(seed)
    mine, other = build(seed), build(seed + 1)
    counts = {"run_saves": 0, "run_loads": 0, "file_saves": 0, "file_loads": 0}
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            step(mine, rng)
            flatopt.save(run_dir, mine, metadata={"digest": digest(mine), "seed": seed})
            counts["run_saves"] += 1
            result = flatopt.load(run_dir, other)
            saved = result["sgd"].metadata["digest"]
            assert digest(other) == saved, "a run loaded members of different saves"
            counts["run_loads"] += 1
            one = {"sgd": mine["sgd"]}
            flatopt.save(file, mine["sgd"], metadata={"digest": digest(one)})
            counts["file_saves"] += 1
            result = flatopt.load(file, other["sgd"])
            assert digest({"sgd": other["sgd"]}) == result.metadata["digest"]
            counts["file_loads"] += 1
    except BaseException:
        traceback.print_exc()
        print(json.dumps(counts), flush=True)
        return 1
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
