#!/usr/bin/env bash
# Sets up a virtual environment (once) and runs a project task.
#   bash dev.sh run          the main job: the example training run
#   bash dev.sh test         the whole suite (README's test command); `-m "not slow"` is the
#                            quick loop, `-m "cover or pure"` the cover loop (every branch the
#                            quick tier reaches, in a fraction of its time); the property
#                            tests draw the same examples on every run,
#                            HYPOTHESIS_PROFILE=explore new ones (conftest.py)
#   bash dev.sh setup        create or update .venv only (CI times it as its own step)
#   bash dev.sh lint         ruff lint and format check, mypy type check
#   bash dev.sh docs         build the documentation site (mkdocs, --strict) into site/
#   bash dev.sh bench        run every benchmark; report under benchmarks/results/
#   bash dev.sh dist         build the wheel and the sdist into dist/
#   bash dev.sh test-wheel   build the wheel (once per source change), install it into
#                            .venv-wheel (the pinned versions of constraints.txt) and run,
#                            against the installed package and compiled with XLA's default
#                            settings (GRADACCUM_XLA_DEFAULTS=1), the packaging and public-API
#                            tests and the package's doctests (`wheel`)
#   bash dev.sh test-oldest  the same wheel installed into .venv-oldest (the oldest supported
#                            jax/optax/flax, constraints-oldest.txt): the quick-tier tests
#                            that reach every branch of the package the quick tier reaches
#                            (`cover`, tests/cover_cases.txt), compiled as `dev.sh test`
#                            compiles (conftest.py)
#   bash dev.sh test-tpu     install jax[tpu] at the pinned jax (it pins libtpu, the TPU
#                            compiler) into .venv-tpu and run the `tpu` tier: programs compiled
#                            for TPU topologies without a TPU, their memory and collectives
#                            checked (tests/test_tpu_*.py; skipped where libtpu is absent)
# Needs only python3 (>= 3.11) with venv and pip; everything else is installed
# into .venv from constraints.txt, the versions the suite was verified with.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"

# Python's bytecode is written, under .py_cache/ only. Without it (PYTHONDONTWRITEBYTECODE,
# which some machines set, this project's among them) every process of the suite, each
# pytest worker and each example or benchmark run as a subprocess, compiles jax, flax and
# optax from source again: 13 s to import them here against 4 s from bytecode.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$PWD/.py_cache}"

# The installer: uv (pinned; into .uv/ with pip, once), which installs the same pinned
# versions as pip in a fraction of the time (16 s against pip's minutes for .venv-wheel on
# an empty cache here); `GRADACCUM_INSTALLER=pip`, or uv failing to install, keeps pip.
UV_VERSION=0.13.9
uv=""
if [ "${GRADACCUM_INSTALLER:-uv}" = uv ]; then
  if [[ "$(.uv/bin/uv --version 2>/dev/null)" != "uv $UV_VERSION"* ]]; then
    rm -rf .uv
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --target .uv \
      "uv==$UV_VERSION" >/dev/null 2>&1 || echo "dev.sh: uv not installed; pip installs" >&2
  fi
  [ -x .uv/bin/uv ] && uv="$PWD/.uv/bin/uv"
fi

# install VENV ARGS...: installs ARGS (pip's syntax) into the environment VENV.
install() {
  local venv="$1"
  shift
  if [ -n "$uv" ]; then
    VIRTUAL_ENV="$venv" "$uv" pip install --quiet "$@"
  else
    "$venv/bin/python" -m pip install --quiet "$@"
  fi
}

# ensure_venv DIR CONSTRAINTS PIP_ARGS...: (re)creates DIR when the project's
# requirements changed since it was set up, then installs PIP_ARGS into it.
ensure_venv() {
  local venv="$1" constraints="$2"
  shift 2
  local stamp="$venv/.installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$constraints" -nt "$stamp" ]; then
    if [ -n "$uv" ]; then
      # Kept if it exists (as `python -m venv` keeps it): a running test may be using it.
      "$uv" venv --quiet --allow-existing --python "$(command -v "$PYTHON")" "$venv"
    else
      "$PYTHON" -m venv "$venv"
      "$venv/bin/python" -m pip install --quiet --upgrade pip
    fi
    install "$venv" -c "$constraints" "$@"
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
  touch dist/.built
}

# Builds dist/ unless it was built after the last change to what goes into it (CI's wheel
# and oldest-stack steps share one build).
ensure_dist() {
  if [ ! -f dist/.built ] || [ -n "$(find gradaccum_jax pyproject.toml README.md \
    -newer dist/.built -print -quit)" ]; then
    build_dist
  fi
}

task="${1:-test}"
shift || true
case "$task" in
  run) exec "$py" examples/digits_convnet.py "$@" ;;
  setup) ;;
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
      # What can differ on older releases is what the package does there: the quick-tier
      # tests of tests/cover_cases.txt (marker `cover`), which together reach every
      # branch of the package that the quick tier reaches on the pinned stack, and every
      # test marked `requires` (tools/cover_cases.py chose them: 406 of the quick tier's
      # 1440 tests that are not pure Python, a sixth of their time; tests/test_parts.py's 18
      # were added by hand with their module). The rest of the suite
      # runs the same lines again with other values, on the pinned stack (dev.sh test).
      selection="cover"
    else
      old=.venv-wheel constraints=constraints.txt extras=test,reference,examples
      # What tests the wheel as shipped. (Every program that a check reads is compiled with
      # XLA's defaults in every run: conftest.py.)
      selection="wheel"
    fi
    ensure_dist
    wheel="$(echo dist/*.whl)"
    ensure_venv "$old" "$constraints" "$wheel[$extras]"
    install "$old" --no-deps --force-reinstall "$wheel"
    # The tests run from a copy of the repository without the package's source, so that
    # `import gradaccum_jax` finds the installed wheel, as a user's code would.
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    tar -c --exclude=./gradaccum_jax --exclude=./.git --exclude='./.venv*' --exclude=./.uv --exclude=./dist \
      --exclude=./build --exclude=./site --exclude='./.*_cache' . | tar -x -C "$work"
    oldpy="$PWD/$old/bin/python"
    # The repository's compilation cache (see conftest.py): the copy's conftest would
    # otherwise put it in the temporary copy, which is deleted.
    export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR-$PWD/.jax_cache}"
    # The wheel's run compiles every program with XLA's default settings, as a user has
    # them (`dev.sh test` runs programs with faster ones; see conftest.py).
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
    "$oldpy" -m pytest -n auto --dist worksteal -p no:cacheprovider \
      --confcutdir="${oldpy%/bin/python}" -m "$selection" "$@"
    ;;
  test-tpu)
    # An environment of its own: with libtpu installed JAX looks for a TPU at start-up.
    jax_pin="$(grep -E '^jax==' constraints.txt)"
    ensure_venv .venv-tpu constraints.txt "jax[tpu]==${jax_pin#jax==}" -e ".[test]"
    # XLA's defaults for every program: conftest.py's faster XLA:CPU settings (which the
    # TPU compiler ignores, as the tier checks) reach no TPU compile.
    export GRADACCUM_XLA_DEFAULTS=1
    exec .venv-tpu/bin/python -m pytest -m tpu -n 0 -p no:cacheprovider tests/test_tpu_*.py "$@"
    ;;
  *) echo "usage: bash dev.sh {run|test|setup|lint|docs|bench|dist|test-wheel|test-oldest|test-tpu} [args...]" >&2; exit 2 ;;
esac
