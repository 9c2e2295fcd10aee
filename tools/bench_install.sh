#!/usr/bin/env bash
# Time from "pip install" on a fresh virtual environment to a green test suite, or (--wheel) check that the
# wheel built from this checkout installs in a clean venv, with its dependencies from the package index, and
# that every console script runs there.
#
#   bash tools/bench_install.sh            # prints: install s, test command s, total s
#   bash tools/bench_install.sh --wheel    # prints: wheel build s, install s, then each CLI's --version
#
# Default mode: creates a new venv in a temp directory (FEDGUARD_VENV), installs fedguard with its dev extra there
# (tools/setup.sh: PyTorch from PyPI, or from pip's cache / a local wheel store when the machine has one), then
# runs the README's test command (tools/test.sh: ruff, mypy, pytest) against it. The venv is removed afterwards.
# The download share of the install depends on the machine's pip cache and network.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if [ "${1:-}" = "--wheel" ]; then
  base_py="${FEDGUARD_PYTHON:-python3}"
  t0=$(date +%s.%N)
  "$base_py" -m venv "$tmp/build-venv"
  "$tmp/build-venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip build
  "$tmp/build-venv/bin/python" -m build --wheel --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 \
    || { cat "$tmp/build.log"; echo "bench_install: wheel build failed" >&2; exit 1; }
  whl="$(ls "$tmp"/dist/fedguard-*.whl)"
  t1=$(date +%s.%N)
  "$base_py" -m venv "$tmp/venv"
  # the [plot] extra too, so that every console script (fedguard-plot included) can run
  "$tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$whl[plot]" >"$tmp/install.log" 2>&1 \
    || { cat "$tmp/install.log"; echo "bench_install: installing $(basename "$whl") failed" >&2; exit 1; }
  t2=$(date +%s.%N)
  (cd "$tmp" && for cli in $("$tmp/venv/bin/python" -c '
import importlib.metadata as m
print(" ".join(sorted(e.name for e in m.distribution("fedguard").entry_points if e.group == "console_scripts")))'); do
    "$tmp/venv/bin/$cli" --version || { echo "bench_install: $cli --version failed" >&2; exit 1; }
    "$tmp/venv/bin/$cli" --help >/dev/null || { echo "bench_install: $cli --help failed" >&2; exit 1; }
  done)
  python3 - "$t0" "$t1" "$t2" "$(basename "$whl")" <<'PY'
import sys
t0, t1, t2 = map(float, sys.argv[1:4])
print(f"{sys.argv[4]}: build {t1 - t0:.0f} s, install with dependencies into a clean venv {t2 - t1:.0f} s; "
      "every console script answered --version and --help")
PY
  exit 0
fi

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
