"""pytest-benchmark setup for ``pytest bench/`` (not collected by the main test command)."""

import pytest


def pytest_addoption(parser):
    parser.addoption("--bench-large", action="store_true", default=False,
                     help="also run the 64M-element and GPT-2-sized profiles (GBs of memory)")
    parser.addoption("--bench-threads", type=int, default=None,
                     help="Numba and torch thread count (default: all cores)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--bench-large"):
        return
    skip = pytest.mark.skip(reason="large profile: run with --bench-large")
    for item in items:
        if "large" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "large: profile needing GBs of memory")
