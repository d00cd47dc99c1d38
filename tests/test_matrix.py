"""The route matrix: every capability on every route and model style, exact or refused.

The cells are declared in tests/_matrix.py and built by tests/_matrix_run.py (capabilities)
and tests/_matrix_routes.py (models, styles, routes); each test runs one cell on the 8
forced host devices with a tiny model. With two workers and an empty compilation cache the
whole file took 57 s on this project's 2-core machine under load, its quick part (a Latin
square: every capability on every route and in every style at least once, and every
refusal) 20 s. docs/matrix.md is generated from the same declarations
(`python tools/matrix_table.py`) and checked here.
"""

from __future__ import annotations

import importlib.util
import pathlib
import traceback

import _equivalence as E
import _matrix as M
import _matrix_run as run
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# As in test_global_view.py: older JAX keeps the unreduced type inside jax.shard_map.
UNREDUCED = "unreduced windows and scalars need 0.9.1 (see tests/test_global_view.py)"
LIBRARY = pathlib.Path(__import__("gradaccum_jax").__file__).resolve().parent


def _cell_params():
    for capability, route, style in M.cells():
        declared = M.outcome(capability, route, style)
        if isinstance(declared, M.NotApplicable):
            continue  # nothing to run; test_reasons_for_cells_not_applicable_hold
        marks = [] if M.quick(capability, route, style) else [pytest.mark.slow]
        if route == "jit_unreduced":
            marks.append(pytest.mark.requires(UNREDUCED, jax="0.9.1"))
        if isinstance(declared, M.Pending):
            marks.append(pytest.mark.xfail(strict=True, reason=declared.gap))
        yield pytest.param(
            capability, route, style, marks=marks, id=f"{capability}-{route}-{style}"
        )


def raised_by_library(err: BaseException) -> bool:
    """Whether the innermost frame of `err`'s traceback is this library's own code."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and pathlib.Path(frames[-1].filename).resolve().is_relative_to(LIBRARY)


def _where(err: BaseException) -> str:
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{frame.filename}:{frame.lineno}"


def _kind(err: BaseException) -> str:
    """What an exception from a cell that should be exact is, for the failure message."""
    if not raised_by_library(err):
        return "a bare error from JAX or Flax inside the step, which no user can act on"
    if isinstance(err, ValueError | TypeError):
        return "a refusal by the library: declare the cell Refused if it names the fix"
    return "a crash inside the library"


@pytest.mark.parametrize(("capability", "route", "style"), list(_cell_params()))
def test_cell(capability, route, style):
    declared = M.outcome(capability, route, style)
    if isinstance(declared, M.Pending):
        declared = declared.then
    program = run.CAPABILITY_PROGRAMS[capability]
    if isinstance(declared, M.Refused):
        with pytest.raises(declared.error, match=declared.match) as info:
            program.run(style, route)
        assert raised_by_library(info.value), (
            f"the refusal came from {_where(info.value)}, not from the library's own check"
        )
        return
    try:
        got, want, start = program.run(style, route)
    except Exception as err:
        pytest.fail(f"{type(err).__name__} from {_where(err)} ({_kind(err)}): {err}")
    E.assert_close(got, want, start=start, **M.TOLERANCES[capability])


@pytest.mark.parametrize(
    "witness",
    sorted({d.witness for _, d in M.DECLARATIONS if isinstance(d, M.NotApplicable) and d.witness}),
)
def test_reasons_for_cells_not_applicable_hold(witness):
    assert getattr(run, witness)(), f"{witness}: the reason docs/matrix.md gives no longer holds"


# --- the declarations themselves ----------------------------------------------------------


def test_every_declaration_decides_some_cell():
    decided = {M.deciding(*cell) for cell in M.cells()}
    for i, (pattern, _) in enumerate(M.DECLARATIONS):
        assert i in decided, f"{pattern} decides no cell (shadowed, or names none)"


def test_quick_cells_cover_every_route_and_style_of_each_capability():
    quick = [cell for cell in M.cells() if M.quick(*cell)]
    for capability in M.CAPABILITIES:
        assert {r for c, r, _ in quick if c == capability} == set(M.ROUTES)
        assert {s for c, _, s in quick if c == capability} == set(M.STYLES)


def _table_tool():
    spec = importlib.util.spec_from_file_location(
        "matrix_table", ROOT / "tools" / "matrix_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_page_is_generated_from_the_declarations():
    page = ROOT / "docs" / "matrix.md"
    assert page.read_text(encoding="utf-8") == _table_tool().render(), (
        "docs/matrix.md differs from tests/_matrix.py: run python tools/matrix_table.py"
    )
