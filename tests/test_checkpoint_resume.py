"""Exact resume: save at step k, load in a fresh process, continue; bit-identical to the
uninterrupted run (every registered optimizer; missing gradients; several groups), and
different from a cold start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import checkpoint_resume_script as script
from optimizers import NAMES, info

SCRIPT = Path(__file__).with_name("checkpoint_resume_script.py")


def run_script(*args, plugins=()):
    plugin_args = [arg for module in plugins for arg in ("--plugin", module)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT), *plugin_args, *map(str, args)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def check_exact_resume(tmp_path, kinds, plugins=()):
    """Save at SPLIT in one process, resume in another; compare with an uninterrupted run."""
    run_script("first", tmp_path, *kinds, plugins=plugins)
    run_script("resume", tmp_path, *kinds, plugins=plugins)
    for kind in kinds:
        full = script.build(kind)
        script.run(full, script.build_scheduler(full), 0, script.TOTAL)
        expected = script.dump(full)
        with np.load(tmp_path / f"{kind}-resumed.npz") as resumed:
            resumed = dict(resumed)
        assert sorted(resumed) == sorted(expected), kind
        for key, value in expected.items():
            assert value.dtype == resumed[key].dtype and value.shape == resumed[key].shape
            assert value.tobytes() == resumed[key].tobytes(), f"{kind} {key} differs"
        facts = info(kind)
        if not facts.has_state:
            continue  # a stateless rule: a cold start is a correct resume
        # a cold start from the same parameters (state silently reset) must differ
        cold = script.build(kind)
        cold_sched = script.build_scheduler(cold)
        script.run(cold, cold_sched, 0, script.SPLIT)
        cold.restore({})  # every parameter's state reset, values kept
        hypers = cold.schema.hyperparameters
        for group in cold.param_groups:  # and the groups' state (AdaGradNorm's is all there)
            group.update({name: hypers[name].default for name in cold.schema.group_state})
        script.run(cold, cold_sched, script.SPLIT, script.TOTAL)
        cold_dump = script.dump(cold)
        differing = [k for k in expected if k.endswith("/param")
                     and cold_dump[k].tobytes() != expected[k].tobytes()]
        assert differing, f"{kind}: resume is indistinguishable from a cold start"
        steps = {k: int(v) for k, v in expected.items() if k.endswith("/step")}
        if steps:  # per-parameter step counts survived (late.weight started at 7)
            assert steps["late.weight/step"] < steps["layer1.weight/step"]
            if facts.eager_state:  # state from construction: a never-stepped parameter has 0
                assert steps["frozen.bias/step"] == 0
            else:
                assert "frozen.bias/step" not in steps


# slow: two fresh processes load every optimizer's kernels; the fast loop runs the same check
# on one optimizer (test_registry.py's plugin)
@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    check_exact_resume(tmp_path, NAMES)
