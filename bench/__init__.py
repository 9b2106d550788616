"""flatopt's benchmark harness: ``python -m bench`` (runner) and ``pytest bench/``
(pytest-benchmark). Not part of the installed package; run from the repository root."""
