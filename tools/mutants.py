"""Breaks the library on purpose and runs a rewritten test beside the version it replaced.

A test made cheaper (traced values instead of baked-in ones, fewer but stronger cases)
must still fail on the bugs the old version failed on. For each mutant below this script
patches one line of the package, runs the old test (taken from git at `--before`, written
beside the new one as `tests/test_before_<name>.py`) and the new one, restores the line,
and prints whether each failed:

    python tools/mutants.py --before 850568f

Both columns must say "fails" for every mutant; the unmutated package must pass both.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (name, file, the line as it is, the line broken, the tests: (module, -k expression))
MUTANTS = [
    (
        "no finite check",
        "gradaccum_jax/_window/routes.py",
        "        return valid & trees.all_finite_by_squares(grads) if check else valid",
        "        return valid",
        [("test_accumulation", "nonfinite_micro_gradient_is_dropped")],
    ),
    (
        "infinities pass the finite check",
        "gradaccum_jax/_base/trees.py",
        "    return jnp.all(jnp.isfinite(jnp.stack(list(scalars))))",
        "    return jnp.all(~jnp.isnan(jnp.stack(list(scalars))))",
        [("test_accumulation", "nonfinite_micro_gradient_is_dropped")],
    ),
    (
        "window one micro-step too long",
        "gradaccum_jax/_window/stages.py",
        "        closes = counted & (step >= (jnp.int32(1) if plan.bare else state.window_length))",
        "        closes = counted & (step > (jnp.int32(1) if plan.bare else state.window_length))",
        [("test_accumulation", "test_equals_large_batch")],
    ),
]


def run(module: str, expression: str) -> bool:
    """Whether the selected tests pass."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
         f"tests/{module}.py", "-k", expression],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit with the old tests")
    args = parser.parse_args(argv)
    modules = {module for *_, tests in MUTANTS for module, _ in tests}
    old = {}
    for module in modules:
        text = subprocess.run(
            ["git", "show", f"{args.before}:tests/{module}.py"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        path = ROOT / "tests" / f"test_before_{module.removeprefix('test_')}.py"
        path.write_text(text)
        old[module] = path.stem
    ok = True
    try:
        every = sorted({test for *_, tests in MUTANTS for test in tests})
        for name, file, line, broken, tests in [("none", "", "", "", every), *MUTANTS]:
            path = ROOT / file if file else None
            source = path.read_text() if path else ""
            if path:
                assert source.count(line) == 1, f"{name}: the line is not in {file} once"
                path.write_text(source.replace(line, broken))
            try:
                for module, expression in tests:
                    before, after = run(old[module], expression), run(module, expression)
                    want = path is None
                    ok &= before == want and after == want
                    say = {True: "passes", False: "fails"}
                    print(f"{name:34s} {module}[{expression}]: before {say[before]}, "
                          f"after {say[after]}", flush=True)  # fmt: skip
            finally:
                if path:
                    path.write_text(source)
    finally:
        for stem in old.values():
            (ROOT / "tests" / f"{stem}.py").unlink()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
