"""Chooses the cover: the quick-tier tests of tests/cover_cases.txt (marker `cover`).

What can differ on the oldest declared stack is what the package does there: every call it
makes into jax, optax and flax sits on one of its lines. So the oldest stack runs a set of
quick-tier tests (not `pure`) that, together, reach every branch (arc) of the package that
the whole quick tier reaches on the pinned stack, chosen by a greedy set cover that prefers
cheap tests (new arcs per second), plus every test marked `requires` (a test of an API that
an older release lacks: it must say so there). The test step still runs every test. With
the pure-Python tests, the cover is also the cover loop (`bash dev.sh test -m "cover or
pure"`): every branch the quick tier reaches, in a fraction of its time.

The input is one run of the quick tier under coverage.py with a context per test and the
suite report's timings, made like this (the plugin is the one in tools/, ~2x slower):

    rm -rf .cov && PYTHONPATH=tools GRADACCUM_SUITE_REPORT=.cov/quick.json CI=true \\
      .venv/bin/python -m pytest -n auto -p coverage_contexts -m "not slow"
    .venv/bin/python tools/cover_cases.py .cov/quick.json      # writes tests/cover_cases.txt

It prints the arcs reached by the quick tier and by the chosen set, and their estimated time.
"""

from __future__ import annotations

import argparse
import glob
import heapq
import json
import pathlib
import sqlite3
import subprocess
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "cover_cases.txt"
HEADER = """\
# The cover's tests (marker `cover`, tests/conftest.py; `dev.sh test-oldest` runs them on the
# oldest declared stack): together they reach every branch of the package that the
# whole quick tier reaches on the pinned stack, plus every test marked `requires`. Written
# by tools/cover_cases.py from a run of the quick tier under coverage.py (its docstring
# says how); regenerate it when tests are added or renamed (a case listed here that is not
# collected fails a run that selects `cover`). Seconds (that run, under coverage), then the test.
"""


def case(nodeid: str) -> str:
    """A test's name in the case lists (tests/conftest.py): a doctest by its dotted name."""
    return nodeid if nodeid.startswith("tests/") else nodeid.split("::", 1)[1]


def collected(marks: str) -> list[str]:
    """The node ids that `pytest -m MARKS` selects, without running them."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            marks,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def arcs_by_test(data_files: list[str]) -> dict[str, set[tuple[str, int, int]]]:
    """Each test's arcs of the package, from coverage.py's data files (one per process)."""
    arcs: dict[str, set[tuple[str, int, int]]] = {}
    for name in data_files:
        db = sqlite3.connect(name)
        rows = db.execute(
            "select context.context, file.path, arc.fromno, arc.tono from arc"
            " join context on context.id = arc.context_id join file on file.id = arc.file_id"
        )
        for context, path, start, end in rows:
            rel = path[path.rindex("gradaccum_jax/") :]
            arcs.setdefault(context, set()).add((rel, start, end))
        db.close()
    return arcs


def choose(arcs: dict[str, set[Any]], seconds: dict[str, float], forced: set[str]) -> set[str]:
    """The tests `forced`, then, greedily, the test that adds the most arcs per second (plus
    0.2 s, a test's own overhead), until the tests chosen reach every arc of `arcs`."""
    chosen = set(forced)
    covered = set().union(*(arcs.get(t, set()) for t in forced))
    universe = set().union(*arcs.values())

    def score(test: str) -> float:
        return -len(arcs[test] - covered) / (seconds.get(test, 1.0) + 0.2)

    # Lazy greedy: a test's gain only falls as others are chosen, so a stale score is an
    # upper bound; a test is taken when its fresh score still leads.
    heap = [(score(t), t) for t in sorted(arcs) if t not in chosen]
    heapq.heapify(heap)
    while covered != universe:
        _, test = heapq.heappop(heap)
        fresh = score(test)
        if fresh == 0:
            continue
        if heap and fresh > heap[0][0]:
            heapq.heappush(heap, (fresh, test))
            continue
        chosen.add(test)
        covered |= arcs[test]
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="the suite report's JSON of the coverage run")
    parser.add_argument("--data", default=str(ROOT / ".cov"), help="coverage data's folder")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()

    seconds = {
        k: v["seconds"] for k, v in json.loads(pathlib.Path(args.report).read_text()).items()
    }
    candidates = set(collected("not slow and not pure"))
    forced = set(collected("requires and not slow and not pure"))
    per_test = arcs_by_test(sorted(glob.glob(f"{args.data}/.coverage.*")))
    # Lines run at import or between tests (context "") are reached by any test's import.
    shared = per_test.pop("", set())
    missing = sorted(candidates - set(per_test) - set(seconds))
    if missing:
        sys.exit(f"{len(missing)} candidates have no coverage or timing, e.g. {missing[:3]}")
    per_test = {t: a for t, a in per_test.items() if t in candidates}
    universe = set().union(*per_test.values())

    chosen = choose(per_test, seconds, forced)
    covered = set().union(*(per_test.get(t, set()) for t in chosen))

    lines = [f"{seconds.get(t, 0.0):6.1f}  {case(t)}" for t in sorted(chosen)]
    pathlib.Path(args.out).write_text(HEADER + "\n".join(lines) + "\n")
    total = sum(seconds.get(t, 0.0) for t in chosen)
    everything = sum(seconds.get(t, 0.0) for t in candidates)
    print(
        f"quick tier (not pure): {len(candidates)} tests, {everything:.0f} s,"
        f" {len(universe)} arcs of the package ({len(universe | shared)} with import-time"
        f" ones); chosen: {len(chosen)} tests ({len(forced)} `requires`),"
        f" {len(covered)} arcs, {total:.0f} s"
    )


if __name__ == "__main__":
    main()
