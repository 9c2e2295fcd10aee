from __future__ import annotations

from pathlib import Path

import pytest

from fedcore.config import (
    ClientConfig,
    ConfigError,
    ServerConfig,
    build_config,
    parse_override,
)


def test_defaults_are_valid_but_plaintext_needs_an_explicit_opt_in() -> None:
    with pytest.raises(ConfigError, match=r"security.tls_cert: TLS needs a certificate"):
        ServerConfig().validate()
    cfg = ServerConfig()
    cfg.security.insecure = True
    cfg.validate()
    ClientConfig().validate()  # TLS against the system's trusted roots


def test_toml_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "fed.toml"
    f.write_text('[rounds]\nnum_rounds = 7\nclients_per_round = 4\n[model]\nname = "mlp"\n'
                 '[model.kwargs]\nhidden = [32, 16]\n[training]\nlearning_rate = 0.1\n')
    cfg = build_config(ServerConfig, f, [parse_override("rounds.num_rounds=9"), (["server", "address"], "0.0.0.0:1"),
                                         parse_override("security.insecure=true")])
    assert cfg.rounds.num_rounds == 9 and cfg.rounds.clients_per_round == 4
    assert cfg.model.kwargs == {"hidden": [32, 16]}
    assert cfg.training.learning_rate == 0.1
    assert cfg.server.address == "0.0.0.0:1"


@pytest.mark.parametrize(("override", "field"), [
    ("rounds.clients_per_round=0", "rounds.clients_per_round"),
    ("rounds.num_rounds=-1", "rounds.num_rounds"),
    ("rounds.min_updates=11", "rounds.min_updates"),
    ("rounds.over_select=0.5", "rounds.over_select"),
    ("training.learning_rate=0", "training.learning_rate"),
    ("training.batch_size=0", "training.batch_size"),
    ("server.address='nohost'", "server.address"),
    ("server.heartbeat_patience_s=1", "server.heartbeat_patience_s"),
    ("server.chunk_bytes=10", "server.chunk_bytes"),
    ("server.event_loop='trio'", "server.event_loop"),
    ("server.max_pending_calls=0", "server.max_pending_calls"),
    ("rounds.bogus=1", "rounds.bogus"),
    ("rounds.num_rounds='ten'", "rounds.num_rounds"),
    ("training.learning_rate=true", "training.learning_rate"),
    ("nosuchsection.x=1", "nosuchsection"),
])
def test_bad_values_name_their_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_config(ServerConfig, None, [parse_override(override)])
    assert e.value.field == field
    assert str(e.value).startswith(field + ":")


