"""A pytest plugin: branch coverage of gradaccum_jax with each test as its own context.

Loaded with `-p coverage_contexts` (tools/ on PYTHONPATH) in every pytest process, the
pytest-xdist workers included; each writes its data to .cov/.coverage.<host>.<pid>.
tools/cover_cases.py reads those files (its docstring shows the command); `coverage
combine` and `coverage report` read them too.
"""

from __future__ import annotations

import os

import coverage
import pytest

_coverage: coverage.Coverage | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _coverage
    folder = os.environ.get("GRADACCUM_COVERAGE_DIR", ".cov")
    os.makedirs(folder, exist_ok=True)
    _coverage = coverage.Coverage(
        branch=True,
        source=["gradaccum_jax"],
        data_file=os.path.join(folder, ".coverage"),
        data_suffix=True,
    )
    # The controller of an xdist run runs no test, and so measures nothing.
    _coverage.set_option("run:disable_warnings", ["no-data-collected", "module-not-measured"])
    _coverage.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _coverage is not None:
        _coverage.stop()
        _coverage.save()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    assert _coverage is not None
    _coverage.switch_context(item.nodeid)
    try:
        return (yield)
    finally:
        _coverage.switch_context("")
