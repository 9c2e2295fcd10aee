"""The fuzz targets (tests/fuzz/targets.py) over their seed corpora and seeded random mutations: no parser of bytes
from the network or the disk lets an unexpected error out (issue 53, item 2). The same targets run coverage-guided
under atheris with ``python -m tests.fuzz.run NAME --seconds S``; every finding becomes an input here."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.fuzz.run import NAMES, corpus, mutations, scratch_root
from tests.fuzz.targets import TARGETS

# Inputs per target: the cheap parsers many, the ones that validate a whole configuration or touch the disk fewer.
COUNTS = {"frames": 5000, "update_header": 5000, "session_request": 5000, "config_toml": 400, "fgt_file": 400,
          "signed_request": 3000, "update_stream": 3000, "snapshot_rows": 2000, "safetensors_model": 150}


@pytest.fixture(autouse=True, scope="module")
def _remove_scratch_files() -> Iterator[None]:
    """The files the targets write and read back (this process's ``fedguard-fuzz-<pid>*``) go afterwards."""
    yield
    for path in scratch_root().glob(f"fedguard-fuzz-{os.getpid()}*"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


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


def test_the_generated_seeds_reach_the_end_of_their_parsers() -> None:
    """The seeds of the targets added for the stream, the store and the final model are what a real sender or
    writer produces, and go all the way through: the chunks reassemble, the rows resume, the model loads."""
    import json
    from pathlib import Path

    import torch

    from fedcore.outputs import load_model, read_model
    from fedcore.rounds import RoundsConfig
    from fedserver.persistence import decode_snapshot
    from fedserver.store import Snapshot
    from tests.fuzz import targets as t

    streams = sorted((t.split_messages(d) for d in corpus("update_stream")), key=len)
    assert [len(m) for m in streams] == [1, 5]  # the update inside its header; its header and four 16-byte chunks
    assert [t._decode_request(m)[1] is not None for m in streams[1]] == [False] + [True] * 4
    models = {b'"tiny"' in d: d for d in corpus("safetensors_model")}
    t.safetensors_model(models[True])
    model = load_model(t._MODEL_DIR, model=t._tiny_model())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), t._tiny_model().state_dict().values(),
                                                 strict=True))
    t.safetensors_model(models[False])  # a registered model (logreg), built from the zoo by the sidecar's name
    weights, sidecar = read_model(t._MODEL_DIR)
    built = load_model(t._MODEL_DIR).state_dict()
    assert sidecar["model"] == "logreg" and all(torch.equal(built[k], v) for k, v in weights.items())
    for seed in corpus("snapshot_rows"):
        state, progress, *history = seed[2:].split(b"\x1e")
        history_len = -1 if seed[1] == 0xFF else seed[1]
        snap = Snapshot(seed[0], json.loads(state), {}, history_len)
        round_state, reports = decode_snapshot(snap, [json.loads(h) for h in history],
                                               json.loads(progress) if progress else None, RoundsConfig(num_rounds=5),
                                               1.0, Path("state"))
        assert round_state.round == seed[0] + 1 and len(reports) == (2 if seed[0] else 0)
