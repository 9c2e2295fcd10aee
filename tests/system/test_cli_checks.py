"""The command lines refuse a bad configuration before listening, in one line, and answer --help without torch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system


def _run(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("module", ["fedserver", "fedclient", "fedlaunch"])
def test_help_answers_without_importing_torch(module: str) -> None:
    r = _run("-X", "importtime", "-m", module, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout
    imported = {line.rpartition("|")[2].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "grpc" not in imported, sorted(imported)


def test_a_port_in_use_is_one_line_naming_the_port_and_nothing_is_written(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _run("-m", "fedserver", "--insecure", "--address", f"127.0.0.1:{port}", "--run-dir",
                 str(tmp_path / "run"))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"fedserver: configuration error: server.address: port {port} on 127.0.0.1 is in use "
                                f"by another process; pick another with --address HOST:PORT (port 0 picks a free one)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--dataset", "nope"], "data.dataset: unknown dataset 'nope'"),
    (["--dataset", "mnist", "--data-options", '{"partition": "bogus"}'], "data.options: unknown partition 'bogus'"),
    (["--dataset", "mnist", "--data-options", '{"num_clients": 5}', "-k", "10"],
     "rounds.clients_per_round: K = 10 is more than the 5 clients"),
])
def test_bad_data_configuration_is_refused_before_listening(tmp_path: Path, args: list[str], message: str) -> None:
    r = _run("-m", "fedserver", "--insecure", "--address", "127.0.0.1:0", "--run-dir", str(tmp_path / "run"), *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert not (tmp_path / "run").exists()
