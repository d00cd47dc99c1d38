#!/usr/bin/env bash
# Sets up a virtual environment (once) and runs a project task.
#   bash dev.sh run    the main job: the example training run
#   bash dev.sh test   the test suite
#   bash dev.sh lint   ruff lint and format check
#   bash dev.sh docs   build the documentation site (mkdocs, --strict) into site/
#   bash dev.sh bench  run every benchmark; report under benchmarks/results/
# Needs only python3 (>= 3.11) with venv and pip; everything else is installed
# into .venv from constraints.txt, the versions the suite was verified with.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
stamp="$VENV/.installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -c constraints.txt -e ".[test,examples,docs]"
  touch "$stamp"
fi
py="$VENV/bin/python"
task="${1:-test}"
shift || true
case "$task" in
  run) exec "$py" examples/digits_convnet.py "$@" ;;
  test) exec "$py" -m pytest "$@" ;;
  lint) "$py" -m ruff check . && exec "$py" -m ruff format --check . ;;
  docs) NO_MKDOCS_2_WARNING=1 exec "$VENV/bin/mkdocs" build --strict --quiet "$@" ;;
  bench) "$py" benchmarks/run.py "$@" && exec "$py" tools/figures.py ;;
  *) echo "usage: bash dev.sh {run|test|lint|docs|bench} [args...]" >&2; exit 2 ;;
esac
