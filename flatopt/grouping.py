"""Assigning parameters to groups by path pattern."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Mapping, Sequence

from .errors import GroupAssignmentError


def group_by_pattern(params: Mapping[str, Any], rules: Sequence[Mapping[str, Any]], *,
                     rest: Mapping[str, Any] | None = None,
                     allow_unused_rules: bool = False) -> list[dict[str, Any]]:
    """Split ``params`` (path -> array) into torch-style group dicts by glob patterns.

    Each rule is a dict with ``"match"`` (a glob pattern such as ``"*.bias"``, or a list of
    them; ``*`` also crosses dots) and the group's hyperparameter overrides (and optionally a
    ``"label"``). Every parameter must land in exactly one group: parameters matched by no rule
    go to a last group with the ``rest`` overrides, or are an error when ``rest`` is None; a
    parameter matched by two rules is an error; so is a rule that matches nothing, unless
    ``allow_unused_rules``. All offending paths and patterns are reported in one
    :class:`GroupAssignmentError`, at construction rather than at some later load.

    Example::

        groups = group_by_pattern(params, [
            {"match": ["*.bias", "*norm*"], "weight_decay": 0.0, "label": "no_decay"},
        ], rest={"label": "decay"})
        opt = flatopt.AdamW(groups, lr=1e-3, weight_decay=0.1)
    """
    patterns = _rule_patterns(rules)
    problems: list[str] = []
    members: list[dict[str, Any]] = [{} for _ in rules]
    leftover: dict[str, Any] = {}
    unmatched: list[str] = []
    for path, array in params.items():
        hits = [number for number, rule_patterns in enumerate(patterns)
                if any(fnmatchcase(path, pattern) for pattern in rule_patterns)]
        if len(hits) > 1:
            described = "; ".join(f"rule {n} {patterns[n]}" for n in hits)
            problems.append(f"{path!r} matches more than one rule: {described}")
        elif hits:
            members[hits[0]][path] = array
        elif rest is not None:
            leftover[path] = array
        else:
            unmatched.append(path)
    if unmatched:
        all_patterns = [p for rule_patterns in patterns for p in rule_patterns]
        problems.append(f"{len(unmatched)} parameter(s) match no rule (patterns: "
                        f"{all_patterns}); add a rule or pass rest={{}}: "
                        + ", ".join(repr(p) for p in unmatched))
    if not allow_unused_rules:
        problems += _unused_rule_problems(patterns, members)
    if problems:
        raise GroupAssignmentError("\n".join(problems))

    groups = []
    for rule, group_members in zip(rules, members):
        if group_members:
            overrides = {k: v for k, v in rule.items() if k != "match"}
            groups.append({"params": group_members, **overrides})
    if leftover:
        groups.append({"params": leftover, **dict(rest or {})})
    return groups


def _rule_patterns(rules: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Each rule's glob patterns (``"match"``: one or a list), or one error naming every bad
    rule."""
    problems, patterns = [], []
    for number, rule in enumerate(rules):
        match = rule.get("match") if isinstance(rule, Mapping) else None
        if isinstance(match, str):
            match = [match]
        if not match or not all(isinstance(p, str) for p in match):
            problems.append(f"rule {number}: needs 'match', a glob pattern or a list of them")
            match = []
        patterns.append(list(match))
    if problems:
        raise GroupAssignmentError("\n".join(problems))
    return patterns


def _unused_rule_problems(patterns: list[list[str]], members: list[dict]) -> list[str]:
    """Rules, and patterns within a rule's list, that matched no parameter (a typo?)."""
    problems = []
    for number, rule_patterns in enumerate(patterns):
        if not members[number]:
            problems.append(f"rule {number} {rule_patterns} matches no parameter; fix "
                            "the pattern or pass allow_unused_rules=True")
            continue
        for pattern in rule_patterns:
            if not any(fnmatchcase(path, pattern) for path in members[number]):
                problems.append(f"rule {number}: pattern {pattern!r} matches no parameter "
                                f"(a typo?); fix it or pass allow_unused_rules=True")
    return problems
