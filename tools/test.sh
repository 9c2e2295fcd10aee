#!/usr/bin/env bash
# Set up fedguard and run its checks: ruff, mypy, then the whole pytest suite (unit, integration, system).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
export PATH="$(dirname "$PY"):$PATH"
echo "== ruff" && "$PY" -m ruff check .
echo "== mypy" && "$PY" -m mypy
echo "== pytest" && "$PY" -m pytest -q -p no:cacheprovider "$@"
