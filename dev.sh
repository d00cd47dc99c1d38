#!/usr/bin/env bash
# Sets up a virtual environment (once) and runs a project task.
#   bash dev.sh run          the main job: the example training run
#   bash dev.sh test         the test suite; the property tests draw the same examples on
#                            every run, HYPOTHESIS_PROFILE=explore new ones (conftest.py)
#   bash dev.sh lint         ruff lint and format check, mypy type check
#   bash dev.sh docs         build the documentation site (mkdocs, --strict) into site/
#   bash dev.sh bench        run every benchmark; report under benchmarks/results/
#   bash dev.sh dist         build the wheel and the sdist into dist/
#   bash dev.sh test-wheel   build the wheel, install it into .venv-wheel (the pinned
#                            versions of constraints.txt) and run the quick suite and the
#                            `hlo` tests (-m "not slow or hlo") against it, compiled with
#                            XLA's default settings (GRADACCUM_XLA_DEFAULTS=1)
#   bash dev.sh test-oldest  build the wheel, install it into .venv-oldest (the oldest
#                            supported jax/optax/flax, constraints-oldest.txt) and run
#                            the same tests against the installed package (compiled with
#                            the faster settings of `dev.sh test`)
# Needs only python3 (>= 3.11) with venv and pip; everything else is installed
# into .venv from constraints.txt, the versions the suite was verified with.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"

# ensure_venv DIR CONSTRAINTS PIP_ARGS...: (re)creates DIR when the project's
# requirements changed since it was set up, then installs PIP_ARGS into it.
ensure_venv() {
  local venv="$1" constraints="$2"
  shift 2
  local stamp="$venv/.installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$constraints" -nt "$stamp" ]; then
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -c "$constraints" "$@"
    touch "$stamp"
  fi
}

VENV="${VENV:-.venv}"
ensure_venv "$VENV" constraints.txt -e ".[test,reference,lint,examples,docs]" build
py="$VENV/bin/python"

# Builds the sdist, then the wheel from the sdist, into dist/.
build_dist() {
  rm -rf dist
  "$py" -m build --outdir dist . >/dev/null
}

task="${1:-test}"
shift || true
case "$task" in
  run) exec "$py" examples/digits_convnet.py "$@" ;;
  # One pytest worker per core (pytest-xdist); `-n 0` in the arguments runs in one process.
  test) exec "$py" -m pytest -n auto --dist worksteal "$@" ;;
  lint)
    "$py" -m ruff check .
    "$py" -m ruff format --check .
    exec "$py" -m mypy
    ;;
  docs) NO_MKDOCS_2_WARNING=1 exec "$VENV/bin/mkdocs" build --strict --quiet "$@" ;;
  bench) "$py" benchmarks/run.py "$@" && exec "$py" tools/figures.py ;;
  dist) build_dist && ls dist ;;
  test-wheel | test-oldest)
    # jax-privacy (the `reference` extra) needs optax>=0.2.8: not on the oldest stack,
    # whose tests of it skip with that reason (the `requires` marker).
    if [ "$task" = test-oldest ]; then
      old=.venv-oldest constraints=constraints-oldest.txt extras=test,examples
    else
      old=.venv-wheel constraints=constraints.txt extras=test,reference,examples
    fi
    build_dist
    wheel="$(echo dist/*.whl)"
    ensure_venv "$old" "$constraints" "$wheel[$extras]"
    "$old/bin/python" -m pip install --quiet --no-deps --force-reinstall "$wheel"
    # The tests run from a copy of the repository without the package's source, so that
    # `import gradaccum_jax` finds the installed wheel, as a user's code would.
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    tar -c --exclude=./gradaccum_jax --exclude=./.git --exclude='./.venv*' --exclude=./dist \
      --exclude=./build --exclude=./site --exclude='./.*_cache' . | tar -x -C "$work"
    oldpy="$PWD/$old/bin/python"
    # The repository's compilation cache (see conftest.py): the copy's conftest would
    # otherwise put it in the temporary copy, which is deleted.
    export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR-$PWD/.jax_cache}"
    # The wheel's run compiles with XLA's default settings, as a user has them (`dev.sh
    # test` compiles with faster ones; see conftest.py): every quick test runs both ways
    # in CI. The oldest stack's run checks the older APIs, with the faster settings.
    if [ "$task" = test-wheel ]; then
      export GRADACCUM_XLA_DEFAULTS=1
    fi
    cd "$work"
    installed="$("$oldpy" -c 'import gradaccum_jax, os; print(os.path.dirname(gradaccum_jax.__file__))')"
    case "$installed" in
      "$(cd "$OLDPWD/$old" && pwd)"/*) ;;
      *) echo "gradaccum_jax came from $installed, not the wheel in $old" >&2; exit 1 ;;
    esac
    # By default the tests and the installed package's doctests; given arguments, those.
    [ $# -gt 0 ] || set -- tests "$installed"
    # --confcutdir: the repository's conftest.py lies above the venv; loading it for the
    # doctests would put the source tree on sys.path, ahead of the wheel.
    # The quick suite, and the slow tests that inspect compiled programs (`hlo`): under
    # XLA's defaults (test-wheel), they check the HLO a user's compiler produces.
    "$oldpy" -m pytest -n auto --dist worksteal -p no:cacheprovider \
      --confcutdir="${oldpy%/bin/python}" -m "not slow or hlo" "$@"
    ;;
  *) echo "usage: bash dev.sh {run|test|lint|docs|bench|dist|test-wheel|test-oldest} [args...]" >&2; exit 2 ;;
esac
