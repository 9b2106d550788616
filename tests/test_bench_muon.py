"""``python -m bench.muon``: both steps and both product bounds are printed."""

import re

from bench import muon


def test_small_model_prints_steps_and_product_bounds(capsys):
    assert muon.main(["--model", "small", "--rounds", "1"]) == 0
    line = capsys.readouterr().out
    ours = re.search(r"flatopt ([\d.]+) ms \(float32 products alone ([\d.]+) ms\)", line)
    assert ours and float(ours.group(1)) > 0 and float(ours.group(2)) > 0
    if muon.torch is not None:
        assert re.search(r"torch [\d.]+ ms \(bfloat16 products alone [\d.]+ ms\)", line)


def test_shapes_of_each_model():
    assert list(muon.block_shapes(1, "small").values()) == [(128, 512), (512, 512), (512, 10)]
    assert len(muon.block_shapes(2, "gpt2")) == 8


def test_after_matmuls_times_each_step_after_numpy_products(capsys, monkeypatch):
    calls = []
    real = muon.matmuls

    def counted():
        run = real()

        def wrapped():
            calls.append(1)
            run()
        return wrapped

    monkeypatch.setattr(muon, "matmuls", counted)
    assert muon.main(["--model", "small", "--rounds", "2", "--after-matmuls"]) == 0
    line = capsys.readouterr().out
    assert "after matmuls" in line and re.search(r"ns_dtype=bfloat16 [\d.]+ ms", line)
    assert len(calls) == 2 * (3 if muon.torch is not None else 2)  # before each timed step
