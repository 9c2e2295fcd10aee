"""``server.framed_address``: "auto" (server.address's host, its port + 1; a free port when that one is 0), an
explicit host:port, or "" (off); a framed port that cannot be bound refuses the server, naming the field and the ways
out (issue 53, item 7)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedcore.config import ConfigError, ServerConfig, build_config
from fedserver.framed import AUTO, framed_address

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, address: str, framed: str | None) -> ServerConfig:
    overrides: list[tuple[list[str], object]] = [(["server", "address"], address),
                                                 (["server", "run_dir"], str(tmp_path / "run")),
                                                 (["security", "insecure"], True)]
    if framed is not None:
        overrides.append((["server", "framed_address"], framed))
    return build_config(ServerConfig, None, overrides)


def test_the_default_is_auto() -> None:
    assert ServerConfig().server.framed_address == AUTO == "auto"


@pytest.mark.parametrize(("address", "framed", "bound"), [
    ("10.0.0.7:8470", "auto", "10.0.0.7:8471"),
    ("0.0.0.0:9000", "auto", "0.0.0.0:9001"),
    ("[::1]:8470", "auto", "[::1]:8471"),
    ("127.0.0.1:0", "auto", "127.0.0.1:0"),  # a free gRPC port: a free framed port too
    ("10.0.0.7:8470", "", ""),  # off
    ("10.0.0.7:8470", "10.0.0.7:9999", "10.0.0.7:9999"),  # as given
    ("10.0.0.7:8470", "127.0.0.1:0", "127.0.0.1:0"),
])
def test_the_framed_port_is_derived_from_the_grpc_address(tmp_path: Path, address: str, framed: str,
                                                          bound: str) -> None:
    assert framed_address(_config(tmp_path, address, framed)) == bound


def test_auto_with_no_port_after_the_grpc_one_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        framed_address(_config(tmp_path, "10.0.0.7:65535", "auto"))
    assert e.value.field == "server.framed_address" and '--framed-address ""' in str(e.value), str(e.value)


def test_a_bad_value_names_the_field_and_what_it_takes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, "127.0.0.1:8470", "nope")
    assert e.value.field == "server.framed_address" and '"auto"' in str(e.value), str(e.value)


@contextlib.contextmanager
def _adjacent_ports() -> Iterator[tuple[int, socket.socket]]:
    """A free port P whose P + 1 is held (listening) by the socket yielded with it."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port >= 65535:
            continue
        held = socket.socket()
        try:
            held.bind(("127.0.0.1", port + 1))
        except OSError:
            held.close()
            continue
        held.listen()
        with held:
            yield port, held
        return
    pytest.skip("no pair of adjacent free ports on 127.0.0.1")


def test_auto_on_a_taken_port_refuses_the_server_before_the_run_dir(tmp_path: Path) -> None:
    from fedserver.app import serve

    with _adjacent_ports() as (port, _):
        cfg = _config(tmp_path, f"127.0.0.1:{port}", "auto")
        with pytest.raises(ConfigError) as e:
            asyncio.run(serve(cfg))
    message = str(e.value)
    assert e.value.field == "server.framed_address", message
    assert f'"auto" is 127.0.0.1:{port + 1}' in message and "is in use" in message, message
    assert "--framed-address HOST:PORT" in message and '--framed-address ""' in message, message
    assert not (tmp_path / "run").exists()  # refused before anything touched the run dir


def test_the_cli_exits_2_with_one_line_naming_the_field(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with _adjacent_ports() as (port, _):
        r = subprocess.run([sys.executable, "-m", "fedserver", "--address", f"127.0.0.1:{port}", "--run-dir",
                            str(tmp_path / "run"), "--insecure", "--rounds", "1", "--framed-address", "auto"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "server.framed_address" in lines[0] and '--framed-address ""' in lines[0], r.stderr
    assert not (tmp_path / "run").exists()
