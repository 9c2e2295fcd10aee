"""Real processes: the ``fedserver`` and ``fedclient`` console scripts talking over loopback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fedcore.serialization import load_state
from fedlaunch.supervise import free_server_port

pytestmark = pytest.mark.system


def _exe(name: str) -> list[str]:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"console script {name!r} is not installed (pip install -e .)")
    return [found]


def _free_port() -> int:
    return free_server_port()  # its framed port, P + 1, free too


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _finish_ok(server: subprocess.Popen[str], clients: list[subprocess.Popen[str]]) -> tuple[
    str, list[str], list[dict[str, Any]]
]:
    """Wait for a server and its clients to exit 0; their outputs and the server's JSON log events."""
    try:
        server_out, _ = server.communicate(timeout=120)
        client_outs = [c.communicate(timeout=60)[0] for c in clients]
    finally:
        for p in (server, *clients):
            if p.poll() is None:
                p.kill()
    assert server.returncode == 0, server_out
    assert all(c.returncode == 0 for c in clients), client_outs
    return server_out, client_outs, [json.loads(line) for line in server_out.splitlines() if line.startswith("{")]


def test_server_and_two_client_processes_complete(tmp_path: Path) -> None:
    port = _free_port()
    run_dir = tmp_path / "run"
    server = subprocess.Popen(
        [*_exe("fedserver"), "--address", f"127.0.0.1:{port}", "--rounds", "3", "-k", "2", "--run-dir",
         str(run_dir), "--log-json", "--linger", "1", "--insecure"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    clients = [subprocess.Popen(
        [*_exe("fedclient"), "--server", f"127.0.0.1:{port}", "--client-id", f"proc-{i}", "--data-index", str(i),
         "--torch-threads", "1", "--log-json", "--insecure"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()) for i in range(2)]
    _, client_outs, events = _finish_ok(server, clients)
    names = [e["event"] for e in events]
    assert names.count("round.completed") == 3 and "federation.finished" in names
    assert all(e["accepted"] == 2 for e in events if e["event"] == "round.completed")
    for out in client_outs:
        assert any(json.loads(line)["event"] == "client.finished" for line in out.splitlines()
                   if line.startswith("{"))
    state, extra = load_state(run_dir / "final_model.fgt")
    assert extra["rounds"] == 3 and state


def test_server_refuses_bad_config_naming_the_field(tmp_path: Path) -> None:
    r = subprocess.run([*_exe("fedserver"), "-k", "0", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 2
    assert "rounds.clients_per_round: must be >= 1, got 0" in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[rounds]\nclients_per_rnd = 3\n")
    r = subprocess.run([*_exe("fedserver"), "--config", str(bad)], capture_output=True, text=True, timeout=60,
                       env=_env())
    assert r.returncode == 2 and "rounds.clients_per_rnd: unknown field" in r.stderr
    r = subprocess.run([*_exe("fedserver"), "--model", "nonexistent_model", "--insecure"], capture_output=True,
                       text=True, timeout=60, env=_env())
    assert r.returncode == 2 and "unknown model 'nonexistent_model'" in r.stderr
    r = subprocess.run([*_exe("fedserver")], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 2 and "security.tls_cert: TLS needs a certificate" in r.stderr  # no silent plaintext
    r = subprocess.run([*_exe("fedserver"), "--set", "evaluation.device='gpu'"], capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 2 and "evaluation.device: one of 'cpu', 'cuda'" in r.stderr
    if not torch.cuda.is_available():  # asking for a GPU this machine lacks is a configuration error too
        r = subprocess.run([*_exe("fedserver"), "--set", "evaluation.central=true", "--set",
                            "evaluation.device='cuda'", "--insecure"], capture_output=True, text=True, timeout=60,
                           env=_env())
        assert r.returncode == 2 and "evaluation.device: device 'cuda': this torch build" in r.stderr


def test_client_process_exits_2_on_model_mismatch(tmp_path: Path) -> None:
    port = _free_port()
    server = subprocess.Popen([*_exe("fedserver"), "--address", f"127.0.0.1:{port}", "--rounds", "1", "-k", "1",
                               "--run-dir", str(tmp_path / "run"), "--round-timeout", "5", "--insecure"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    try:
        r = subprocess.run([*_exe("fedclient"), "--server", f"127.0.0.1:{port}", "--model", "logreg", "--insecure"],
                           capture_output=True, text=True, timeout=60, env=_env())
        assert r.returncode == 2 and "model mismatch" in r.stderr
    finally:
        server.kill()
        server.wait()


def test_launcher_virtual_mode_prints_one_row_per_round(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "fedlaunch", "--clients", "6", "-k", "3", "--rounds", "3",
                        "--virtual", "--procs", "2", "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=180, env=_env(), cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["round", "selected", "accepted"])
    columns = lines[header].split()
    rows = [dict(zip(columns, line.split(), strict=True)) for line in lines[header + 1 : header + 4]]
    assert [row["round"] for row in rows] == ["1", "2", "3"]
    # Without private models no client reports beta_hat_i: the detector watches and counts nothing.
    assert all(row["selected"] == "3" and row["accepted"] == "3" and row["rejected"] == "0"
               and row["nfl"] == "watching:0" for row in rows)
    assert any(line.startswith("last 3 rounds: test_acc") for line in lines)
    assert "client hosts ok 2/2" in r.stdout
    assert (tmp_path / "run" / "final_model.fgt").exists()
    # Round 1 waited for the whole fleet: the launcher asks for min_available = N unless told otherwise.
    assert json.loads((tmp_path / "run" / "config.json").read_text())["rounds"]["min_available"] == 6
    # The launcher ran mutual TLS with a throw-away CA (deleted afterwards); plaintext gives the same model, bit
    # for bit.
    assert "(mutual TLS)" in r.stdout
    plain = subprocess.run([sys.executable, "-m", "fedlaunch", "--clients", "6", "-k", "3", "--rounds", "3",
                            "--virtual", "--procs", "2", "--insecure", "--run-dir", str(tmp_path / "plain")],
                           capture_output=True, text=True, timeout=180, env=_env(), cwd=root)
    assert plain.returncode == 0 and "(plaintext)" in plain.stdout, plain.stdout + plain.stderr
    assert (tmp_path / "plain" / "final_model.fgt").read_bytes() == (tmp_path / "run" / "final_model.fgt").read_bytes()


def test_virtual_clients_keep_their_state_under_the_run_dir(tmp_path: Path) -> None:
    """A virtual host's clients record Pᵢ in <run dir>/client_state/<client id> (what a resumed launch reads; the
    resume itself: tests/system/test_first_hour.py)."""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "fedlaunch", "--clients", "2", "-k", "2", "--rounds", "1", "--virtual",
                        "--procs", "1", "--private-epochs", "1", "--insecure", "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=180, env=_env(), cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    docs = [json.loads((tmp_path / "run" / "client_state" / cid / "client_state.json").read_text())
            for cid in ("client-00000", "client-00001")]
    assert [d["private_model"]["epochs"] for d in docs] == [1, 1]
    # Two clients, two shards: two keys.
    assert len({d["private_model"]["trained_as"] for d in docs}) == 2


def test_certificates_from_the_cli_then_mutual_tls_and_signed_requests_between_processes(tmp_path: Path) -> None:
    """fedguard-certs makes a CA, a server certificate, client certificates and enrolled signing keys; fedserver
    requires both mutual TLS and signatures; two fedclient processes train; the secret stays out of the run dir."""
    certs, pki = _exe("fedguard-certs"), tmp_path / "pki"
    ids = ["proc-0", "proc-1"]
    for args in (["ca", "--out", str(pki)], ["server", "--ca", str(pki), "--out", str(pki), "--host", "127.0.0.1"],
                 ["client", "--ca", str(pki), "--out", str(pki / "clients"), *[x for i in ids for x in
                                                                             ("--client-id", i)]],
                 ["keygen", "--out", str(pki / "keys"), "--enroll", str(pki / "enrolled.json"),
                  *[x for i in ids for x in ("--client-id", i)]]):
        r = subprocess.run([*certs, *args], capture_output=True, text=True, timeout=60, env=_env())
        assert r.returncode == 0 and "PRIVATE KEY" not in r.stdout, r.stdout + r.stderr
    secret = "correct-horse-battery"
    (tmp_path / "token").write_text(secret)
    port, run_dir = _free_port(), tmp_path / "run"
    server = subprocess.Popen(
        [*_exe("fedserver"), "--address", f"127.0.0.1:{port}", "--rounds", "2", "-k", "2", "--run-dir",
         str(run_dir), "--log-json", "--linger", "1", "--tls-cert", str(pki / "server.pem"), "--tls-key",
         str(pki / "server.key"), "--client-ca", str(pki / "ca.pem"), "--client-keys", str(pki / "enrolled.json"),
         "--token-file", str(tmp_path / "token")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    clients = [subprocess.Popen(
        [*_exe("fedclient"), "--server", f"127.0.0.1:{port}", "--client-id", cid, "--data-index", str(i),
         "--torch-threads", "1", "--log-json", "--ca-cert", str(pki / "ca.pem"), "--cert",
         str(pki / "clients" / f"{cid}.pem"), "--key", str(pki / "clients" / f"{cid}.key"), "--signing-key",
         str(pki / "keys" / f"{cid}.ed25519")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**_env(), "FEDGUARD_TOKEN": secret})
        for i, cid in enumerate(ids)]
    server_out, client_outs, events = _finish_ok(server, clients)
    listening = next(e for e in events if e["event"] == "server.listening")
    assert listening["transport"] == "mutual-tls" and listening["signed_requests"] is True
    assert [e["accepted"] for e in events if e["event"] == "round.completed"] == [2, 2]
    assert secret not in server_out and not any(secret in out for out in client_outs)
    for path in run_dir.rglob("*"):
        assert not path.is_file() or secret.encode() not in path.read_bytes(), path


def _events_of(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_one_client_killed_mid_round_with_the_default_round_rules_the_run_completes(tmp_path: Path) -> None:
    """Defaults of [rounds] (min_updates = ceil(K/2), lost clients not waited for); only the heartbeat patience is
    shortened so that the test does not wait 30 s for the loss to be noticed."""
    port = _free_port()
    server = subprocess.Popen(
        [*_exe("fedserver"), "--address", f"127.0.0.1:{port}", "--rounds", "4", "-k", "3", "--run-dir",
         str(tmp_path / "run"), "--log-json", "--linger", "1", "--insecure", "--set", "server.heartbeat_patience_s=3",
         "--set", "server.heartbeat_interval_s=0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    clients = [subprocess.Popen(
        [*_exe("fedclient"), "--server", f"127.0.0.1:{port}", "--client-id", f"proc-{i}", "--data-index", str(i),
         "--torch-threads", "1", "--log-json", "--insecure", "--straggler-delay", "1.0" if i == 2 else "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()) for i in range(3)]
    victim = clients[2]
    try:
        # Kill proc-2 while it holds its round-2 task (it straggles 1 s per round, so it is mid-round then).
        run_dir = tmp_path / "run"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            rows = (run_dir / "rounds.jsonl").read_text().splitlines() if (run_dir / "rounds.jsonl").exists() else []
            if len(rows) >= 1:
                break
            time.sleep(0.05)
        time.sleep(0.3)
        victim.kill()
        out, _ = server.communicate(timeout=120)
    finally:
        for p in (server, *clients):
            if p.poll() is None:
                p.kill()
        for c in clients:
            c.communicate(timeout=30)
    assert server.returncode == 0, out
    events = _events_of(out)
    completed = [e for e in events if e["event"] == "round.completed"]
    assert len(completed) == 4 and completed[0]["accepted"] == 3
    assert all(e["accepted"] == 2 for e in completed[1:])  # the killed client is not waited for
    assert any(e["event"] == "client.dropped" and e["client_id"] == "proc-2" for e in events)


def test_a_stall_waits_visibly_then_exits_3_with_an_error(tmp_path: Path) -> None:
    port = _free_port()
    server = subprocess.Popen(
        [*_exe("fedserver"), "--address", f"127.0.0.1:{port}", "--rounds", "2", "-k", "3", "--run-dir",
         str(tmp_path / "run"), "--log-json", "--linger", "1", "--insecure", "--set", "rounds.sampling_timeout_s=12"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    client = subprocess.Popen(
        [*_exe("fedclient"), "--server", f"127.0.0.1:{port}", "--client-id", "lonely", "--torch-threads", "1",
         "--log-json", "--insecure"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        out, _ = server.communicate(timeout=90)
    finally:
        for p in (server, client):
            if p.poll() is None:
                p.kill()
        client.communicate(timeout=30)
    assert server.returncode == 3, out
    events = _events_of(out)
    waiting = [e for e in events if e["event"] == "round.waiting"]
    assert waiting and waiting[0]["status"] == "waiting: 1 of 3 ready" and waiting[0]["level"] == "info"
    stalled = next(e for e in events if e["event"] == "federation.stalled")
    assert stalled["level"] == "error" and stalled["exit_code"] == 3
    assert "rounds.sampling_timeout_s = 12 s" in stalled["reason"]


def test_a_server_stopped_mid_round_for_longer_than_its_deadline_loses_no_round_and_no_client(
        tmp_path: Path) -> None:
    """The server process is stopped (SIGSTOP) 0.3 s into round 2 for 12 s, more than twice its round deadline and
    its heartbeat patience (5 s), while both clients straggle 1.5 s and upload into its sockets. Continued, it
    counts the stall against no round and no client: round 2 completes at its first attempt with both updates,
    nobody is dropped, and the stall is logged with its length."""
    port = _free_port()
    run_dir = tmp_path / "run"
    server = subprocess.Popen(
        [*_exe("fedserver"), "--address", f"127.0.0.1:{port}", "--rounds", "3", "-k", "2", "--run-dir",
         str(run_dir), "--log-json", "--linger", "1", "--insecure", "--set", "rounds.round_timeout_s=5",
         "--set", "server.heartbeat_patience_s=5", "--set", "server.heartbeat_interval_s=0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    clients = [subprocess.Popen(
        [*_exe("fedclient"), "--server", f"127.0.0.1:{port}", "--client-id", f"proc-{i}", "--data-index", str(i),
         "--torch-threads", "1", "--log-json", "--insecure", "--straggler-delay", "1.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()) for i in range(2)]
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (
                (run_dir / "rounds.jsonl").exists() and (run_dir / "rounds.jsonl").read_text().strip()):
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(12.0)
        os.kill(server.pid, signal.SIGCONT)
        _, _, events = _finish_ok(server, clients)
    finally:
        for p in (server, *clients):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    # Round 2 was in flight during the stop (round 1's first attempt may miss its 5-s deadline on a loaded host: the
    # devices' first round includes their set-up, so it is not asserted here).
    assert [(r["round"], r["attempt"], r["accepted"], r["outcome"]) for r in rows[1:]] == [
        (2, 0, 2, "quorum"), (3, 0, 2, "quorum")]
    assert not [e for e in events if e["event"] == "round.abandoned" and e["round"] >= 2]
    assert "client.dropped" not in [e["event"] for e in events]
    stalls = [e for e in events if e["event"] == "server.stalled"]
    assert any(11.0 < e["seconds"] < 60.0 for e in stalls), stalls
