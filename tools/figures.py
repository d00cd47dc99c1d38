"""Writes every benchmark figure quoted in README.md and docs/*.md from one file of rows.

Pages mark a quoted figure as `<!-- fig:NAME -->1.14×<!-- /fig -->`; this script replaces
the text between the two comments with FIGURES[NAME] computed from
`benchmarks/results/rows.json` (what `python benchmarks/run.py` writes). `bash dev.sh bench`
runs it after the benchmarks, so prose and report never disagree;
`tests/test_docs.py` fails when a page and the rows do.

    python tools/figures.py            # rewrite the marked spans
    python tools/figures.py --check    # exit 1 and list the spans that differ
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = ROOT / "benchmarks" / "results" / "rows.json"
SPAN = re.compile(r"<!-- fig:(?P<name>[\w.-]+) -->(?P<value>.*?)<!-- /fig -->", re.S)
BIG = "MLP 33.6M params, 4 leaves"
MANY_LEAVES = "MLP 0.42M params, 200 leaves"
TRAIN_STEP = "MLP 33.56M params"

Rows = dict[str, list[dict[str, Any]]]


def row(rows: Rows, benchmark: str, **match: Any) -> dict[str, Any]:
    """The one row of `benchmark` whose fields equal `match`."""
    found = [r for r in rows.get(benchmark, []) if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise KeyError(f"{len(found)} rows of {benchmark!r} match {match} in {ROWS.name}")
    return found[0]


def micro(rows: Rows, candidate: str, model: str = BIG) -> dict[str, Any]:
    return row(rows, "accumulate", model=model, candidate=candidate)


TIMES = "\u00d7"  # the multiplication sign the pages print after a ratio


def times(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}{TIMES}"


def megabytes(mb: float) -> str:
    return f"{mb * 1e3:.0f} kB" if mb < 1 else f"{mb:.0f} MB"


ACC = "accumulate(adam) micro-step"
ACC_NO_CHECK = "accumulate(adam, skip_nonfinite=False) micro-step"
MULTISTEPS = "optax.MultiSteps(adam) micro-step"
APPLY_EVERY = "optax.chain(adam, apply_every) micro-step"
ZEROS = "floor + zero updates"


def _distributed(rows: Rows, k: int) -> dict[str, Any]:
    return row(rows, "distributed", k=k, candidate="ours")


def _microbatch(rows: Rows, k: int) -> dict[str, Any]:
    return row(rows, "microbatch", method="ours", K=k)


FIGURES: dict[str, Callable[[Rows], str]] = {
    # accumulate benchmark, 33.6M-parameter MLP with Adam
    "micro.temp": lambda r: megabytes(micro(r, ACC)["temp_MB"]),
    "micro.state_copies": lambda r: str(micro(r, ACC)["state_copies"]),
    "micro.x_floor": lambda r: times(micro(r, ACC)["x_floor"], 1),
    "multisteps.temp": lambda r: megabytes(micro(r, MULTISTEPS)["temp_MB"]),
    "multisteps.state_copies": lambda r: str(micro(r, MULTISTEPS)["state_copies"]),
    "multisteps.x_floor": lambda r: times(micro(r, MULTISTEPS)["x_floor"], 1),
    "apply_every.x_floor": lambda r: times(micro(r, APPLY_EVERY)["x_floor"], 1),
    "zeros.x_floor": lambda r: times(micro(r, ZEROS)["x_floor"], 1),
    "micro.x_zeros": lambda r: times(
        micro(r, "ratio: micro-step / (floor + zero updates)")["x_floor"]
    ),
    "micro_no_check.x_zeros": lambda r: times(micro(r, ACC_NO_CHECK)["ms"] / micro(r, ZEROS)["ms"]),
    "micro.speedup_multisteps": lambda r: times(
        micro(r, MULTISTEPS)["ms"] / micro(r, ACC)["ms"], 1
    ),
    "micro.speedup_apply_every": lambda r: times(
        micro(r, APPLY_EVERY)["ms"] / micro(r, ACC)["ms"], 1
    ),
    "boundary.x_adam_floor": lambda r: times(
        micro(r, "ratio: boundary step / (adam alone + floor)")["x_floor"]
    ),
    "leaves.x_zeros": lambda r: times(
        micro(r, "ratio: micro-step / (floor + zero updates)", MANY_LEAVES)["x_floor"], 1
    ),
    # whole train steps at effective batch 256, against a hand-written scan
    "step.calls.x_scan": lambda r: times(
        row(r, "accumulate", model=TRAIN_STEP, candidate="4 x 64: accumulate(adam)")["x_scan"], 1
    ),
    "step.calls_multisteps.x_scan": lambda r: times(
        row(r, "accumulate", model=TRAIN_STEP, candidate="4 x 64: optax.MultiSteps(adam)")[
            "x_scan"
        ],
        1,
    ),
    "step.scan.x_scan": lambda r: times(
        row(
            r,
            "accumulate",
            model=TRAIN_STEP,
            candidate="4 x 64 in one call (scan): accumulate(adam)",
        )["x_scan"],
        1,
    ),
    "step.scan_multisteps.x_scan": lambda r: times(
        row(
            r,
            "accumulate",
            model=TRAIN_STEP,
            candidate="4 x 64 in one call (scan): optax.MultiSteps(adam)",
        )["x_scan"],
        1,
    ),
    # microbatch benchmark, K = 8
    "microbatch8.temp_vs_full": lambda r: times(_microbatch(r, 8)["temp_vs_full"]),
    "microbatch8.time_vs_optax": lambda r: times(_microbatch(r, 8)["time_vs_optax_microbatch"]),
    # distributed benchmark, 8 host devices
    "distributed4.time_ratio": lambda r: times(_distributed(r, 4)["time_ratio_ours_over_usual"]),
    "distributed16.time_ratio": lambda r: times(_distributed(r, 16)["time_ratio_ours_over_usual"]),
    "distributed.window_mb": lambda r: megabytes(_distributed(r, 4)["mb_reduced_per_window"]),
    "distributed4.usual_mb": lambda r: megabytes(
        row(r, "distributed", k=4, candidate="usual")["mb_reduced_per_window"]
    ),
    "distributed16.usual_mb": lambda r: megabytes(
        row(r, "distributed", k=16, candidate="usual")["mb_reduced_per_window"]
    ),
}


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def load_rows(path: pathlib.Path = ROWS) -> Rows:
    return json.loads(path.read_text(encoding="utf-8"))


def render(text: str, rows: Rows) -> tuple[str, list[tuple[str, str, str]]]:
    """Returns `text` with every marked figure recomputed, and the (name, old, new) changes."""
    changes: list[tuple[str, str, str]] = []

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in FIGURES:
            raise KeyError(f"unknown figure {name!r}; known: {sorted(FIGURES)}")
        value = FIGURES[name](rows)
        if value != match["value"]:
            changes.append((name, match["value"], value))
        return f"<!-- fig:{name} -->{value}<!-- /fig -->"

    return SPAN.sub(replace, text), changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if needed")
    parser.add_argument("--rows", type=pathlib.Path, default=ROWS)
    args = parser.parse_args(argv)
    rows = load_rows(args.rows)
    stale = False
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new, changes = render(text, rows)
        for name, old, value in changes:
            print(f"{page.relative_to(ROOT)}: {name}: {old!r} -> {value!r}")
        if changes:
            stale = True
            if not args.check:
                page.write_text(new, encoding="utf-8")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
