"""The first hour with fedguard-launch (issue 26), as real processes: each mistake a new user makes is refused with
its field and the allowed values before anything starts, a failed process's last error is shown where the user
looks, Ctrl-C stops gracefully and says how to resume, a second Ctrl-C kills everything, ``--resume --run-dir
RUN`` alone resumes, and clients that vanish on purpose are not failures.

Every test asserts the message and the time to it. The times are budgets on a quiet 2-core machine, scaled by how
long this machine takes right now to start a Python process that imports torch (``_budget``): a loaded machine
stretches every process start alike, a launcher that waits for a server to die does not fit any scaled budget.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
# Seconds to start a Python process importing torch on the quiet development VM; _budget scales by now / this.
REFERENCE_START_S = 1.6
FAST = ["--trainer", "noop", "--insecure"]


@pytest.fixture
def load_factor() -> float:
    """How much slower than the quiet reference this machine starts a torch process now (>= 1), measured for each
    test (a shared machine's load changes from minute to minute)."""
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, env=_env())
    return max(1.0, (time.monotonic() - t) / REFERENCE_START_S)


def _budget(seconds: float, factor: float) -> float:
    return seconds * factor + 0.5  # + the scheduling jitter of a shared machine


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def _launch(*args: str, timeout: float = 120.0) -> tuple[subprocess.CompletedProcess[str], float]:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "fedlaunch", *args], capture_output=True, text=True,
                       timeout=timeout, env=_env())
    return r, time.monotonic() - t


