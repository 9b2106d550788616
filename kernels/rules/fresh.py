"""A parameter's first step with state, for rules whose state starts from the parameter's
value (schedule-free's ``z = clone(p)``, Prodigy's ``p0``): listed among their helpers."""


def mark_first_steps(present, initialized, first, start, stop, stride):
    """``first[k]``: whether present parameter ``k``'s state is created this step (it had
    none); ``initialized[k]`` then records that it has."""
    for k in range(start, stop, stride):
        if present[k] != 0:
            first[k] = initialized[k] == 0
            initialized[k] = 1
