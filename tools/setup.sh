#!/usr/bin/env bash
# Create (or reuse) fedguard's virtual environment and install the project with its dev extra.
# Sourced by tools/demo.sh and tools/test.sh; sets PY to the environment's python.
#
# The environment lives outside the clone (FEDGUARD_VENV, default ~/.cache/fedguard/venv-py3.X) so that a
# fresh clone on the same machine does not download PyTorch (~3 GB with its CUDA libraries) again.
# A broken or half-built environment is detected and rebuilt from scratch.
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_base_py="${FEDGUARD_PYTHON:-python3}"
_pyver="$("$_base_py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
case "$_pyver" in
  3.1[1-9]) ;;
  *) echo "fedguard needs Python >= 3.11, found $_pyver at $(command -v "$_base_py")" >&2; exit 1 ;;
esac
VENV="${FEDGUARD_VENV:-$HOME/.cache/fedguard/venv-py$_pyver}"
_healthy() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import torch, torchvision, grpc, grpc_tools' >/dev/null 2>&1
}
if [ -d "$VENV" ] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
  echo "setup: $VENV is broken, rebuilding it" >&2
  rm -rf "$VENV"
fi
if [ ! -d "$VENV" ]; then
  echo "setup: creating $VENV" >&2
  mkdir -p "$(dirname "$VENV")"
  "$_base_py" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
# Installs torch>=2.14 from PyPI (never the machine's local torch 2.13 CPU wheel, which torchvision's
# PyPI wheels cannot load) plus everything in pyproject.toml; a no-op when all is already there.
_log="$VENV/fedguard-install.log"
if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$_root[dev]" >"$_log" 2>&1; then
  cat "$_log" >&2
  echo "setup: pip install failed (log above, also in $_log)" >&2
  exit 1
fi
if ! _healthy; then
  echo "setup: the environment at $VENV cannot import torch/torchvision/grpc; remove it and retry" >&2
  exit 1
fi
PY="$VENV/bin/python"
export PY
