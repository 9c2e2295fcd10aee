"""Client hosts: many virtual clients (threads, one gRPC channel each) in one process, described by a
:class:`HostSpec` that travels by value (a worker process here, ``python -m fedlaunch worker --spec FILE``, or a
Ray actor anywhere, :mod:`fedlaunch.ray_hosts`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcore.config import from_dict
from fedlaunch.credentials import client_tls_options
from fedlaunch.plan import client_id

# The launcher's clients keep their state under <run dir>/client_state/<client id> (:attr:`HostSpec.state_root`).
CLIENT_STATE_DIR = "client_state"


@dataclass
class HostSpec:
    """What one client host runs: ``count`` virtual clients from index ``first`` (a worker process here, or a
    Ray actor anywhere in a Ray cluster: the spec travels by value, so it holds no open files)."""

    server: str
    first: int
    count: int
    trainer: str = ""
    private_epochs: int = 0
    device: str = "cpu"
    backoff_max: float = 10.0
    attackers: list[int] = field(default_factory=list)
    holdouts: list[int] = field(default_factory=list)
    attack: dict[str, Any] = field(default_factory=dict)
    # client id -> its [simulation] fields
    simulation: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Certificates in the launcher's layout: a directory this host can read, or (for hosts on other machines)
    # the PEM files themselves, relative path -> text, written to a private temporary directory on the host.
    tls_dir: str = ""
    tls_files: dict[str, str] = field(default_factory=dict)
    # The name the server's certificate is checked against when ``server`` names it otherwise (an IP the
    # certificate does not list).
    server_name: str = ""
    # torch intra-op threads of the host process (the launcher: max(1, cores // client processes)).
    torch_threads: int = 1
    # The clients' own dataset options (data_dir, ...: what a server never announces).
    data_options: dict[str, Any] = field(default_factory=dict)
    # The longest wait each client asks the server to hold a PullTask (ClientConfig.long_poll_s).
    long_poll_s: float = 60.0
    # Pulls and pushes on one Session stream per client (ClientConfig.session_stream); False: the unary calls.
    session_stream: bool = True
    # Each client keeps its state (Pᵢ of its private model, its NFL counters, its trainer state) in
    # <state_root>/<client id>, so a resumed launch finds it (ClientConfig.state_dir); "": in memory only (Ray hosts
    # on other machines: the launcher's directory is not theirs).
    state_root: str = ""


def host_spec(args: argparse.Namespace, address: str, first: int, count: int, ship_tls: bool = False,
              state_root: str = "") -> HostSpec:
    """The :class:`HostSpec` of the host running clients ``first`` .. ``first + count - 1``; ``ship_tls`` puts the
    certificates it needs into the spec itself (hosts on other machines cannot read the launcher's files);
    ``state_root``: where the clients keep their state (:attr:`HostSpec.state_root`)."""
    ids = [client_id(i) for i in range(first, first + count)]
    tls_files: dict[str, str] = {}
    if ship_tls and args.tls_dir is not None:
        tls_files = {rel: (args.tls_dir / rel).read_text()
                     for rel in ["ca.pem", *(f"clients/{cid}.{ext}" for cid in ids for ext in ("pem", "key"))]}
    return HostSpec(
        server=address, first=first, count=count, trainer=args.trainer, private_epochs=args.private_epochs,
        device=args.device, attackers=[i for i in args.attacker_ids if first <= i < first + count],
        holdouts=[i for i in args.holdout_ids if first <= i < first + count], attack=dict(args.attack),
        simulation={cid: args.simulation.get(cid, {}) for cid in ids},
        tls_dir="" if ship_tls or args.tls_dir is None else str(args.tls_dir), tls_files=tls_files,
        torch_threads=args.torch_threads, data_options=dict(args.data_options), state_root=state_root)


def host_clients(spec: HostSpec, stop: threading.Event | None = None) -> int:
    """Host the spec's virtual clients (threads, one gRPC channel each) in this process until the federation
    ends (or ``stop`` is set: every client leaves); 0 when every one of them finished or vanished on purpose
    (simulated dropout or availability)."""
    import torch

    from fedclient import ClientConfig, FedClient
    from fedclient.transport import ChannelPool
    from fedcore.attacks import AttackConfig
    from fedcore.log import configure_logging
    from fedcore.simulation import SimulationConfig
    from fedcore.startup_gc import freeze_startup_objects

    torch.set_num_threads(max(1, spec.torch_threads))
    configure_logging(json=True, level="warning")
    attack = from_dict(AttackConfig, spec.attack, "attack")
    with contextlib.ExitStack() as stack:
        tls_dir = Path(spec.tls_dir) if spec.tls_dir else None
        if spec.tls_files:
            tls_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedguard-host-tls-")))
            for rel, text in spec.tls_files.items():
                if Path(rel).is_absolute() or ".." in Path(rel).parts:
                    raise ValueError(f"HostSpec.tls_files: {rel!r} is not a path inside the host's own directory")
                path = tls_dir / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch(mode=0o600)
                path.write_text(text)
        named: dict[str, Any] = {"server_name": spec.server_name} if spec.server_name else {}
        clients = [FedClient(ClientConfig(server=spec.server, client_id=client_id(i), data_index=i,
                                          trainer=spec.trainer,
                                          simulation=from_dict(SimulationConfig, spec.simulation.get(client_id(i), {}),
                                                               "simulation"),
                                          opt_out=i in spec.holdouts,
                                          state_dir=str(Path(spec.state_root) / client_id(i)) if spec.state_root
                                          else "",
                                          private_epochs=spec.private_epochs, device=spec.device,
                                          backoff_max_s=spec.backoff_max, data_options=dict(spec.data_options),
                                          long_poll_s=spec.long_poll_s, session_stream=spec.session_stream,
                                          attack=attack if i in spec.attackers else AttackConfig(),
                                          **client_tls_options(tls_dir, client_id(i)), **named))
                   for i in range(spec.first, spec.first + spec.count)]
        freeze_startup_objects()  # the imports and every client's model and data live as long as the process
        channels = ChannelPool()  # one channel and completion-queue thread per host, not per client
        for c in clients:
            c.connection.channels = channels
            c.start()
        if stop is not None:
            def stop_all() -> None:
                stop.wait()
                for c in clients:
                    threading.Thread(target=c.stop, daemon=True).start()

            threading.Thread(target=stop_all, daemon=True).start()
        failed = 0
        for c in clients:
            try:
                c.join()
            except Exception as e:  # one client's failure must not hide the others'
                print(f"{c.client_id}: {e}", file=sys.stderr)
                failed += 1
    finished = sum(c.summary.finished for c in clients)
    vanished = sum(c.summary.vanished and not c.summary.finished for c in clients)
    print(f"host {spec.first}-{spec.first + spec.count - 1}: {finished}/{len(clients)} finished, "
          f"{vanished} vanished (simulated device), {failed} failed", file=sys.stderr)
    stopped = stop is not None and stop.is_set()
    return 0 if failed == 0 and (stopped or finished + vanished == len(clients)) else 1


def worker_command(spec: HostSpec, path: Path) -> list[str]:
    """Write ``spec`` to ``path`` and return the command line of a worker process that hosts it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(spec)))
    return [sys.executable, "-m", "fedlaunch", "worker", "--spec", str(path)]


def run_worker(spec_path: str) -> int:
    """The ``worker --spec FILE`` subcommand: a client host as a process of this machine; SIGTERM or SIGINT
    makes its clients leave."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    return host_clients(HostSpec(**json.loads(Path(spec_path).read_text())), stop)
