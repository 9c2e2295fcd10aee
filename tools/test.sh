#!/usr/bin/env bash
# Set up fedguard and run its checks: ruff, mypy, then the whole pytest suite (unit, integration, system).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
export PATH="$(dirname "$PY"):$PATH"
echo "== ruff" && "$PY" -m ruff check .
echo "== mypy" && "$PY" -m mypy
# Two pytest-xdist workers (FEDGUARD_TEST_WORKERS; 0: one process): the system tests run first, one at a time, on one
# worker (tests/conftest.py's scheduler) while the other takes the unit and integration tests.
workers="${FEDGUARD_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then parallel=(-n "$workers"); fi
echo "== pytest" && "$PY" -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@"
