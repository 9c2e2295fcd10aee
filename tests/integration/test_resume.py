"""Durability over real gRPC on loopback: graceful stop and resume, refused config changes, a finished
federation not re-run, snapshot fallback, and bit-identical models whatever the arrival order."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from fedclient import ClientConfig, FedClient
from fedcore.config import ConfigError, ServerConfig
from fedcore.serialization import load_state
from fedcore.simulation import SimulationConfig
from fedlaunch.supervise import free_server_port
from fedserver import ServerThread
from fedserver.cli import EXIT_STOPPED, exit_code
from fedserver.store import StoreError
from tests.integration.helpers import run_federation, server_config

N = 3


def _port() -> int:
    return free_server_port()  # P + 1 free too: the server's "auto" framed port


def _cfg(tmp_path: Path, port: int = 0, num_rounds: int = 4, **extra: dict[str, object]) -> ServerConfig:
    sections: dict[str, dict[str, object]] = {
        "server": {"address": f"127.0.0.1:{port}"},
        "rounds": {"num_rounds": num_rounds, "clients_per_round": N, "min_available": N},
        "training": {"local_epochs": 1, "learning_rate": 0.05},
    }
    for k, v in extra.items():
        sections[k] = {**sections.get(k, {}), **v}
    return server_config(tmp_path, **sections)


def _clients(address: str, delays: list[float] | None = None) -> list[FedClient]:
    return [FedClient(ClientConfig(insecure=True,
                                   server=address, client_id=f"client-{i}", data_index=i, long_poll_s=1.0,
                                   backoff_initial_s=0.05, backoff_max_s=0.3, give_up_after_s=60,
                                   simulation=SimulationConfig(straggler_delay_s=(delays or [0.0] * N)[i]))).start()
            for i in range(N)]


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_state(run_dir / "final_model.fgt")[0]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rounds_file(run_dir: Path) -> list[int]:
    return [json.loads(x)["round"] for x in (run_dir / "rounds.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    status, _ = run_federation(_cfg(tmp), N)
    assert status is not None and status.outcome == "completed"
    return _final(tmp / "run")


def test_arrival_order_and_event_loop_do_not_change_the_model(tmp_path: Path,
                                                              uninterrupted: dict[str, torch.Tensor]) -> None:
    # Client 0 answers last here (first in the uninterrupted run's natural order), and the server runs on the
    # standard asyncio loop (the uninterrupted run: "auto", uvloop where installed): same models bit for bit.
    cfg = _cfg(tmp_path, server={"event_loop": "asyncio"})
    srv = ServerThread(cfg, linger_s=1.0).start()
    clients = _clients(srv.address, delays=[0.3, 0.15, 0.0])
    status = srv.wait(120)
    for c in clients:
        c.join(30)
    assert status is not None and status.outcome == "completed"
    assert _same(_final(tmp_path / "run"), uninterrupted)


def test_graceful_stop_then_resume_equals_the_uninterrupted_run(tmp_path: Path,
                                                                 uninterrupted: dict[str, torch.Tensor]) -> None:
    port = _port()
    cfg = _cfg(tmp_path, port)
    run_dir = tmp_path / "run"
    srv = ServerThread(cfg, linger_s=0.5).start()
    clients = _clients(srv.address)
    deadline = time.monotonic() + 60
    while len(srv.coordinator.history) < 2 and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.01)
    srv.stop()
    stopped = srv.result
    assert stopped is not None and stopped.stopping and not stopped.finished
    assert exit_code(stopped) == EXIT_STOPPED
    done = len(stopped.history)
    assert 2 <= done < 4 and _rounds_file(run_dir) == list(range(1, done + 1))

    # The identical configuration resumes: the clients re-join unaided and finish the federation.
    srv2 = ServerThread(cfg, linger_s=1.0).start()
    status = srv2.wait(120)
    for c in clients:
        c.join(30)
    assert status is not None and status.outcome == "completed" and status.resumed_from == done
    assert [r.round for r in status.history] == [1, 2, 3, 4]
    assert _rounds_file(run_dir) == [1, 2, 3, 4]  # appended, nothing lost, nothing twice
    assert all(c.summary.finished and c.summary.rejoins >= 1 for c in clients)
    assert _same(_final(run_dir), uninterrupted)

    # A finished federation is not re-run.
    again = ServerThread(cfg, linger_s=0.1).start()
    st = again.wait(30)
    assert st is not None and st.finished and st.outcome == "completed" and st.resumed_from == 4
    assert _rounds_file(run_dir) == [1, 2, 3, 4]

    # A change that would break the federation is refused, naming the field.
    with pytest.raises(ConfigError, match=r"rounds\.seed"):
        ServerThread(_cfg(tmp_path, port, rounds={"seed": 1}), linger_s=0.1).start()


def test_a_corrupt_snapshot_stops_the_server_and_with_fall_back_the_round_is_re_run(
        tmp_path: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    port = _port()
    cfg = _cfg(tmp_path, port)
    run_dir = tmp_path / "run"
    status, _ = run_federation(cfg, N)
    assert status is not None and status.outcome == "completed"
    newest = max((run_dir / "state" / "models").glob("r000004-*.fgt"))
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the newest model
    newest.write_bytes(bytes(data))
    (run_dir / "final_model.fgt").unlink()
    before = {str(f.relative_to(run_dir)): f.read_bytes() for f in sorted(run_dir.rglob("*")) if f.is_file()}
    with pytest.raises(StoreError, match=r"the newest snapshot does not verify .* fails its sha256 checksum"):
        ServerThread(cfg, linger_s=1.0).start()
    after = {str(f.relative_to(run_dir)): f.read_bytes() for f in sorted(run_dir.rglob("*")) if f.is_file()}
    assert {k: v for k, v in after.items() if k != "server.lock"} == \
        {k: v for k, v in before.items() if k != "server.lock"}  # nothing changed but the (released) lock
    cfg = _cfg(tmp_path, port, persistence={"fall_back": True})
    srv = ServerThread(cfg, linger_s=1.0).start()
    clients = _clients(srv.address)
    st = srv.wait(120)
    for c in clients:
        c.join(30)
    assert st is not None and st.outcome == "completed" and st.resumed_from == 3
    assert _same(_final(run_dir), uninterrupted)
    # Round 4's row was written before the corruption; the re-run appends it again, never truncating.
    assert _rounds_file(run_dir) == [1, 2, 3, 4, 4]


def test_a_state_db_that_is_not_a_store_is_refused_and_left_alone(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from fedserver.cli import main

    run_dir = tmp_path / "run"
    (run_dir / "state").mkdir(parents=True)
    junk = b"this is not a SQLite database" * 100
    (run_dir / "state" / "state.db").write_bytes(junk)
    rc = main(["--run-dir", str(run_dir), "--address", "127.0.0.1:0", "--rounds", "1", "--model", "mlp",
               "--dataset", "synthetic", "--insecure"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "state store" in err and "state.db" in err
    assert (run_dir / "state" / "state.db").read_bytes() == junk  # nothing lost
