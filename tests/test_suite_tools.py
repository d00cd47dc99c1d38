"""The suite's own tools: the choice of the tests that the oldest stack runs."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tools"))
import cover_cases

pytestmark = pytest.mark.pure


def test_the_chosen_tests_reach_every_arc_and_prefer_cheap_ones():
    arcs = {
        "a": {1, 2, 3, 4},  # everything, but slow
        "b": {1, 2},
        "c": {3, 4},
        "d": {4},
        "e": set(),
    }
    seconds = {"a": 10.0, "b": 1.0, "c": 1.0, "d": 1.0, "e": 0.0}
    assert cover_cases.choose(arcs, seconds, forced=set()) == {"b", "c"}
    # A forced test is kept; what it reaches is not chosen again.
    assert cover_cases.choose(arcs, seconds, forced={"a"}) == {"a"}
    # Cheap enough, the one test that reaches everything wins.
    assert cover_cases.choose(arcs, {**seconds, "a": 0.5}, forced=set()) == {"a"}
    assert cover_cases.choose({"x": set()}, {}, forced=set()) == set()


def test_a_doctest_is_listed_by_its_dotted_name():
    assert cover_cases.case("tests/test_x.py::test_y[a::b]") == "tests/test_x.py::test_y[a::b]"
    assert cover_cases.case("gradaccum_jax/m.py::gradaccum_jax.m.f") == "gradaccum_jax.m.f"


def test_the_readme_and_dev_sh_quote_the_list_s_length():
    root = pathlib.Path(__file__).parents[1]
    listed = [
        line
        for line in (root / "tests" / "cover_cases.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    readme = " ".join((root / "README.md").read_text().split())
    assert f"the {len(listed)} quick-tier tests of `tests/cover_cases.txt`" in readme
    assert f"test marked `requires` (tools/cover_cases.py chose them: {len(listed)} of" in " ".join(
        (root / "dev.sh").read_text().replace("#", " ").split()
    )
