"""Adding an optimizer costs one rule, one schema + class and one registry line: a test-only
optimizer defined outside flatopt (tests/signum_plugin.py) gets checkpoints, exact resume in a
fresh process, the CLI and the CUDA simulator path for free. A schema that disagrees with its
rule or record fails at registration, not far from its cause."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

import flatopt
import optimizers
from checkpoint_helpers import check_round_trip, make_opt
from flatopt import cli, registry
from test_checkpoint_resume import check_exact_resume

NAME = "SignumTest"


@pytest.fixture
def signum():
    plugin = importlib.import_module("signum_plugin")
    registry.register(plugin.SignumTest)
    yield plugin
    registry.unregister(NAME)


def test_registered_optimizer_round_trips_through_a_checkpoint(signum, tmp_path):
    assert registry.lookup(NAME) is signum.SignumTest
    check_round_trip(NAME, tmp_path)


def test_registered_optimizer_resumes_exactly_in_a_fresh_process(signum, tmp_path):
    check_exact_resume(tmp_path, [NAME], plugins=["signum_plugin"])


def test_registered_optimizer_is_inspected_by_the_cli(signum, tmp_path, capsys):
    flatopt.save(tmp_path / "ck.h5", make_opt(NAME, steps=3))
    assert cli.main(["inspect", str(tmp_path / "ck.h5")]) == 0
    out = capsys.readouterr().out
    assert "optimizer    SignumTest" in out and "step counts  2..3 (7 tensors with state)" in out
    assert cli.main(["verify", str(tmp_path / "ck.h5")]) == 0


def test_registered_optimizer_follows_its_rule(signum):
    opt = signum.SignumTest({"w": np.array([1.0, 1.0, 1.0])}, lr=0.1, beta=0.5,
                            weight_decay=0.5)
    opt.step({"w": np.array([2.0, -2.0, 0.0])})
    np.testing.assert_allclose(opt.params["w"], [0.95 - 0.1, 0.95 + 0.1, 0.95])
    np.testing.assert_allclose(opt.state_of("w").momentum, [1.0, -1.0, 0.0])


def test_a_file_of_an_unregistered_optimizer_is_newer_not_damaged(signum, tmp_path):
    flatopt.save(tmp_path / "ck.h5", make_opt(NAME, steps=1))
    registry.unregister(NAME)
    with pytest.raises(flatopt.CheckpointMismatch, match="upgrade flatopt"):
        flatopt.load(tmp_path / "ck.h5", make_opt("SGD", steps=0))


@pytest.mark.parametrize("change, message", [
    (dict(slots={"momentum": flatopt.Slot(), "extra": flatopt.Slot()}), "slots"),
    (dict(columns={"step": flatopt.Column("uint8", 1, marker=True)}), "column 'step'"),
    (dict(record=tuple), "record"),
])
def test_a_schema_that_disagrees_with_its_rule_is_refused(signum, change, message):
    broken = type("Broken", (signum.SignumTest,),
                  {"schema": dataclasses.replace(signum.SCHEMA, name="Broken", **change)})
    with pytest.raises(TypeError, match=message):
        registry.register(broken)
    assert registry.lookup("Broken") is None


# ----------------------------------------------------------------------------- test facts
def test_every_registered_optimizer_has_facts_that_agree_with_it():
    """tests/optimizers.py's facts cover the registry, name nothing else, and hold: a torch
    oracle exists in torch.optim, bit-exactness has one, the checkpoint settings use every
    state slot, a skip gives its reason."""
    assert list(optimizers.INFO) == registry.names()
    assert set(optimizers.EXPLICIT) <= set(registry.names())
    torch = pytest.importorskip("torch")
    for name, facts in optimizers.INFO.items():
        schema = registry.lookup(name).schema
        assert facts.name == name
        if facts.torch is not None:
            assert hasattr(torch.optim, facts.torch), name
        assert facts.bit_exact is None or facts.torch is not None, name
        if facts.checkpoint_settings is not None:
            opt = registry.lookup(name)(optimizers.fit_params(name, {"w": np.zeros((2, 3))}),
                                        **facts.checkpoint_settings, **facts.every_slot)
            assert set(schema.used_slots(opt.settings()[0])) == set(schema.slots), name
        assert set(facts.tolerance) == {np.dtype(np.float32), np.dtype(np.float64)}, name
        assert all(isinstance(why, str) and why for why in facts.skips.values()), name


def test_a_registered_optimizer_without_an_entry_gets_facts_from_its_schema(signum):
    facts = optimizers.info(NAME)
    assert NAME not in optimizers.EXPLICIT
    assert facts.has_state and not facts.eager_state and facts.torch is None
    assert not (facts.matrices_only or facts.per_matrix_update or facts.train_eval)
    assert facts.checkpoint_settings is None and facts.every_slot == {}
    assert facts.bit_exact is None and facts.tolerance == optimizers.DEFAULT_TOLERANCE
    [case] = optimizers.cases("test_matches_torch_optim", [NAME])
    assert case.values == (NAME,) and "no torch.optim counterpart" in case.marks[0].kwargs["reason"]
    assert optimizers.cases("test_round_trip_is_exact", [NAME]) == [NAME]
