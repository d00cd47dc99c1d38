#!/usr/bin/env bash
# Sets up a virtual environment (once) and runs a project task.
#   bash dev.sh run    the main job: the example training run
#   bash dev.sh test   the test suite
#   bash dev.sh lint   ruff lint and format check
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
  *) echo "usage: bash dev.sh {run|test|lint} [args...]" >&2; exit 2 ;;
esac
