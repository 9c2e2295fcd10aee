"""fedguard-status: where a federation stands, from its run directory or from the live server.

    fedguard-status runs/demo                      # from the run directory (rounds.jsonl, config, server.lock)
    fedguard-status 10.0.0.5:8470 --ca-cert ca.pem --operator-token-file op.token   # a live server (GetStatus)
    fedguard-status runs/demo --watch              # redraw every 2 s until the federation finishes (Ctrl-C stops)

A live server answers GetStatus only to its operator: the token comes from ``--operator-token-file`` or
``FEDGUARD_OPERATOR_TOKEN`` (never a command-line value). TLS as the client's: ``--ca-cert`` (the server's CA;
empty: the system's roots), ``--cert``/``--key`` for mutual TLS, ``--server-name``; ``--insecure`` for a plaintext
server. The table is the launcher's per-round table (round, selected/accepted, loss, accuracy, beta_hat, beta, Delta,
NFL state, clusters, DP epsilon, seconds), of the last ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcore.report import RoundReport
from fedlaunch.export import RunFileError, read_rounds

# fedcore.config.OPERATOR_TOKEN_ENV (not imported: fedcore.config imports torch, and --help must be quick; a test
# holds the two equal)
OPERATOR_TOKEN_ENV = "FEDGUARD_OPERATOR_TOKEN"
ADDRESS = re.compile(r"[A-Za-z0-9_.\-\[\]:]+:\d{1,5}")


@dataclass
class View:
    """What the table shows: a title block and the rounds."""

    lines: list[str] = field(default_factory=list)
    rounds: list[RoundReport] = field(default_factory=list)
    finished: bool = False


def run_dir_view(run: Path) -> View:
    """A run directory's state, read from its files only (nothing is locked or written)."""
    rows = [RoundReport.from_dict(r) for r in read_rounds(run)]
    run_dir = run if run.is_dir() else run.parent
    view = View(rounds=rows)
    config = _json(run_dir / "config.json")
    total = config.get("rounds", {}).get("num_rounds", "?") if config else "?"
    fed = config.get("server", {}).get("federation_id", "") if config else ""
    view.lines.append(f"run {run_dir}  federation {fed or '?'}  rounds {len(rows)} of {total}")
    holder = _json(run_dir / "server.lock")
    if holder:
        live = _pid_alive(holder)
        state = {True: "running", False: "not running (stale record)", None: "on another host"}[live]
        view.lines.append(f"server: pid {holder.get('pid', '?')} on {holder.get('host', '?')} at "
                          f"{holder.get('address', '?')} since {holder.get('since', '?')}: {state}")
    else:
        view.lines.append("server: none holds the run directory")
    sidecar = _json(run_dir / "final_model.json")
    if sidecar:
        view.finished = True
        view.lines.append(f"finished: final model after round {sidecar.get('round')} in "
                          f"{run_dir / 'final_model.safetensors'} (fedguard.load_model)")
    if rows:
        last = rows[-1]
        view.lines.append(_nfl_dp_line(last))
    return view


def _nfl_dp_line(r: RoundReport) -> str:
    eps = "not accounted" if r.dp_epsilon != r.dp_epsilon else f"epsilon {r.dp_epsilon:.4g} at delta {r.dp_delta:g}"
    return (f"after round {r.round}: NFL {r.nfl} (count {r.nfl_count}, recovery {'on' if r.recovery else 'off'}), "
            f"DP {eps}")


