"""``python -m bench.inloop --storage``: the in-loop profiles with reduced-precision storage."""

import numpy as np
import pytest

from bench import inloop


def test_storage_profiles_step_what_they_say_and_bound_the_stored_bytes():
    plain = inloop.Loop("1000x100")
    bf16 = inloop.Loop("1000x100", storage="bf16")
    int8 = inloop.Loop("64x16K", storage="int8")  # (8-bit state from 4,096 elements)
    assert {str(v.dtype) for v in bf16.opt.params.values()} == {"bfloat16"}
    assert bf16.opt.storage[0].state_dtype == "bfloat16"
    assert int8.opt.storage[0].state_dtype == "int8"
    # AdamW moves 28 B per float32 element, 14 with bf16 parameters and state; clipping
    # reads the gradients once more (4 B, 2 B)
    assert plain.step_bytes(False) == 28 * plain.n_elements
    assert bf16.step_bytes(False) == 14 * bf16.n_elements
    assert bf16.step_bytes(True) == 16 * bf16.n_elements
    assert 16 * int8.n_elements <= int8.step_bytes(False) < 17 * int8.n_elements
    before = bf16.opt.params["layer0.weight"].copy()
    assert inloop.time_condition(bf16, "clip+sched", "matmul", steps=2) > 0
    assert not np.array_equal(bf16.opt.params["layer0.weight"], before)


def test_the_mlp_profile_is_float32_only():
    with pytest.raises(ValueError, match="synthetic"):
        inloop.Loop("mlp74k", storage="int8")
    with pytest.raises(SystemExit):
        inloop.main(["--storage", "int8", "--profiles", "mlp74k"])
