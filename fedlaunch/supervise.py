"""Process supervision: start the server and the client hosts (each in a session of its own), notice a failed
client, stop everything gracefully on the first Ctrl-C and at once on the second, and reap the hosts at the end."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from fedcore.config import toml_literal
from fedcore.report import RoundReport
from fedlaunch.credentials import OPERATOR_TOKEN, client_tls_flags
from fedlaunch.hosts import CLIENT_STATE_DIR, host_spec, worker_command
from fedlaunch.logs import file_size, last_error, logged_since
from fedlaunch.plan import client_id, server_command


def free_server_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port P on ``host`` that was free a moment ago with P + 1 free too: a server on P takes P + 1 for its framed
    port (``server.framed_address = "auto"``), and a P + 1 held by someone else would refuse it (exit 2)."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port >= 65535:
                continue
            with socket.socket() as t:
                try:
                    t.bind((host, port + 1))
                except OSError:
                    continue
            return port
    raise OSError(f"no free pair of ports (P, P + 1) on {host} in {tries} tries")


class Host(Protocol):
    """A client host: a worker process here (:class:`subprocess.Popen`) or a Ray actor (:mod:`fedlaunch.ray_hosts`).
    ``wait`` raises :class:`subprocess.TimeoutExpired` when the host is still running after ``timeout``; ``poll``
    is its exit status, None while it runs."""

    def wait(self, timeout: float | None = None) -> int: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Launch:
    server: subprocess.Popen[bytes]
    clients: list[Host]
    address: str
    logs: list[IO[bytes]]
    # The log file of each client host (None for a Ray actor: it logs to Ray's session directory).
    client_logs: list[Path | None] = field(default_factory=list)
    server_log: Path | None = None


class Interrupts:
    """SIGINT/SIGTERM while the launcher runs: the first asks for a graceful stop, the second for a kill."""

    def __init__(self) -> None:
        self.count = 0
        self.first_at: float | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1  # nothing printed here: a signal handler that writes can interrupt another write
        if self.first_at is None:
            self.first_at = time.monotonic()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)


@dataclass
class Outcome:
    """How a launch ended."""

    server_rc: int | None
    # "finished", "failed" (a process exited with an error), "stopped" (first Ctrl-C), "killed" (second Ctrl-C)
    how: str
    failed: str = ""
    history: list[RoundReport] = field(default_factory=list)


def start(args: argparse.Namespace, run_dir: Path) -> Launch:
    port = args.port or free_server_port()
    # With Ray, hosts on other machines reach the server at --server-host (default: this node's IP).
    address = f"{args.server_host}:{port}"
    listen = f"0.0.0.0:{port}" if args.ray else address
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.torch_threads), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    py = sys.executable
    server_config = None
    if args.server_part:
        server_config = run_dir / "server_config.json"
        server_config.write_text(json.dumps(args.server_part, indent=2))
    server_cmd = server_command(args, run_dir, listen, args.tls_dir, server_config)
    mode = "ab" if args.resume else "wb"
    logs: list[IO[bytes]] = []
    slog = open(run_dir / "server.log", mode)  # noqa: SIM115 (closed in finish())
    logs.append(slog)
    # Every child in a session of its own: a terminal's Ctrl-C reaches the launcher only, which stops them in order.
    server = subprocess.Popen(server_cmd, stdout=slog, stderr=subprocess.STDOUT,
                              env={**env, "OMP_NUM_THREADS": "1", "FEDGUARD_OPERATOR_TOKEN": OPERATOR_TOKEN},
                              start_new_session=True)
    clients: list[Host] = []
    client_logs: list[Path | None] = []
    procs = args.procs if args.virtual else args.clients
    per_proc = math.ceil(args.clients / max(procs, 1))
    if args.ray:
        from fedlaunch.ray_hosts import start_ray_hosts

        specs = [host_spec(args, address, first, min(per_proc, args.clients - first), ship_tls=True)
                 for first in range(0, args.clients, per_proc)]
        clients.extend(start_ray_hosts(args, specs))
        return Launch(server, clients, address, logs, [None] * len(clients), run_dir / "server.log")
    for p in range(procs):
        first = p * per_proc
        count = min(per_proc, args.clients - first)
        if count <= 0:
            break
        log_path = run_dir / f"clients-{p}.log"
        clog = open(log_path, mode)  # noqa: SIM115
        logs.append(clog)
        if args.virtual:
            cmd = worker_command(host_spec(args, address, first, count, state_root=str(run_dir / CLIENT_STATE_DIR)),
                                 run_dir / "hosts" / f"host-{p}.json")
        else:
            cmd = [py, "-m", "fedclient", "--server", address, "--client-id", client_id(first),
                   "--data-index", str(first), "--trainer", args.trainer, "--torch-threads", str(args.torch_threads),
                   "--log-json", "--log-level", "warning",
                   "--private-epochs", str(args.private_epochs), "--device", args.device,
                   "--state-dir", str(run_dir / CLIENT_STATE_DIR / client_id(first)),
                   *client_tls_flags(args.tls_dir, client_id(first))]
            if args.data_options:
                cmd += ["--data-options", json.dumps(args.data_options)]
            if first in args.attacker_ids:
                cmd += [item for k, v in args.attack.items() for item in ("--set", f"attack.{k}={toml_literal(v)}")]
            if first in args.holdout_ids:
                cmd.append("--opt-out")
            sim = args.simulation.get(client_id(first), {})
            cmd += [item for k, v in sim.items() for item in ("--set", f"simulation.{k}={toml_literal(v)}")]
        clients.append(subprocess.Popen(cmd, stdout=clog, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        client_logs.append(log_path)
    return Launch(server, clients, address, logs, client_logs, run_dir / "server.log")


def failed_client(launch: Launch) -> str | None:
    """The first client host that exited with an error: its number, exit status and last error."""
    for i, c in enumerate(launch.clients):
        code = c.poll()
        if code not in (None, 0):
            log = launch.client_logs[i] if i < len(launch.client_logs) else None
            detail = last_error(log) if log is not None else ""
            where = f" ({log})" if log is not None else ""
            return f"client host {i} exited with status {code}{where}" + (
                "\n  " + detail.replace("\n", "\n  ") if detail else "")
    return None


def _signal_all(launch: Launch, sig: int) -> None:
    procs: list[Any] = [launch.server, *launch.clients]
    for p in procs:
        if not isinstance(p, subprocess.Popen):
            if sig == signal.SIGKILL:
                p.kill()
            continue
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)


def stop_now(launch: Launch) -> None:
    """Stop the federation after a failure: the server gracefully (it saves the state), clients at once."""
    with contextlib.suppress(ProcessLookupError):
        launch.server.send_signal(signal.SIGTERM)
    for c in launch.clients:
        c.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        launch.server.wait(5.0)
    if launch.server.poll() is None:
        _signal_all(launch, signal.SIGKILL)


def stop_gracefully(launch: Launch, interrupts: Interrupts, graceful_s: float,
                    history: list[RoundReport], server_patience_s: float = 10.0) -> Outcome:
    """First Ctrl-C: SIGTERM to every child (the server saves the federation and tells polling clients to come
    back later; clients leave). The server is done when it has exited or logged ``server.stopped`` (its state is
    saved; what is left is the interpreter's teardown); clients get at most 1 s more, everything at most
    ``graceful_s`` from the interrupt, the server itself at most ``server_patience_s`` to save. What still runs
    then is killed. A second Ctrl-C kills at once."""
    offset = file_size(launch.server_log)
    _signal_all(launch, signal.SIGTERM)
    start = interrupts.first_at or time.monotonic()
    server_done: float | None = None
    while interrupts.count < 2:
        now = time.monotonic()
        if server_done is None and (launch.server.poll() is not None
                                    or logged_since(launch.server_log, offset, '"server.stopped"')):
            server_done = now
        clients_done = all(c.poll() is not None for c in launch.clients)
        if server_done is not None and ((clients_done and launch.server.poll() is not None)
                                        or now > min(server_done + 1.0, start + graceful_s)):
            break
        if server_done is None and now > start + server_patience_s:
            break
        time.sleep(0.02)
    how = "killed" if interrupts.count >= 2 else "stopped" if server_done is not None else "stopped-unsaved"
    _signal_all(launch, signal.SIGKILL)  # whatever is still running
    launch.server.wait()
    for c in launch.clients:  # reaped: gone when the launcher returns
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.wait(5.0)
    return Outcome(launch.server.returncode, how, "", history)


def finish(launch: Launch, timeout: float = 30.0, interrupts: Interrupts | None = None) -> list[int | None]:
    """Wait for the client hosts (at most ``timeout`` s in all, or until an interrupt; those still running are
    terminated) and close the logs."""
    deadline = time.monotonic() + timeout
    while (time.monotonic() < deadline and any(c.poll() is None for c in launch.clients)
           and not (interrupts and interrupts.count)):
        time.sleep(0.05)
    codes: list[int | None] = []
    for c in launch.clients:
        code = c.poll()
        if code is None:
            c.terminate()
        codes.append(code)
    for f in launch.logs:
        f.close()
    return codes
