#!/usr/bin/env bash
# Create (or reuse) the SEPARATE virtual environment that runs Flower for tools/bench/bench_flower.py.
#
# flwr pins its own grpcio, protobuf (< 7) and cryptography versions, which conflict with fedguard's, so it never
# goes into fedguard's environment (tools/setup.sh). This one lives at FEDGUARD_FLOWER_VENV (default
# ~/.cache/fedguard/venv-flower) and holds flwr==$FLWR_VERSION with what it pulls in (numpy 2.x, grpcio, protobuf 6,
# FastAPI/uvicorn among them). FEDGUARD_FLOWER_SIMULATION=1 adds the simulation extra (flwr[simulation]: Ray 2.55.1)
# that `tools/bench/bench_flower.py --simulation` needs.
#
#     bash tools/flower_env.sh                                  # prints the environment's python on its last line
#     FEDGUARD_FLOWER_SIMULATION=1 bash tools/flower_env.sh     # ... with Flower's simulation engine (Ray)
#
# Base interpreter: FEDGUARD_PYTHON (default python3); flwr 1.42 needs Python >= 3.11.
set -euo pipefail
FLWR_VERSION="1.42.0"
_base_py="${FEDGUARD_PYTHON:-python3}"
FLOWER_VENV="${FEDGUARD_FLOWER_VENV:-$HOME/.cache/fedguard/venv-flower}"
_spec="flwr==$FLWR_VERSION"
_sim="${FEDGUARD_FLOWER_SIMULATION:-0}"
if [ "$_sim" = "1" ]; then
  _spec="flwr[simulation]==$FLWR_VERSION"
fi
if ! "$_base_py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "flower_env: flwr $FLWR_VERSION needs Python >= 3.11; set FEDGUARD_PYTHON to one" >&2
  exit 1
fi
if [ -e "$FLOWER_VENV" ] && [ ! -f "$FLOWER_VENV/pyvenv.cfg" ]; then  # never removes what is not a venv
  echo "flower_env: $FLOWER_VENV exists and is not a virtual environment; choose another FEDGUARD_FLOWER_VENV" >&2
  exit 1
fi
if [ -d "$FLOWER_VENV" ] && ! "$FLOWER_VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
  echo "flower_env: the virtual environment $FLOWER_VENV is broken, rebuilding it" >&2
  rm -rf "$FLOWER_VENV"
fi
if [ ! -d "$FLOWER_VENV" ]; then
  echo "flower_env: creating $FLOWER_VENV" >&2
  mkdir -p "$(dirname "$FLOWER_VENV")"
  "$_base_py" -m venv "$FLOWER_VENV"
  "$FLOWER_VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
fi
_installed="$("$FLOWER_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("flwr"))' 2>/dev/null || true)"
_need=0
if [ "$_installed" != "$FLWR_VERSION" ]; then
  _need=1
elif [ "$_sim" = "1" ] && ! "$FLOWER_VENV/bin/python" -c 'import ray' >/dev/null 2>&1; then
  _need=1
fi
if [ "$_need" = "1" ]; then
  _log="$FLOWER_VENV/flower-install.log"
  echo "flower_env: installing $_spec into $FLOWER_VENV" >&2
  if ! "$FLOWER_VENV/bin/python" -m pip install --disable-pip-version-check "$_spec" >"$_log" 2>&1; then
    tail -n 30 "$_log" >&2
    echo "flower_env: pip install $_spec failed (log above, whole log in $_log); is PyPI reachable?" >&2
    exit 1
  fi
fi
for _exe in flower-superlink flower-supernode flwr; do
  if [ ! -x "$FLOWER_VENV/bin/$_exe" ]; then
    echo "flower_env: $FLOWER_VENV/bin/$_exe missing after installing $_spec" >&2
    exit 1
  fi
done
FLOWER_PY="$FLOWER_VENV/bin/python"
export FLOWER_PY
echo "$FLOWER_PY"
