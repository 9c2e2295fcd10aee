"""server.event_loop: uvloop where installed ("auto"), insisted on ("uvloop", a clear refusal when missing) or
never ("asyncio"); the loop that runs is the one asked for."""

from __future__ import annotations

import asyncio
import importlib
from pathlib import Path
from types import ModuleType

import pytest

from fedcore.errors import ConfigError
from fedserver import event_loop


def _without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fake(name: str, package: str | None = None) -> ModuleType:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake)


async def _which() -> str:
    await asyncio.sleep(0)
    return event_loop.running_loop_name()


def test_asyncio_is_the_standard_loop_and_auto_takes_uvloop_where_installed() -> None:
    pytest.importorskip("uvloop")
    assert event_loop.loop_factory("asyncio") is None
    assert event_loop.run(_which, "asyncio") == "asyncio"
    assert event_loop.loop_factory("auto") is not None
    assert event_loop.run(_which, "auto") == "uvloop"
    assert event_loop.run(_which, "uvloop") == "uvloop"


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused_naming_the_field(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _without_uvloop(monkeypatch)
    assert event_loop.loop_factory("auto") is None
    assert event_loop.run(_which, "auto") == "asyncio"
    called: list[bool] = []

    async def main() -> None:
        called.append(True)

    with pytest.raises(ConfigError) as e:
        event_loop.run(main, "uvloop")
    assert e.value.field == "server.event_loop"
    assert "pip install uvloop" in str(e.value) and "auto" in str(e.value)
    assert not called  # refused before the coroutine was made
    with pytest.raises(ConfigError) as e:
        event_loop.loop_factory("trio")
    assert e.value.field == "server.event_loop"


def test_the_server_cli_refuses_a_missing_uvloop_with_exit_2_and_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fedserver.cli import main

    _without_uvloop(monkeypatch)
    rc = main(["--run-dir", str(tmp_path / "run"), "--address", "127.0.0.1:0", "--rounds", "1", "--model", "mlp",
               "--dataset", "synthetic", "--insecure", "--event-loop", "uvloop"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "configuration error: server.event_loop:" in err and "pip install uvloop" in err