def live_view(address: str, args: argparse.Namespace, seen: Sequence[RoundReport] = ()) -> View:
    """GetStatus of a live server with the operator credential. ``seen``: the rounds an earlier call returned; only
    the later ones are asked for (``since_round``), so ``--watch`` costs the same each time however long the
    history."""
    import grpc

    from fedguard.v1 import fedguard_pb2_grpc as pb_grpc
    from fedlaunch.follow import StatusFollower

    token = _operator_token(args.operator_token_file)
    if args.insecure:
        channel = grpc.insecure_channel(address)
    else:
        root = _read(args.ca_cert) if args.ca_cert else None
        key, cert = (_read(args.key), _read(args.cert)) if args.cert else (None, None)
        opts = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root, key, cert), options=opts)
    try:
        follower = StatusFollower(pb_grpc.FederationStub(channel),  # type: ignore[no-untyped-call]
                                  token, seen[-1].round if seen else 0)
        s, new = follower.poll(timeout=args.timeout)
    except grpc.RpcError as e:
        code = e.code().name if hasattr(e, "code") else "ERROR"
        detail = e.details() if hasattr(e, "details") else str(e)
        raise RunFileError(f"{address}: GetStatus failed: {code}: {detail}") from None
    finally:
        channel.close()
    view = View(rounds=[*seen, *new], finished=s.finished)
    view.lines.append(f"server {address}  federation {s.federation_id}  round {s.round} of {s.num_rounds}  "
                      f"phase {s.phase}{'  outcome ' + s.outcome if s.outcome else ''}"
                      f"{'  (stopping)' if s.stopping else ''}")
    view.lines.append(f"clients: {s.clients_known} known, {s.clients_alive} alive; this round {s.selected} "
                      f"selected, {s.accepted} accepted, {s.rejected} rejected ({s.rejected_total} in all)")
    view.lines.append(f"NFL: {s.nfl.state} ({s.nfl.detector}, mode {s.nfl.mode}), count {s.nfl.count}, recovery "
                      f"{'on' if s.nfl.recovery else 'off'}; reported at round {s.nfl.reported_round or '-'}, "
                      f"cancelled at {s.nfl.cancelled_round or '-'}")
    if s.distfl.enabled:
        view.lines.append(f"DistFL: {len(s.distfl.clusters)} clusters {dict(s.distfl.clusters)}, "
                          f"{s.distfl.pending} pending")
    if view.rounds:
        view.lines.append(_nfl_dp_line(view.rounds[-1]))
    return view


def render(view: View, last: int) -> str:
    from fedlaunch.progress import format_header, format_row

    out = list(view.lines)
    rows = view.rounds[-last:] if last > 0 else view.rounds
    if rows:
        out += ["", format_header(), *(format_row(r) for r in rows)]
    else:
        out.append("no round completed yet")
    return "\n".join(out) + "\n"


def _json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value else None


def _pid_alive(holder: dict[str, Any]) -> bool | None:
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise RunFileError(f"{path}: cannot be read ({e.strerror or e})") from None


def _operator_token(path: str) -> str:
    raw = _read(path).decode(errors="replace") if path else os.environ.get(OPERATOR_TOKEN_ENV, "")
    token = raw.strip()
    if not token:
        raise RunFileError(f"a live server answers GetStatus only to its operator: give --operator-token-file or "
                           f"set {OPERATOR_TOKEN_ENV}")
    return token


def main(argv: Sequence[str] | None = None) -> int:
    from fedcore.about import VersionAction

    ap = argparse.ArgumentParser(prog="fedguard-status", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action=VersionAction)
    ap.add_argument("target", help="a run directory (or rounds.jsonl file), or a live server's host:port")
    ap.add_argument("--rounds", type=int, default=20, help="show the last N rounds (0: all; default 20)")
    ap.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                    help="redraw every SECONDS (default 2) until the federation finishes; Ctrl-C stops")
    ap.add_argument("--operator-token-file", default="", help="file holding the server's operator token (or set "
                                                              f"{OPERATOR_TOKEN_ENV})")
    ap.add_argument("--insecure", action="store_true", help="plaintext gRPC (a server started with --insecure)")
    ap.add_argument("--ca-cert", default="", help="PEM CA that signed the server's certificate")
    ap.add_argument("--cert", default="", help="PEM client certificate (mutual TLS)")
    ap.add_argument("--key", default="", help="PEM client key (mutual TLS)")
    ap.add_argument("--server-name", default="", help="name to check the server's certificate against")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server (default 10)")
    args = ap.parse_args(argv)
    if bool(args.cert) != bool(args.key):
        ap.error("--cert and --key go together")
    target = Path(args.target)
    live = not target.exists() and ADDRESS.fullmatch(args.target) is not None
    if not live and not target.exists():
        print(f"fedguard-status: {args.target}: neither a run directory nor host:port", file=sys.stderr)
        return 2
    try:
        view = View()
        while True:
            view = live_view(args.target, args, view.rounds) if live else run_dir_view(target)
            text = render(view, args.rounds)
            if args.watch is not None and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            sys.stdout.write(text)
            sys.stdout.flush()
            if args.watch is None or view.finished:
                return 0
            time.sleep(max(0.2, args.watch))
    except RunFileError as e:
        print(f"fedguard-status: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