class Running:
    """A launcher in a session of its own (as a terminal's foreground job), its output read line by line."""

    def __init__(self, *args: str) -> None:
        self.t0 = time.monotonic()
        self.p = subprocess.Popen([sys.executable, "-m", "fedlaunch", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for_round(self, round_: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.split()[:1] == [str(round_)] for line in list(self.lines)):
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"round {round_} never printed:\n" + "\n".join(self.lines))

    def ctrl_c(self) -> None:
        os.killpg(self.p.pid, signal.SIGINT)  # a terminal sends it to the whole foreground process group

    def children(self) -> list[int]:
        """Pids whose parent is the launcher (the server and the client hosts)."""
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == self.p.pid:
                out.append(int(stat.parent.name))
        return out

    def wait(self, timeout: float) -> int:
        rc = self.p.wait(timeout)
        self._reader.join(5)
        return rc

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


# ---- every mistake refused before anything starts: exit 2 within 3 s, the field and the allowed values ----

def test_a_typo_in_an_experiment_file_is_refused_naming_the_key(tmp_path: Path, load_factor: float) -> None:
    cfg = tmp_path / "typo.toml"
    cfg.write_text("[launch]\nclients = 3\n\n[rounds]\nroundz = 3\n")
    r, seconds = _launch("--config", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "launch: configuration error: rounds.roundz: unknown field; known: clients_per_round, concurrency, "
        "max_staleness, min_available, min_updates, mode, num_rounds, over_select, replay, round_timeout_s, "
        "sampling_timeout_s, seed, staleness, staleness_a, staleness_b"]
    assert seconds < _budget(3.0, load_factor)
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    cfg.write_text("[launch]\nclientz = 3\n")
    r, _ = _launch("--config", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and "launch.clientz: unknown field; known: attack, attackers, clients" in r.stderr


def test_an_explicit_data_dir_that_does_not_exist_is_an_error_not_another_copy(tmp_path: Path,
                                                                                load_factor: float) -> None:
    missing = tmp_path / "no-such-folder"
    r, seconds = _launch("--clients", "3", "--run-dir", str(tmp_path / "run"), "--server-set", 'data.dataset="mnist"',
                         "--server-set", 'model.name="mnist_mlp"', "--server-set",
                         f'data.options={{data_dir = "{missing}", num_clients = 3}}', *FAST)
    assert r.returncode == 2, r.stderr
    assert f"data.options.data_dir: {missing} does not exist" in r.stderr
    assert "never replaced by another copy" in r.stderr
    assert seconds < _budget(3.0, load_factor)
    assert not (tmp_path / "run").exists()


def test_a_dataset_that_is_not_there_says_how_to_get_it(tmp_path: Path, load_factor: float) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r, seconds = _launch("--clients", "3", "--run-dir", str(tmp_path / "run"), "--server-set", 'data.dataset="mnist"',
                         "--server-set", 'model.name="mnist_mlp"', "--server-set",
                         f'data.options={{data_dir = "{empty}", num_clients = 3}}', *FAST)
    assert r.returncode == 2, r.stderr
    assert "data.options.data_dir: MNIST: data not found" in r.stderr
    assert "To get it: set data.options.download = true" in r.stderr
    assert seconds < _budget(3.0, load_factor)


def test_a_model_that_does_not_fit_the_dataset_is_refused_naming_the_models_that_do(tmp_path: Path,
                                                                                     load_factor: float) -> None:
    # The built-in synthetic task has 60 features and 10 classes; mnist_cnn wants 28x28 images.
    r, seconds = _launch("--clients", "3", "--run-dir", str(tmp_path / "run"), "--server-set",
                         'model.name="mnist_cnn"', *FAST)
    assert r.returncode == 2, r.stderr
    assert "model.name: 'mnist_cnn' does not fit dataset 'synthetic': one sample of shape [60]" in r.stderr
    assert "registered models that fit it: logreg, mlp" in r.stderr
    assert seconds < _budget(3.0, load_factor)
    # Wrong number of classes: the forward pass works, the output does not fit.
    r, _ = _launch("--clients", "3", "--run-dir", str(tmp_path / "run"), "--server-set",
                   "model.kwargs={num_classes = 4}", *FAST)
    assert r.returncode == 2 and "gives output [1, 4], not one score for each of the dataset's 10 classes" in r.stderr


def test_k_above_the_fleet_is_refused(tmp_path: Path, load_factor: float) -> None:
    r, seconds = _launch("--clients", "3", "-k", "10", "--run-dir", str(tmp_path / "run"), *FAST)
    assert r.returncode == 2, r.stderr
    assert "rounds.clients_per_round: -k 10 must be in [1, --clients 3]" in r.stderr
    assert seconds < _budget(3.0, load_factor)
    cfg = tmp_path / "k10.toml"
    cfg.write_text("[launch]\nclients = 3\n\n[rounds]\nclients_per_round = 10\n")
    r, _ = _launch("--config", str(cfg), "--run-dir", str(tmp_path / "run"), *FAST)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "rounds.clients_per_round: K = 10 is more than the 3 clients launched (-k must be in [1, 3])" in r.stderr
    r, _ = _launch("--clients", "3", "-k", "2", "--min-updates", "3", "--run-dir", str(tmp_path / "run"), *FAST)
    assert r.returncode == 2 and "rounds.min_updates: must be in [0, clients_per_round=2], got 3" in r.stderr


def test_fedserver_and_fedclient_on_their_own_refuse_the_same_mistakes(tmp_path: Path, load_factor: float) -> None:
    cfg = tmp_path / "typo.toml"
    cfg.write_text("[rounds]\nroundz = 3\n")
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "fedserver", "--config", str(cfg), "--insecure", "--run-dir",
                        str(tmp_path / "run")], capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 2 and "rounds.roundz: unknown field" in r.stderr
    assert time.monotonic() - t < _budget(3.0, load_factor)
    r = subprocess.run([sys.executable, "-m", "fedserver", "--insecure", "--model", "mnist_cnn", "--run-dir",
                        str(tmp_path / "run")], capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 2 and "model.name: 'mnist_cnn' does not fit dataset 'synthetic'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "fedclient", "--insecure", "--data-options",
                        json.dumps({"data_dir": str(tmp_path / "nope")})], capture_output=True, text=True,
                       env=_env(), timeout=60)
    assert r.returncode == 2
    assert f"data_options.data_dir: {tmp_path / 'nope'} does not exist" in r.stderr


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.toml")))
def test_fedserver_reads_every_experiment_file_and_leaves_the_launch_table(config: str) -> None:
    r = subprocess.run([sys.executable, "-m", "fedserver", "--config", str(ROOT / "configs" / config),
                        "--print-config"], capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    assert "launch" not in printed and printed["security"]["insecure"] is False
    assert "the [launch] table holds fedguard-launch's options" in r.stderr
    assert "no transport given" in r.stderr  # --print-config needs no --insecure or certificates


# ---- failures surface where the user looks ----

def test_a_failing_client_stops_the_federation_with_its_last_error(tmp_path: Path, load_factor: float) -> None:
    # Clients build only built-in models from an announcement: an import path is refused by every client (exit 2).
    run = tmp_path / "run"
    r, seconds = _launch("--clients", "2", "--rounds", "3", "--run-dir", str(run), "--server-set",
                         'model.name="fedcore.models:mlp"', *FAST)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "exited with status 2" in r.stderr
    assert "fedclient: refused the server's announcement: FederationConfig.model_name: 'fedcore.models:mlp' is an " \
           "import path" in r.stderr
    assert "final model" not in r.stdout  # no final model was written
    assert "Traceback" not in r.stdout + r.stderr
    # From the client's exit (its log's last write) to the launcher's exit: within 5 s.
    last_client_write = max(p.stat().st_mtime for p in run.glob("clients-*.log"))
    assert time.time() - last_client_write < _budget(5.0, load_factor), seconds


def test_a_failing_server_is_reported_with_its_error(tmp_path: Path, load_factor: float) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r, seconds = _launch("--clients", "2", "--rounds", "2", "--port", str(port), "--run-dir",
                             str(tmp_path / "run"), *FAST)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "launch: the server exited with status 2:" in r.stderr
    assert f"server.address: port {port} on 127.0.0.1 is in use" in r.stderr
    assert "final model" not in r.stdout
    assert seconds < _budget(10.0, load_factor)  # the launcher's checks, then the server's own start and error


def test_clients_that_vanish_on_purpose_are_not_failures(tmp_path: Path) -> None:
    r, _ = _launch("--clients", "6", "-k", "3", "--min-updates", "1", "--min-available", "3", "--rounds", "4",
                   "--round-timeout", "3", "--dropout", "0.3", "--dropout-return", "-1", "--seed", "1",
                   "--server-set", "server.heartbeat_patience_s=5", "--server-set",
                   "server.heartbeat_interval_s=1", "--run-dir", str(tmp_path / "run"), *FAST)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = r.stdout.strip().splitlines()[-1]
    assert summary.startswith("server exit 0; client hosts ok 6/6, ") and "vanished on purpose" in summary, summary
    vanished = int(summary.split("client hosts ok 6/6, ")[1].split()[0])
    assert vanished >= 1
    assert f"final model {tmp_path / 'run' / 'final_model.fgt'}" in summary
    # The launcher chose the torch threads itself: it says that the model's bits depend on them, and how to pin them.
    notes = [line for line in r.stdout.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "pin --torch-threads" in notes[0], r.stdout


# ---- stop and resume ----

@pytest.fixture
def stopped_run(tmp_path: Path, load_factor: float) -> Iterator[tuple[Path, Running, float]]:
    """A launcher (mutual TLS, the default) stopped by Ctrl-C after round 2 of 40 (each upload 0.2 s late); the
    clients train a one-epoch private model first."""
    run = tmp_path / "run"
    launcher = Running("--clients", "3", "--rounds", "40", "--trainer", "noop", "--straggler-delay", "0.2",
                       "--private-epochs", "1", "--run-dir", str(run))
    launcher.wait_for_round(2, timeout=_budget(30.0, load_factor))
    t = time.monotonic()
    launcher.ctrl_c()
    rc = launcher.wait(timeout=60)
    yield run, launcher, time.monotonic() - t
    assert rc == 130


def test_ctrl_c_stops_gracefully_and_prints_the_resume_command(stopped_run: tuple[Path, Running, float],
                                                               load_factor: float) -> None:
    run, launcher, seconds = stopped_run
    assert seconds < _budget(3.0, load_factor), launcher.text
    assert "launch: stopped gracefully: the server saved the federation after round" in launcher.text
    assert launcher.lines[-1].strip() == f"fedguard-launch --resume --run-dir {run}"
    logs = [run / "server.log", *run.glob("clients-*.log")]
    assert not any("Traceback" in text for text in [launcher.text, *(p.read_text() for p in logs)])
    assert '"server.stopping"' in (run / "server.log").read_text()
    assert "final model" not in launcher.text


def test_resume_with_the_run_dir_alone_finishes_the_federation(stopped_run: tuple[Path, Running, float],
                                                               load_factor: float) -> None:
    run, _, _ = stopped_run
    saved = json.loads((run / "launch.json").read_text())["arguments"]
    assert saved["clients"] == 3 and saved["rounds"] == 40 and saved["trainer"] == "noop"
    assert saved["straggler_delay"] == 0.2
    r, _ = _launch("--resume", "--run-dir", str(run), "--clients", "4")
    assert r.returncode == 2
    assert "launch: configuration error: --clients: was 3 when this federation started, now 4" in r.stderr
    # Each client kept Pᵢ of its private model in its state dir under the run dir. A marked accuracy shows whether
    # the resumed clients reuse it (a client that trained again would record the accuracy it measured).
    states = sorted((run / "client_state").glob("*/client_state.json"))
    assert [p.parent.name for p in states] == ["client-00000", "client-00001", "client-00002"]
    for p in states:
        doc = json.loads(p.read_text())
        assert doc["private_model"]["epochs"] == 1 and len(doc["private_model"]["trained_as"]) == 32
        doc["private_model"]["accuracy"] = 0.1234567
        p.write_text(json.dumps(doc))
    r, _ = _launch("--resume", "--run-dir", str(run), timeout=_budget(120.0, load_factor))
    assert r.returncode == 0, r.stdout + r.stderr
    rounds = [json.loads(line)["round"] for line in (run / "rounds.jsonl").read_text().splitlines()]
    assert sorted(set(rounds)) == list(range(1, 41))
    assert f"final model {run / 'final_model.fgt'}" in r.stdout
    assert [json.loads(p.read_text())["private_model"]["accuracy"] for p in states] == [0.1234567] * 3


def test_a_second_ctrl_c_kills_every_child_at_once(tmp_path: Path, load_factor: float) -> None:
    run = tmp_path / "run"
    launcher = Running("--clients", "3", "--rounds", "400", "--straggler-delay", "0.2", "--run-dir", str(run), *FAST)
    launcher.wait_for_round(2, timeout=_budget(30.0, load_factor))
    children = launcher.children()
    assert len(children) == 4, children  # the server and three clients
    t = time.monotonic()
    launcher.ctrl_c()
    time.sleep(0.1)
    launcher.ctrl_c()
    rc = launcher.wait(timeout=30)
    seconds = time.monotonic() - t
    assert rc == 130, launcher.text
    assert seconds < _budget(1.5, load_factor), launcher.text
    assert "launch: killed every process after round" in launcher.text
    assert launcher.lines[-1].strip() == f"fedguard-launch --resume --run-dir {run}"
    assert not [pid for pid in children if _alive(pid)]
    assert "Traceback" not in launcher.text