def test_bad_toml_file_is_reported(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[rounds\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config(ServerConfig, f)
    with pytest.raises(ConfigError, match="file not found"):
        build_config(ServerConfig, tmp_path / "missing.toml")


def test_override_values_are_toml_literals() -> None:
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a.b=0.5") == (["a", "b"], 0.5)
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("a.b=word") == (["a", "b"], "word")
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    with pytest.raises(ConfigError):
        parse_override("novalue")


def test_client_config_validation() -> None:
    with pytest.raises(ConfigError, match="trainer"):
        ClientConfig(trainer="magic").validate()
    with pytest.raises(ConfigError, match="backoff_initial_s"):
        ClientConfig(backoff_initial_s=5, backoff_max_s=1).validate()
    for device in ("cpu", "cuda", "cuda:1", "auto"):
        assert ClientConfig(device=device).validate().device == device
    for device in ("gpu", "cuda:", "cuda:x", ""):
        with pytest.raises(ConfigError, match="device: one of"):
            ClientConfig(device=device).validate()


def test_json_config_files_and_toml_literals(tmp_path: Path) -> None:
    import json

    from fedcore.config import toml_literal

    f = tmp_path / "fed.json"
    f.write_text(json.dumps({"rounds": {"num_rounds": 4}, "model": {"kwargs": {"hidden": [8]}},
                             "security": {"insecure": True}}))
    cfg = build_config(ServerConfig, f)
    assert cfg.rounds.num_rounds == 4 and cfg.model.kwargs == {"hidden": [8]}
    for value in (3, 0.5, True, "a\\\"b", [1, [2, "x"]], {"k": 1, "m": {"n": False}}):
        assert parse_override("a=" + toml_literal(value))[1] == value
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        build_config(ServerConfig, tmp_path / "bad.json")


def test_the_recovery_method_and_its_options_are_checked_naming_the_field() -> None:
    for override, field in (("recovery.method='bogus'", "recovery.method"),
                            ("recovery.options={l_fb = -1}", "recovery.options"),
                            ("recovery.options={nope = 1}", "recovery.options")):
        with pytest.raises(ConfigError) as e:
            build_config(ServerConfig, None, [parse_override(override), parse_override("security.insecure=true")])
        assert e.value.field.startswith(field), (override, e.value)
    with pytest.raises(ConfigError, match="trainer_options: options need a trainer"):
        ClientConfig(trainer_options={"l_fb": 1}).validate()


# ---- checked before the server listens (issue 13) ----

def _server(**rounds: object) -> ServerConfig:
    return build_config(ServerConfig, None, [(["security", "insecure"], True),
                                             *[(["rounds", k], v) for k, v in rounds.items()]])


@pytest.mark.parametrize(("dataset", "options", "k", "field", "message"), [
    ("nope", {}, 10, "data.dataset", "unknown dataset 'nope'; known: cifar10"),
    ("mnist", {"colour": 1}, 10, "data.options", "unknown option 'colour'"),
    ("mnist", {"partition": "bogus"}, 10, "data.options", "unknown partition 'bogus'"),
    ("mnist", {"partition": "dirichlet--1"}, 10, "data.options", "alpha must be a number > 0"),
    ("mnist", {"partition": "noniid"}, 10, "data.options", "give the classes per client"),
    ("mnist", {"num_clients": 0}, 10, "data.options", "num_clients must be a positive integer"),
    ("synthetic", {"colour": 1}, 10, "data.options", "unknown option 'colour'; known: alpha"),
    ("mnist", {"num_clients": 5}, 10, "rounds.clients_per_round", "K = 10 is more than the 5 clients"),
    ("cifar10", {}, 101, "rounds.clients_per_round", "cifar10 makes 100 clients unless data.options sets"),
])
def test_data_configuration_is_checked_without_loading_data(dataset: str, options: dict[str, object], k: int,
                                                            field: str, message: str) -> None:
    from fedcore.config import check_data_config

    cfg = _server(clients_per_round=k)
    cfg.data.dataset, cfg.data.options = dataset, options
    with pytest.raises(ConfigError, match=message) as e:
        check_data_config(cfg)
    assert e.value.field == field


def test_data_configurations_that_clients_can_load_pass() -> None:
    from fedcore.config import check_data_config

    for dataset, options, k in [("synthetic", {"alpha": 1.0}, 50), ("mnist", {"num_clients": 10}, 10),
                                ("har", {"partition": "natural"}, 30), ("mnist", {"partition": "noniid-2"}, 100)]:
        cfg = _server(clients_per_round=k)
        cfg.data.dataset, cfg.data.options = dataset, options
        check_data_config(cfg)  # natural: the number of volunteers is known only from the data


def test_min_available_above_the_shards_is_refused() -> None:
    from fedcore.config import check_data_config

    cfg = _server(clients_per_round=5, min_available=20)
    cfg.data.dataset, cfg.data.options = "mnist", {"num_clients": 10}
    with pytest.raises(ConfigError, match=r"rounds\.min_available: 20 is more than the 10 clients"):
        check_data_config(cfg)


def test_default_min_updates_is_raised_to_what_the_rule_needs() -> None:
    from fedcore.config import resolved_rounds

    cfg = _server(clients_per_round=10)
    assert resolved_rounds(cfg).min_updates == 5
    cfg = build_config(ServerConfig, None, [(["security", "insecure"], True), (["rounds", "clients_per_round"], 10),
                                            (["aggregation", "rule"], "krum"), (["aggregation", "krum_f"], 3)])
    assert resolved_rounds(cfg).min_updates == 9  # Krum with f = 3 needs 2f + 3 updates
    cfg = _server(clients_per_round=10, min_updates=7)
    assert resolved_rounds(cfg).min_updates == 7
