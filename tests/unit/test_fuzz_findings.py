"""Every finding of the fuzz targets (tests/fuzz/targets.py; issue 53, item 2) as a test, its input a literal:
each parser of bytes from the network or the disk raises its documented error, never another exception.
docs/results/fuzzing.md says how each was found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DEEP_JSON = "[" * 100_000  # past the interpreter's recursion limit: json.loads raises RecursionError
DEEP_TOML = b"a = " + b"[" * 100_000


# ---- the framed/stream chunk read in place (fedguard.wire.read_chunk) ----

@pytest.mark.parametrize("message", ["SessionRequest", "UpdateMessage", "TaskMessage", "SessionReply"])
def test_an_empty_chunk_frame_is_left_to_protobuf(message: str) -> None:
    """A chunk field of length 0 (``12 00`` / ``1a 00``): read_chunk indexed one byte past the frame
    (IndexError inside the gRPC deserializer) instead of saying "not canonical" (None)."""
    from fedguard import wire
    from fedguard.v1 import fedguard_pb2 as pb

    cls = getattr(pb, message)
    raw = bytes([(wire._CHUNK_FIELD[cls] << 3) | 2, 0])
    assert wire.read_chunk(raw, cls) is None
    parsed = cls.FromString(raw)  # what the servicer then does: protobuf reads an empty chunk
    assert parsed.WhichOneof("kind") == "chunk" and parsed.chunk.data == b""


# ---- .fgt tensor files (fedcore.serialization.load_state) ----

def _fgt(header: bytes) -> bytes:
    return b"FGTENS01" + len(header).to_bytes(8, "little") + header


@pytest.mark.parametrize(("header", "why"), [
    (DEEP_JSON.encode(), "RecursionError"),
    (b'{"tensors": [], "extra": 5}', "TypeError from dict(5)"),
    (b'{"tensors": [], "extra": "ab"}', "ValueError from dict('ab'), not a SerializationError"),
    (b'{"tensors": [], "extra": [1]}', "TypeError from dict([1])"),
])
def test_a_corrupt_fgt_header_is_a_serialization_error(tmp_path: Path, header: bytes, why: str) -> None:
    from fedcore.serialization import SerializationError, load_state

    path = tmp_path / "m.fgt"
    path.write_bytes(_fgt(header))
    with pytest.raises(SerializationError, match="corrupt header"):
        load_state(path)


# ---- configuration files (fedcore.config.load_toml) ----

@pytest.mark.parametrize(("name", "data", "match"), [
    ("deep.toml", DEEP_TOML, "nests arrays or tables too deeply"),
    ("latin1.toml", b"a = '\xff'\n", "not UTF-8"),
    ("latin1.json", b'{"a": "\xff"}', "not UTF-8"),
])
def test_a_config_file_that_does_not_parse_is_a_config_error(tmp_path: Path, name: str, data: bytes,
                                                             match: str) -> None:
    from fedcore.config import ConfigError, load_toml

    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=match):
        load_toml(path)


# ---- safetensors final models (fedcore.outputs) ----

def _sidecar(tmp_path: Path, text: str) -> Path:
    from fedcore.outputs import SIDECAR_FILE

    (tmp_path / SIDECAR_FILE).write_text(text)
    return tmp_path


@pytest.mark.parametrize(("sidecar", "match"), [
    (DEEP_JSON, "not a readable model sidecar"),
    ('{"format": "fedguard-model", "format_version": "one"}', "format_version 'one' is not an integer"),
    ('{"format": "fedguard-model", "format_version": [1]}', r"format_version \[1\] is not an integer"),
    ('{"format": "fedguard-model", "format_version": null}', "format_version None is not an integer"),
])
def test_a_damaged_model_sidecar_is_a_model_file_error(tmp_path: Path, sidecar: str, match: str) -> None:
    from fedcore.outputs import ModelFileError, read_model

    with pytest.raises(ModelFileError, match=match):
        read_model(_sidecar(tmp_path, sidecar))


def test_a_sidecar_cannot_make_load_model_allocate_what_it_says(tmp_path: Path) -> None:
    """Found while writing the safetensors_model target: load_model built the model a sidecar names with the
    options it gives before comparing it with the weights, so ``mlp`` with 10^7 x 10^7 weights tried to allocate
    400 TB (a RuntimeError from the allocator; options a machine can just hold would take all its memory). The
    model is now first built on the meta device and compared with the weights' tensors."""
    from fedcore.outputs import MODEL_FILE, SIDECAR_FILE, ModelFileError, load_model
    from tests.fuzz.targets import safetensors_seeds

    seed = safetensors_seeds()[1]  # a logreg model as write_model writes it
    n = int.from_bytes(seed[:2], "little")
    sidecar = json.loads(seed[2:2 + n])
    sidecar.update(model="mlp", model_kwargs={"in_features": 10**7, "hidden": [10**7]})
    (tmp_path / SIDECAR_FILE).write_text(json.dumps(sidecar))
    (tmp_path / MODEL_FILE).write_bytes(seed[2 + n:])
    with pytest.raises(ModelFileError, match=r"does not have the tensors of .* \(not built\)"):
        load_model(tmp_path)


# ---- the state store's snapshot rows (fedserver.snapshot_files, fedserver.store, fedserver.persistence) ----

