"""Shared test scaffolding, the slow tier's measured cases, and the tests that read a program.

The `hlo` marker names the tests that read a compiled program (its optimised HLO,
`memory_analysis()` or `cost_analysis()`, directly or through the library's planners).
Every such program is compiled ahead of time, and during the tests with this marker
conftest.py at the repository root compiles those with XLA's default settings, in every
run, so each check reads the program a user gets. The `plans` marker names the tests that
read one only through a library planner's choice, checked for its own consistency (an
example that plans its chunks): their programs get the fast settings. Each run notes the
tests that read one (`reads_compiled` in the test's report); the end-of-run report lists
those with neither marker, to be marked.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable
from typing import Any

import _equivalence as E
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


# Quick-tier cases measured over the `slow` marker's 5 s, moved to the slow tier.
SLOW_CASES = frozenset(
    line.split(None, 1)[1]
    for line in (pathlib.Path(__file__).parent / "slow_cases.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)


# The cover: quick-tier cases that together reach every branch of the package the quick tier
# reaches (tools/cover_cases.py chose them). The oldest stack runs them (dev.sh test-oldest);
# with the pure-Python tests they are the cover loop, `-m "cover or pure"`.
COVER_CASES = frozenset(
    line.split(None, 1)[1]
    for line in (pathlib.Path(__file__).parent / "cover_cases.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)


def _case(item: pytest.Item) -> str:
    """A test's name in the case lists: its node id, or for a doctest of the package its
    dotted name (dev.sh test-oldest runs the installed wheel's, whose paths differ)."""
    return item.name if isinstance(item, pytest.DoctestItem) else item.nodeid


def _check_cover_cases(config: pytest.Config, names: set[str]) -> None:
    """Where `-m` names `cover` (which collects every test where it is used), a case of
    cover_cases.txt that was not collected is an error: the list is stale."""
    stale = sorted(COVER_CASES - names)
    if "cover" in (config.option.markexpr or "") and stale:
        raise pytest.UsageError(
            f"tests/cover_cases.txt names {len(stale)} tests that were not collected, e.g. "
            f"{stale[:3]}: regenerate it with tools/cover_cases.py (its docstring says how)."
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Before `-m` selects: marks `slow` the cases of slow_cases.txt and `cover` those of
    cover_cases.txt."""
    names = set()
    for item in items:
        name = _case(item)
        names.add(name)
        if name in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
        if name in COVER_CASES:
            item.add_marker(pytest.mark.cover)
    if not hasattr(config, "workerinput"):  # under pytest-xdist the controller checks
        _check_cover_cases(config, names)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """pytest-xdist's controller: the check above, on the ids a worker collected (a
    doctest's id is a path outside the repository, then its dotted name)."""
    names = {i if i.startswith("tests/") else i.split("::", 1)[1] for i in ids}
    _check_cover_cases(node.config, names)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """XLA's defaults for what a test marked `hlo` compiles ahead of time, from its setup to
    its teardown; the fast settings for the others' (conftest.py at the root)."""
    compile_ = jax.stages.Lowered.compile
    if not hasattr(compile_, "active"):  # GRADACCUM_XLA_DEFAULTS=1: defaults everywhere
        return (yield)
    compile_.active = item.get_closest_marker("hlo") is not None
    try:
        return (yield)
    finally:
        compile_.active = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    _reads.clear()
    try:
        return (yield)
    finally:
        read = sorted(set(_reads))
        if read:
            item.user_properties.append(("reads_compiled", ",".join(read)))
            marked = any(item.get_closest_marker(name) for name in ("hlo", "plans"))
            item.user_properties.append(("marked_hlo", marked))


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
    return E.data_mesh(E.EXPLICIT)


@pytest.fixture(scope="session")
def auto_mesh() -> jax.sharding.Mesh:
    """The 8 forced host devices as one `"data"` axis of `AxisType.Auto`."""
    return E.data_mesh(E.AUTO)
