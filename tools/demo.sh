#!/usr/bin/env bash
# Set up fedguard and run a federation on loopback: one server, 40 clients on the built-in synthetic task,
# printing one line per round. Each client first trains a private model, so the table shows beta_hat, beta = V_i - P_i
# and the NFL detector (NR = c = 5 at this scale: NFL is reported, recovery starts)
# (negative beta = negative federated learning). The task: every client's x from the same N(0, Sigma), labels from a
# concept partly shared by all clients (synthetic shared = 0.4), partly its own (feature_shift = false), so no single
# model fits every client (FedAvg stays below the private models) but each can learn from the others (the adapted
# models beat them): README "The demo", docs/results/demo_story.md (python tools/experiments/demo_story.py re-measures it).
# Extra arguments go to the launcher (fedguard-launch --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
exec "$PY" -m fedlaunch --clients 40 -k 40 --rounds 40 --virtual --procs 2 --private-epochs 10 \
  --server-set nfl.nr=5 --server-set nfl.c=5 --server-set data.options.shared=0.4 \
  --server-set data.options.feature_shift=false --run-dir runs/demo "$@"
