"""``python -m bench.precision --quick``: every row is built, stepped and timed."""

import json

import numpy as np
import pytest


def _reduced_precision_available() -> bool:
    try:
        import ml_dtypes

        import flatopt
        flatopt.AdamW({"w": np.zeros(5000, ml_dtypes.bfloat16)}, state_dtype="bfloat16")
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _reduced_precision_available(),
                    reason="flatopt's reduced-precision storage (state_dtype=) is not available")
def test_quick_table_has_every_row(tmp_path, capsys):
    from bench import precision

    out = tmp_path / "precision.json"
    assert precision.main(["--quick", "--rounds", "2", "--quiet",
                           "--json", str(out)]) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    for spec in precision.ROWS:
        assert f"| {spec.name} |" in table
        rec = rows[spec.name]
        if spec.kind == "bitsandbytes" and "skipped" in rec:
            continue  # bitsandbytes not installed: reported, not measured
        assert "error" not in rec, rec.get("error")
        assert rec["median_s"] > 0 and rec["gbps"] > 0
        assert rec["second_step_compiles"] == 0
        assert not rec.get("timed_compiles")
        if spec.kind == "flatopt":  # both bounds, from the in-cache steps and the roofline
            assert rec["compute_ns"] >= 0 and rec["memory_ns"] > 0
            assert rec["binds"] in ("compute", "memory") and rec["bound_vs_float32"] > 0
    assert rows[precision.ROOFLINE]["median_s"] > 0
    assert len(report["targets"]) == 5 and "Targets:" in table


def test_thread_scaling_compares_one_and_two_threads():
    from bench import precision

    def report(threads, seconds):
        return {"threads": threads, "rows": [{"row": "int8 state", "median_s": seconds},
                                             {"row": "bf16 params + bf16 state"}]}

    assert precision.thread_scaling([report(1, 0.04)]) == []
    (line,) = precision.thread_scaling([report(1, 0.04), report(2, 0.025)])
    assert line["met"] is False and line["text"] == "1.60x"
    (line,) = precision.thread_scaling([report(2, 0.02), report(1, 0.04)])
    assert line["met"] is True and line["value"] == 2.0
