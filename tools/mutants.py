"""Breaks the library on purpose and runs rewritten tests beside the versions they replaced.

A test made cheaper (traced values instead of baked-in ones, fewer but stronger cases,
a reference computed once, runners shared between files) must still fail on the bugs
the old version failed on. For each mutant below this script patches one line of the
package, runs the selected tests twice, restores the line, and prints whether each run
failed:

- before: the tests as they were at `--before` (`git archive` of tests/, conftest.py
  and pyproject.toml into a temporary directory; the package is this checkout's,
  mutated, found through PYTHONPATH), so helper modules change with their tests;
- after: the tests of this checkout.

    python tools/mutants.py --before 850568f [--only NAME]

The unmutated package ("none") must pass both versions of every selection. For a mutant no
selection may fail before and pass after (a bug the old tests caught and the new ones miss),
and the new tests must fail on it somewhere. A selection the mutant does not reach passes
both ways and is printed as such. Both versions run against the same package, so a
difference between them is the tests' own.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The tests each rewrite touched: (file, -k expression, -m expression).
NONFINITE = ("tests/test_accumulation.py", "nonfinite_micro_gradient_is_dropped", "")
LARGE_BATCH = ("tests/test_accumulation.py", "test_equals_large_batch", "")
MATRIX = ("tests/test_matrix.py", "test_cell and (accumulate or microbatch)", "not slow")
ROUTES = ("tests/test_routes.py", "every_route or hsdp_window", "not slow")
GOLDEN = ("tests/test_golden.py", "recorded_outputs", "")
GLOBAL_VIEW = (
    "tests/test_global_view.py",
    "large_batch or global_gradient or weighted_windows",
    "not slow",
)
DISTRIBUTED = (
    "tests/test_distributed.py",
    "large_batch or weighted_mean or sum_over_all",
    "not slow",
)
PRIVACY_X64 = ("tests/test_privacy_fast.py", "float64", "not slow")

# (name, file, the line as it is, the line broken, the tests)
MUTANTS = [
    (
        "no finite check",
        "gradaccum_jax/_window/routes.py",
        "        return valid & trees.all_finite_by_squares(grads) if check else valid",
        "        return valid",
        [NONFINITE],
    ),
    (
        "infinities pass the finite check",
        "gradaccum_jax/_base/trees.py",
        "    return jnp.all(jnp.isfinite(jnp.stack(list(scalars))))",
        "    return jnp.all(~jnp.isnan(jnp.stack(list(scalars))))",
        [NONFINITE],
    ),
    (
        "window one micro-step too long",
        "gradaccum_jax/_window/stages.py",
        "        closes = counted & (step >= (jnp.int32(1) if plan.bare else state.window_length))",
        "        closes = counted & (step > (jnp.int32(1) if plan.bare else state.window_length))",
        [LARGE_BATCH, MATRIX, GOLDEN],
    ),
    (
        "the window's mean over one weight too many",
        "gradaccum_jax/_window/stages.py",
        "        reciprocal = 1 / window.weight",
        "        reciprocal = 1 / (window.weight + 1)",
        [LARGE_BATCH, MATRIX, ROUTES, GOLDEN, GLOBAL_VIEW, DISTRIBUTED],
    ),
    (
        "replicas' weights not summed at the close",
        "gradaccum_jax/_window/engine.py",
        "        return Window(total=total, weight=weight, unit=jnp.ones([], jnp.float32), "
        "stats=stats)",
        "        return Window(total=total, weight=window.weight * window.unit, "
        "unit=jnp.ones([], jnp.float32), stats=stats)",
        [MATRIX, ROUTES, DISTRIBUTED],
    ),
]


def passes(cwd: pathlib.Path, test: tuple[str, str, str]) -> bool:
    """Whether the selected tests pass, run from `cwd` against this checkout's package."""
    file, keyword, marks = test
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", file]
    argv += ["-k", keyword] if keyword else []
    argv += ["-m", marks] if marks else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRADACCUM_HLO_READERS": ""}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1):  # 1: tests failed; anything else: no test ran
        raise RuntimeError(f"{file} [{keyword}] in {cwd}: exit {proc.returncode}\n{proc.stdout}")
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit with the old tests")
    parser.add_argument("--only", help="run this mutant (and the unmutated control) only")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if args.only in (None, m[0])]
    if not mutants:
        parser.error(f"--only: no mutant {args.only!r}; known: {[m[0] for m in MUTANTS]}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        before = pathlib.Path(tmp)
        archive = subprocess.run(
            ["git", "archive", args.before, "tests", "conftest.py", "pyproject.toml", "docs"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        every = sorted({test for *_, tests in mutants for test in tests})
        for name, file, line, broken, tests in [("none", "", "", "", every), *mutants]:
            path = ROOT / file if file else None
            source = path.read_text() if path else ""
            if path:
                if source.count(line) != 1:
                    raise SystemExit(f"{name}: the line is not in {file} exactly once")
                path.write_text(source.replace(line, broken))
            try:
                caught = False
                for test in tests:
                    old, new = passes(before, test), passes(ROOT, test)
                    if path is None:
                        ok &= old and new
                    else:
                        ok &= new or not old  # never: the old tests fail, the new ones pass
                        caught |= not new
                    say = {True: "passes", False: "fails"}
                    print(f"{name:44s} {test[0]} [{test[1]}]: before {say[old]}, "
                          f"after {say[new]}", flush=True)  # fmt: skip
                ok &= path is None or caught
            finally:
                if path:
                    path.write_text(source)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
