"""The in-memory state dict (``Optimizer.state_dict`` / ``load_state_dict``): its format, and
the parsing of one into the per-path state and group settings that ``Optimizer.restore``
validates and applies, the path a checkpoint load takes too."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from . import _restore
from .errors import StateDictError, raise_problems
from .schema import describe_group

STATE_DICT_FORMAT = "flatopt.state_dict"
STATE_DICT_VERSION = 1


def build(opt, state: dict) -> dict[str, Any]:
    """The snapshot: format, version, optimizer name, groups (hyperparameters deep-copied,
    params as paths) and ``state`` (path -> entry)."""
    groups = []
    for group in opt.param_groups:
        saved = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
        saved["params"] = list(group["params"])
        groups.append(saved)
    return {"format": STATE_DICT_FORMAT, "version": STATE_DICT_VERSION,
            "optimizer": opt.schema.name, "param_groups": groups, "state": state}


def parse(opt, state_dict: Any, hyperparameters: str):
    """``(state, settings)`` for ``opt.restore`` from a snapshot: its structure, format,
    version and optimizer checked, and with ``hyperparameters="saved"`` each live group's
    values taken from the saved group with exactly its parameters (``settings`` None with
    ``"live"``). Every problem, including restore's own, in one StateDictError."""
    if hyperparameters not in ("saved", "live"):
        raise ValueError("hyperparameters must be 'saved' or 'live', got "
                         f"{hyperparameters!r}")
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"state dict must be a dict, got {type(state_dict).__name__}")
    problems = [f"state dict has no {key!r} entry; was it made by flatopt's state_dict()?"
                for key in ("format", "version", "optimizer", "param_groups", "state")
                if key not in state_dict]
    raise_problems(problems, StateDictError)
    version = state_dict["version"]
    if (state_dict["format"] != STATE_DICT_FORMAT or type(version) is not int
            or not 1 <= version <= STATE_DICT_VERSION):
        raise StateDictError(
            f"state dict format {state_dict['format']!r} version {version!r} is not "
            f"{STATE_DICT_FORMAT!r} version 1..{STATE_DICT_VERSION}; a newer version needs "
            "a newer flatopt")
    if state_dict["optimizer"] != opt.schema.name:
        problems.append(f"state dict is from {state_dict['optimizer']}, this optimizer is "
                        f"{opt.schema.name}")
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(state, Mapping):
        problems.append(f"state dict 'state' must be a dict {{path: {{...}}}}, got "
                        f"{type(state).__name__}")
        state = {}
    settings = None
    if hyperparameters == "saved":
        settings = _saved_settings(opt, saved_groups, problems)
    problems += _restore.restore_problems(opt, state, settings, None, None)
    raise_problems(problems, StateDictError)
    return state, settings


def _saved_settings(opt, saved_groups: Any, problems: list[str]) -> list[dict | None]:
    """Each live group's values from the saved group holding exactly its parameters."""
    if not isinstance(saved_groups, (list, tuple)) or not all(
            isinstance(group, Mapping) and isinstance(group.get("params"), (list, tuple))
            and all(isinstance(path, str) for path in group["params"])
            for group in saved_groups):
        problems.append("state dict 'param_groups' must be a list of dicts, each with a "
                        "'params' list of paths")
        return [None] * len(opt.param_groups)
    by_paths = {frozenset(group["params"]): (number, group)
                for number, group in enumerate(saved_groups)}
    settings: list[dict | None] = []
    for number, paths in enumerate(opt._group_paths):
        match = by_paths.get(frozenset(paths))
        if match is None:
            where = describe_group(number, opt.param_groups[number])
            problems.append(f"{where}: no saved group holds exactly its parameters; the "
                            "grouping changed, load with hyperparameters='live' to keep "
                            "this optimizer's hyperparameters and load state by path")
            settings.append(None)
            continue
        merged = {**opt.param_groups[number], **match[1]}
        values, more = opt.schema.check_group(
            merged, f"saved {describe_group(match[0], match[1])}")
        problems += more
        settings.append(values)
    return settings

