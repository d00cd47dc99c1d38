"""Writes docs/matrix.md, the route matrix, from the declarations in tests/_matrix.py.

tests/test_matrix.py runs every cell declared there and fails when docs/matrix.md is not
what this script writes, so the page shows what the tests check.

    python tools/matrix_table.py            # rewrite docs/matrix.md
    python tools/matrix_table.py --check    # exit 1 if docs/matrix.md differs
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "matrix.md"
sys.path.insert(0, str(ROOT / "tests"))

import _matrix as M  # noqa: E402

INTRO = """\
# The route matrix

Every capability on every road: each cell below is a test in `tests/test_matrix.py` that
trains a tiny model with the capability, placed on the route, in the model style, and
compares the variables it ends with against the whole-batch reference (explicit
tolerances, below), or checks that the library refuses the combination with an error of
its own that names the fix. A cell that fails inside the step with a bare JAX or Flax
error fails its test. This page is written by `python tools/matrix_table.py` from the
declarations the tests run (`tests/_matrix.py`), and a test fails when the two differ.

- **exact**: equal to the whole-batch reference within the capability's tolerances.
- **refused**: the library raises the error in the note, naming the fix.
- **n/a**: not meaningful here, for the reason in the note (checked by a test where it
  is a fact about another library).
- **pending**: fails today, for the reason in the note; tested as an expected failure
  whose test fails once the fix lands, so the cell is then declared as it should be.
"""


def _label(outcome: M.Outcome) -> str:
    if isinstance(outcome, M.Pending):
        return f"pending (then {outcome.then.kind})"
    return outcome.kind


def _note(outcome: M.Outcome) -> str | None:
    if isinstance(outcome, M.Refused):
        return f"`{outcome.error.__name__}` matching `{outcome.match}`: {outcome.why}"
    if isinstance(outcome, M.NotApplicable):
        return outcome.why
    if isinstance(outcome, M.Pending):
        then = "" if isinstance(outcome.then, M.Exact) else f" Then: {_note(outcome.then)}"
        return f"{outcome.gap}.{then}"
    return None


def _table() -> tuple[list[str], list[str]]:
    """The table's lines and the notes its cells point to, numbered in order of first use."""
    notes: list[str] = []
    header = ["capability", "style", *(title for title, _ in M.ROUTES.values())]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for capability, (cap_title, _) in M.CAPABILITIES.items():
        for i, (style, (style_title, _)) in enumerate(M.STYLES.items()):
            row = [cap_title if i == 0 else "", style_title]
            for route in M.ROUTES:
                outcome = M.outcome(capability, route, style)
                note = _note(outcome)
                if note is None:
                    row.append(_label(outcome))
                    continue
                if note not in notes:
                    notes.append(note)
                row.append(f"{_label(outcome)} [{notes.index(note) + 1}]")
            lines.append("| " + " | ".join(row) + " |")
    return lines, notes


def _described(heading: str, entries: dict[str, tuple[str, str]]) -> list[str]:
    return [f"## {heading}", "", *(f"- **{t}**: {d}" for t, d in entries.values()), ""]


def render() -> str:
    """The page, from the declarations."""
    table, notes = _table()
    tolerances = [
        f"- {M.CAPABILITIES[c][0]}: `rtol={t['rtol']:g}`, `atol={t['atol']:g}`"
        for c, t in M.TOLERANCES.items()
    ]
    lines = [
        INTRO,
        "## The matrix",
        "",
        *table,
        "",
        "Notes:",
        "",
        *(f"{i}. {note}" for i, note in enumerate(notes, 1)),
        "",
        *_described("Capabilities: what each cell trains, and its reference", M.CAPABILITIES),
        *_described("Routes", M.ROUTES),
        *_described("Model styles", M.STYLES),
        "Other pairings of a model family and a container are not styles: "
        "`ga.flax.TrainState` (like Flax's) holds a linen `apply_fn` and params tree, and "
        "`nnx.Optimizer` / `ga.flax.Optimizer` take NNX modules. NNX modules cross the "
        "route's boundary (`jax.jit`, `jax.shard_map`, `jax.pmap`) as pytrees, and on "
        "`shard_map` only their differentiated variables are cast to varying. An Equinox "
        "model crosses it as its arrays (`eqx.partition(model, eqx.is_array)`, the way "
        "Equinox's users write `shard_map`), whole again inside the step.",
        "",
        "## Tolerances",
        "",
        f"Every cell uses {M.DEVICES} host devices of {M.ROWS} examples per micro-batch "
        f"({M.BATCHNORM_ROWS} for batch normalisation), `K = {M.K}` micro-batches per window "
        f"or step, {M.STEPS} windows or steps of SGD, float32. The comparison is "
        "`numpy.testing.assert_allclose` per variable, after checking that the reference "
        "moved the variables by more than 100 times `atol` (a cell that does nothing "
        "fails):",
        "",
        *tolerances,
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if needed")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if PAGE.read_text(encoding="utf-8") != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python tools/matrix_table.py")
            return 1
        return 0
    PAGE.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
