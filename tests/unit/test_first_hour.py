"""Issue 26 in-process: help lists generated from the registries, the checks before anything starts, the cores of
co-hosted clients, the launcher's last-error reader, resume arguments and the quiet console."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from fedcore import plugins as names
from fedcore.config import ConfigError, ServerConfig, build_config


def _flat(text: str) -> str:
    """Help text as one line: argparse wraps at spaces and after hyphens."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


@pytest.mark.parametrize(("module", "lists"), [
    ("fedserver.cli", ("TRAINERS", "RULES", "DETECTORS", "DATASETS", "MODELS", "NFL_MODES")),
    ("fedclient.cli", ("TRAINERS", "DATASETS", "ATTACKS")),
    ("fedlaunch.options", ("TRAINERS", "RULES", "DETECTORS", "ATTACKS", "DATASETS", "MODELS", "NFL_MODES")),
])
def test_every_registered_name_is_in_the_help(module: str, lists: tuple[str, ...]) -> None:
    import importlib

    text = _flat(importlib.import_module(module).build_parser().format_help())
    registered = names.listed()
    missing = {key: [n for n in registered[key] if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
               for key in lists}
    assert not any(missing.values()), missing


def test_min_updates_help_says_what_zero_means() -> None:
    from fedserver.cli import build_parser

    text = _flat(build_parser().format_help())
    assert "suffice at the deadline (0 = K)" not in text  # the old, false help
    assert "0 = half of K rounded up, raised to what the aggregation rule needs" in text


# ---- checks before anything starts ----

def test_an_explicit_data_folder_is_the_only_place_looked_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedcore.data import DataError, load_client_data
    from fedcore.data.paths import ENV_VAR, SHARED_DATA_DIR, candidate_roots

    assert candidate_roots(tmp_path / "no-such") == [tmp_path / "no-such"]
    with pytest.raises(DataError, match=r"MNIST: data not found \(looked in .*no-such.*; .*no-such does not exist;"):
        load_client_data("mnist", 0, 0, {"data_dir": str(tmp_path / "no-such")})
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    assert candidate_roots(None) == [tmp_path] and candidate_roots(tmp_path / "a") == [tmp_path / "a"]
    monkeypatch.delenv(ENV_VAR)
    assert candidate_roots(None) == [SHARED_DATA_DIR]


def _server(**sections: object) -> ServerConfig:
    return build_config(ServerConfig, None, [([k], v) for k, v in {"security": {"insecure": True},
                                                                    **sections}.items()])


def test_preflight_names_the_field_and_the_allowed_values(tmp_path: Path) -> None:
    from fedcore.preflight import check_data_dir, check_server_config

    with pytest.raises(ConfigError, match=r"^data_options\.data_dir: .* does not exist"):
        check_data_dir({"data_dir": str(tmp_path / "x")}, "data_options")
    check_data_dir({"data_dir": str(tmp_path / "x"), "download": True})  # a download makes it
    assert check_server_config(_server(), num_clients=10) == 60 * 64 + 64 + 64 * 10 + 10
    with pytest.raises(ConfigError, match=r"^model\.name: 'har_cnn' does not fit dataset 'synthetic'.*fit it: "
                                          r"logreg, mlp, mlp_bn$"):
        check_server_config(_server(model={"name": "har_cnn"}))
    with pytest.raises(ConfigError, match=r"^model\.name: cannot build 'nope'.*registered models: char_lstm"):
        check_server_config(_server(model={"name": "nope"}))
    with pytest.raises(ConfigError, match=r"^rounds\.clients_per_round: K = 10 is more than the 4 clients launched"):
        check_server_config(_server(), num_clients=4)
    with pytest.raises(ConfigError, match=r"^rounds\.min_available: 6 is more than the 5 clients launched"):
        check_server_config(_server(rounds={"clients_per_round": 5, "min_available": 6}), num_clients=5)
    with pytest.raises(ConfigError, match=r"^data\.options\.data_dir: MNIST: data not found.*To get it: set "
                                          r"data\.options\.download = true"):
        check_server_config(_server(data={"dataset": "mnist", "options": {"data_dir": str(tmp_path)}},
                                    model={"name": "mnist_mlp"}))


# ---- cores ----

def test_co_hosted_clients_share_the_cores() -> None:
    from fedcore.cores import threads_per_process

    assert [threads_per_process(p, cores=2) for p in (1, 2, 3, 10)] == [2, 1, 1, 1]
    assert [threads_per_process(p, cores=16) for p in (1, 3, 4, 0)] == [16, 5, 4, 16]


def test_the_launcher_says_when_its_layout_sets_the_bits() -> None:
    from fedcore.cores import cpu_cores
    from fedlaunch.cli import layout_note

    note = layout_note(2, 1)
    assert note == (f"note: 2 torch threads per client process ({cpu_cores()} cores // 1 client process); the "
                    "model's last bits depend on it: pin --torch-threads 2 to get the same model with another --procs "
                    "or --virtual layout")
    assert "(--ray-cpus)" in layout_note(4, 3, ray=True)


def test_client_processes_are_counted_from_proc(tmp_path: Path) -> None:
    from fedcore.cores import client_processes, is_client_command

    commands = {"1": ["python", "-m", "fedclient", "--server", "x"], "2": ["/venv/bin/fedclient", "--insecure"],
                "3": ["python", "-m", "fedlaunch", "worker", "--spec", "h.json"],
                "4": ["python", "-m", "fedserver"], "5": ["python", "-m", "fedlaunch", "--clients", "3"],
                "6": ["vim", "fedclient/cli.py"]}
    for pid, argv in commands.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (tmp_path / "self").mkdir()
    assert [is_client_command(a) for a in commands.values()] == [True, True, True, False, False, False]
    assert client_processes(tmp_path) == 3
    assert client_processes(tmp_path / "missing") == 1


# ---- the launcher ----

def test_last_error_reads_the_exception_the_cli_line_and_the_error_event(tmp_path: Path) -> None:
    from fedlaunch.logs import last_error

    log = tmp_path / "server.log"
    log.write_text("\n".join([
        json.dumps({"event": "round.completed", "level": "info", "round": 3}),
        json.dumps({"event": "client.failed", "level": "error", "client_id": "c-1", "error": "boom",
                    "timestamp": "t", "component": "fedclient"}),
        "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied",
        "fedclient: note: something informative",
    ]) + "\n")
    assert last_error(log).splitlines() == ["RuntimeError: mat1 and mat2 shapes cannot be multiplied",
                                            "log event: client.failed client_id=c-1 error=boom"]
    log.write_text("fedserver: configuration error: server.address: port 1 in use\n")
    assert last_error(log) == "fedserver: configuration error: server.address: port 1 in use"
    assert last_error(tmp_path / "none.log") == ""


def test_resume_keeps_the_saved_arguments_and_refuses_a_changed_federation(tmp_path: Path) -> None:
    import argparse

    from fedlaunch.options import LAUNCH_FILE, build_parser, given_options, resume_arguments, save_arguments

    argv = ["--clients", "3", "--rounds", "40", "--trainer", "noop", "--server-set", "nfl.nr=5"]
    args = build_parser().parse_args(argv)
    save_arguments(args, tmp_path, list(vars(args)))
    assert json.loads((tmp_path / LAUNCH_FILE).read_text())["arguments"]["server_set"] == ["nfl.nr=5"]
    merged = resume_arguments(tmp_path, given_options(["--resume", "--rounds", "60", "--clients", "3"]))
    assert merged["rounds"] == 60 and merged["clients"] == 3 and merged["trainer"] == "noop"
    assert "resume" not in merged
    with pytest.raises(ConfigError, match=r"^--clients: was 3 when this federation started, now 4"):
        resume_arguments(tmp_path, given_options(["--resume", "--clients", "4"]))
    with pytest.raises(ConfigError, match=r"^--server-set: was \['nfl.nr=5'\]"):
        resume_arguments(tmp_path, given_options(["--server-set", "nfl.nr=6"]))
    with pytest.raises(ConfigError, match=r"^-k: was None"):
        resume_arguments(tmp_path, given_options(["-k", "2"]))
    assert isinstance(build_parser().parse_args([]), argparse.Namespace)


def test_eta_and_local_data_options() -> None:
    from fedlaunch.options import local_data_options
    from fedlaunch.progress import eta

    assert eta(0, 10, 5.0) == "ETA -" and eta(5, 10, 5.0) == "ETA 5s" and eta(1, 100, 2.0) == "ETA 3m18s"
    assert eta(10, 10, 3.0) == "ETA 0s"
    part = {"data": {"dataset": "mnist", "options": {"data_dir": "/d", "num_clients": 5}}}
    assert local_data_options(part, ["data.options.download=true"]) == {"data_dir": "/d", "download": True}
    assert local_data_options({}, []) == {}


# ---- the quiet console ----

def test_the_console_shows_one_short_line_per_round(capsys: pytest.CaptureFixture[str]) -> None:
    from fedcore.log import configure_logging, get_logger

    try:
        out = io.StringIO()
        configure_logging(level="info", stream=out)
        log = get_logger("fedserver")
        log.info("update.accepted", client_id="c", round=1)
        log.info("round.started", round=1)
        log.info("round.completed", round=1, outcome="quorum", accepted=3, rejected=0, mean_train_loss=0.123456789,
                 **{f"metric_{i}": float(i) for i in range(60)})
        lines = out.getvalue().splitlines()
        assert len(lines) == 1 and "round.completed" in lines[0] and "mean_train_loss=0.1235" in lines[0]
        assert "metric_" not in lines[0] and len(lines[0]) < 200
        out = io.StringIO()
        configure_logging(json=True, level="info", stream=out)
        get_logger("fedserver").info("round.completed", round=1, metric_7=7.0)
        get_logger("fedserver").info("update.accepted", client_id="c", round=1)
        records = [json.loads(line) for line in out.getvalue().splitlines()]
        assert [r["event"] for r in records] == ["round.completed", "update.accepted"]
        assert records[0]["metric_7"] == 7.0  # the JSON log keeps every field
        out = io.StringIO()
        configure_logging(level="debug", stream=out)
        get_logger("fedserver").info("update.accepted", client_id="c", round=1)
        assert "update.accepted" in out.getvalue()
    finally:
        configure_logging(level="warning")  # the test session's (tests/conftest.py)


def test_progress_is_one_rewritten_line_on_a_terminal_and_rare_plain_lines_otherwise() -> None:
    from fedlaunch.progress import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    p = Progress(tty)
    p.show("round 3/10 done, 4 s, ETA 9s")
    p.show("round 4/10 done, 5 s, ETA 7s")
    p.clear()
    assert tty.getvalue() == ("\r\x1b[2Kround 3/10 done, 4 s, ETA 9s\r\x1b[2Kround 4/10 done, 5 s, ETA 7s"
                              "\r\x1b[2K")
    plain = io.StringIO()
    p = Progress(plain, plain_every=3600.0)
    p.show("round 3/10 done")  # not a terminal: nothing until plain_every has passed
    p.last_plain -= 3600.0
    p.show("round 4/10 done")
    p.show("round 5/10 done")
    p.clear()
    assert plain.getvalue() == "round 4/10 done\n"