def test_a_state_or_history_row_nested_too_deeply_is_unverified() -> None:
    from fedserver.snapshot_files import Unverified, parse_history, parse_state

    with pytest.raises(Unverified, match="not valid JSON"):
        parse_state(DEEP_JSON)
    with pytest.raises(Unverified, match="history row 0 is not valid JSON"):
        parse_history([(0, DEEP_JSON)], 1)


def test_a_progress_record_nested_too_deeply_is_ignored(tmp_path: Path) -> None:
    from fedserver.store import Snapshot, StateStore

    with StateStore(tmp_path) as store:
        store.save(Snapshot(0, {"round_state": {}}, {}))
        store.put_progress({"round_state": {}})
        store._conn.execute("UPDATE progress SET state = ?", (DEEP_JSON,))
        loaded = store.load()
    assert loaded.snapshot is not None and loaded.progress is None
    assert loaded.skipped == ["progress record of round 0 ignored: not a JSON object"]


def _decode(state: dict[str, object], history: list[dict[str, object]] | None = None,
            progress: dict[str, object] | None = None) -> None:
    from fedcore.rounds import RoundsConfig
    from fedserver.persistence import decode_snapshot
    from fedserver.store import Snapshot

    snap = Snapshot(2, state, {}, -1 if history is None else len(history))
    decode_snapshot(snap, history or [], progress, RoundsConfig(num_rounds=5), 1.8e9, Path("run/state"))


GOOD = {"round": 3, "phase": "training", "clients": [["a", 0, 10, False, False]]}


@pytest.mark.parametrize(("state", "history", "progress"), [
    ({"slots": {}}, None, None),  # no round_state: KeyError
    ({"round_state": []}, None, None),  # a list: TypeError from dict(list)... of pairs, or worse
    ({"round_state": "x"}, None, None),
    ({"round_state": {"nonsense": 1}}, None, None),  # TypeError: unexpected keyword argument
    ({"round_state": {"clients": [["a", "zero", 10, False, False]]}}, None, None),  # ValueError from int()
    ({"round_state": {"clients": [["a", [], 10, False, False]]}}, None, None),  # TypeError from int([])
    ({"round_state": {"clients": {"a": 5}}}, None, None),  # TypeError: ClientRecord(**5)
    ({"round_state": GOOD, "slots": []}, None, None),  # AttributeError: list.items
    ({"round_state": GOOD, "history": 5}, None, None),  # schema 1: history inside the state, not a list
    ({"round_state": GOOD}, [{"round": 1, "metrics": 5}], None),  # TypeError from dict(5)
    ({"round_state": GOOD}, [{"round": 1, "clusters": {"c": "x"}}], None),  # ValueError from int("x")
    ({"round_state": GOOD}, [{"metrics": {}}], None),  # TypeError: missing round
    ({"round_state": GOOD}, None, {"round_state": [1, 2]}),  # the progress record's round state
    # Found by the snapshot_rows target (atheris, 118,793 executions): a history row's round a string decoded,
    # then broke the resume's comparison of rounds (TypeError: '>' between str and int).
    ({"round_state": GOOD, "slots": {}, "history": [{"round": "off", "nfl_conds": 0.0, "outcome": None}]}, None,
     None),
    ({"round_state": GOOD}, [{"round": True}], None),  # a bool is no round
    ({"round_state": GOOD}, [{"round": 1, "beta": "x"}], None),
    ({"round_state": {**GOOD, "phase": "finished", "outcome": "completed", "round": "x"}}, None, None),
    ({"round_state": {**GOOD, "clients": {"a": {"client_id": 5, "index": 0}}}}, None, None),
    ({"round_state": {**GOOD, "rejected_total": 1.5}}, None, None),
])
def test_a_snapshot_that_does_not_decode_is_a_store_error(state: dict[str, object],
                                                          history: list[dict[str, object]] | None,
                                                          progress: dict[str, object] | None) -> None:
    """A hand-edited or damaged ``state.db`` whose rows are JSON objects but not a server's: the resume escaped
    with a KeyError/TypeError/ValueError/AttributeError traceback instead of the StoreError that names the file
    and the ways on (the server stops with exit 2)."""
    from fedserver.store import StoreError

    with pytest.raises(StoreError, match=r"run/state/state\.db: the snapshot of round 2 does not decode .*--fresh"):
        _decode(state, history, progress)


def test_the_snapshot_rows_crash_input_is_refused_as_a_store_error() -> None:
    """The exact input the snapshot_rows target crashed on (runs/fuzz/snapshot_rows-artifacts/crash-184ade44...):
    a schema-1 snapshot (history_len -1) whose round is a JSON object and whose history row's round is "off"."""
    from tests.fuzz.targets import snapshot_rows

    snapshot_rows(b'\x02\xff{"round_state": {"round": {"a": {"calive": true, "opt_out": false, "attacker": true, '
                  b'"ready": false}}}, "slots": {}, "history": [{"round": "off", "nfl_conds": 0.0, "outcome": NaN}]}'
                  b'\x1e')


def test_a_snapshot_a_server_wrote_decodes() -> None:
    """The check above refuses only what does not decode: the seed rows (what a server writes) resume."""
    from tests.fuzz.targets import snapshot_seeds

    seed = snapshot_seeds()[0]
    state, progress, *history = seed[2:].split(b"\x1e")
    _decode(json.loads(state), [json.loads(h) for h in history], json.loads(progress))
