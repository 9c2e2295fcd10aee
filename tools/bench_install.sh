#!/usr/bin/env bash
# Time from "pip install" on a fresh virtual environment to a green test suite.
#
#   bash tools/bench_install.sh            # prints: install s, test command s, total s
#
# Creates a new venv in a temp directory (FEDGUARD_VENV), installs fedguard with its dev extra there
# (tools/setup.sh: PyTorch from PyPI, or from pip's cache / a local wheel store when the machine has one),
# then runs the README's test command (tools/test.sh: ruff, mypy, pytest) against it. The venv is removed
# afterwards. The download share of the install depends on the machine's pip cache and network.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export FEDGUARD_VENV="$tmp/venv"
t0=$(date +%s.%N)
# shellcheck source=tools/setup.sh
source tools/setup.sh
t1=$(date +%s.%N)
bash tools/test.sh >"$tmp/test.log" 2>&1 || { cat "$tmp/test.log"; echo "bench_install: tests failed" >&2; exit 1; }
t2=$(date +%s.%N)
grep -E "passed|failed" "$tmp/test.log" | tail -n 1
python3 - "$t0" "$t1" "$t2" "$("$PY" -c 'import torch; print(torch.__version__)')" <<'PY'
import sys
t0, t1, t2 = map(float, sys.argv[1:4])
print(f"fresh venv, torch {sys.argv[4]}: install {t1 - t0:.0f} s, test command {t2 - t1:.0f} s, "
      f"pip install start -> tests passed {t2 - t0:.0f} s")
PY
