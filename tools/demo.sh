#!/usr/bin/env bash
# Set up fedguard and run a federation on loopback: one server, 20 clients on the built-in synthetic task,
# printing one line per round. Each client first trains a private model, so the table shows beta_hat, beta = V_i - P_i
# and the NFL detector (NR = c = 5 at this scale: NFL is reported, recovery starts)
# (negative beta = negative federated learning). Extra arguments go to the launcher (fedguard-launch --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
exec "$PY" -m fedguard.launch --clients 20 -k 10 --rounds 30 --virtual --procs 2 --private-epochs 10 \
  --server-set nfl.nr=5 --server-set nfl.c=5 --run-dir runs/demo "$@"
