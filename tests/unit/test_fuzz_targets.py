"""The fuzz targets (tests/fuzz/targets.py) over their seed corpora and seeded random mutations: no parser of bytes
from the network or the disk lets an unexpected error out (issue 53, item 2). The same targets run coverage-guided
under atheris with ``python -m tests.fuzz.run NAME --seconds S``; every finding becomes an input here."""

from __future__ import annotations

import pytest

from tests.fuzz.run import NAMES, corpus, mutations
from tests.fuzz.targets import TARGETS

# Inputs per target: the cheap parsers many, the ones that validate a whole configuration or touch the disk fewer.
COUNTS = {"frames": 5000, "update_header": 5000, "session_request": 5000, "config_toml": 400, "fgt_file": 400,
          "signed_request": 3000}


def test_every_target_has_a_seed_corpus_and_a_runner_name() -> None:
    assert sorted(TARGETS) == sorted(NAMES) == sorted(COUNTS)
    for name in NAMES:
        assert corpus(name), name


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_no_unexpected_error_from_seeded_mutations(name: str) -> None:
    target = TARGETS[name]
    for data in mutations(name, COUNTS[name], seed=0):
        target(data)  # any exception the parser does not document for bad input fails the test, with its input


@pytest.mark.parametrize(("section", "key"), [("aggregation", "options"), ("nfl", "detector_options"),
                                              ("recovery", "options")])
def test_a_plugin_options_value_that_is_not_a_table_names_its_field(section: str, key: str) -> None:
    """Found by the config_toml target: ``[aggregation] options = true`` escaped as a TypeError ("'bool' object is
    not iterable") instead of a ConfigError naming the field."""
    import tomllib

    from fedcore.config import ConfigError, ServerConfig, from_dict

    rule = 'rule = "trimmed_mean"\n' if section == "aggregation" else ""
    table = tomllib.loads(f"[{section}]\n{rule}{key} = true\n[security]\ninsecure = true\n")
    with pytest.raises(ConfigError, match=rf"^{section}\.{key}"):
        from_dict(ServerConfig, table).validate()


def test_a_timestamp_of_non_ascii_digits_is_a_malformed_timestamp() -> None:
    """Found while writing the signed_request target: "²" passes str.isdigit() but not int(), so a ValueError
    escaped the verifier instead of its AuthError (unreachable through gRPC, whose metadata is ASCII)."""
    from fedguard.signing import TIMESTAMP, AuthError, ReplayGuard, sign_request, verify_request
    from tests.fuzz.targets import _KEY, _KEYS

    md = [(k, "²" if k == TIMESTAMP else v) for k, v in sign_request(_KEY, "alice", "/m", b"x", 1.8e9)]
    with pytest.raises(AuthError, match="malformed timestamp"):
        verify_request(_KEYS, ReplayGuard(60), "/m", md, b"x", 1.8e9)
