"""Shared test scaffolding, and the record of the tests that read a compiled program.

The `hlo` marker names the tests that read a compiled program (its optimised HLO,
`memory_analysis()` or `cost_analysis()`, directly or through the library's planners):
such a check depends on the compiler, and CI runs these tests a second time under XLA's
default settings (`dev.sh test-wheel`). So that none is missed, every run also notes each
test that read one, marked or not, in the file `GRADACCUM_HLO_READERS` names (`dev.sh`
sets it to `.hlo_readers`; lines are only added): a later run that finds the file treats
the quick tests listed there as marked `hlo`. In CI the whole suite runs first, so the
wheel's run under XLA's defaults takes every quick reader and every marked one. The
end-of-run report lists the readers that lack the marker, to be marked.
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import pytest

# ---------------------------------------------------------------------------
# Tests that read a compiled program.

_READERS = ("as_text", "memory_analysis", "cost_analysis")
_reads: list[str] = []  # what the running test read, by reader name


def _recording(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def read(self, *args, **kwargs):
        _reads.append(name)
        return method(self, *args, **kwargs)

    return read


for _name in _READERS:
    setattr(jax.stages.Compiled, _name, _recording(_name, getattr(jax.stages.Compiled, _name)))


def _readers_file() -> pathlib.Path | None:
    path = os.environ.get("GRADACCUM_HLO_READERS", "")
    return pathlib.Path(path) if path else None


# Quick-tier cases measured over the `slow` marker's 5 s, moved to the slow tier.
SLOW_CASES = frozenset(
    line.split()[1]
    for line in (pathlib.Path(__file__).parent / "slow_cases.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Before `-m` selects: marks `slow` the cases of slow_cases.txt, and `hlo` the tests an
    earlier run saw reading a compiled program."""
    path = _readers_file()
    readers = set()
    if path is not None and path.exists():
        readers = {line.split("\t")[0] for line in path.read_text().splitlines()}
    for item in items:
        slow_in_source = item.get_closest_marker("slow") is not None
        if item.nodeid in SLOW_CASES and not slow_in_source:
            item.add_marker(pytest.mark.slow)
        # A test marked slow in its source and noted there (an example run end to end) is
        # left to its marker: under XLA's defaults it would take minutes, and it never ran
        # there before this record.
        if item.nodeid in readers and not slow_in_source:
            item.add_marker(pytest.mark.hlo)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    _reads.clear()
    try:
        return (yield)
    finally:
        read = sorted(set(_reads))
        if read:
            item.user_properties.append(("reads_compiled", ",".join(read)))
            item.user_properties.append(("marked_hlo", item.get_closest_marker("hlo") is not None))
            path = _readers_file()
            if path is not None:
                with open(path, "a") as out:  # appends from the xdist workers stay whole lines
                    out.write(f"{item.nodeid}\t{','.join(read)}\n")


# ---------------------------------------------------------------------------
# Shared scaffolding: fixtures for what the test modules used to define each for itself.


def enable_x64() -> Any:
    """A context manager under which JAX computes in float64, on every supported release."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as older  # jax releases before 0.9

    return older()


@pytest.fixture(scope="session")
def x64() -> Callable[[], Any]:
    """`with x64(): ...` runs the block in float64 (the exactness tests' reference precision)."""
    return enable_x64


@pytest.fixture(scope="session")
def explicit_mesh() -> jax.sharding.Mesh:
    """The 8 forced host devices as one `"data"` axis of `AxisType.Explicit` (0.10's default)."""
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.fixture(scope="session")
def auto_mesh() -> jax.sharding.Mesh:
    """The 8 forced host devices as one `"data"` axis of `AxisType.Auto`."""
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
