"""The client's state directory (fedclient.state): one atomic, versioned state file; the old layout migrated."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fedclient import FedClient, FedClientError
from fedclient.state import (
    FORMAT,
    LEGACY_DIR,
    LEGACY_FILES,
    STATE_FILE,
    VERSION,
    ClientState,
    ClientStateError,
    read_state_file,
)
from fedcore.config import ClientConfig
from fedcore.log import get_logger
from fedcore.metrics import save_private_model
from fedcore.nfl.individual import IndividualState, save_individual_state
from fedcore.serialization import fingerprint, manifest_of
from fedcore.train.trainers import TRAINER_STATE_FILE, TrainerState, save_trainer_state

LOG = get_logger("test")


def _model_state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(2)}


def _old_layout(d: Path) -> None:
    """A state dir as fedguard wrote it before the state file: four files, one per concern."""
    d.mkdir(parents=True)
    (d / "client.json").write_text(json.dumps({"client_id": "client-0123456789ab"}))
    save_private_model(d, _model_state(), 0.8125, {"epochs": 3})
    save_individual_state(d, IndividualState(negative_count=2, adapting=True, started_round=4, last_round=5))
    save_trainer_state(d, TrainerState(adapted=_model_state(), active=True, rounds_adapted=2))


def test_the_state_file_is_written_whole_with_its_format_and_version(tmp_path: Path) -> None:
    state = ClientState.open(tmp_path / "s")
    assert not (tmp_path / "s").exists()  # nothing is written before there is something to keep
    cid = state.client_id()
    assert cid.startswith("client-") and len(cid) == 19
    doc = json.loads((tmp_path / "s" / STATE_FILE).read_text())
    assert (doc["format"], doc["version"], doc["client_id"]) == (FORMAT, VERSION, cid)
    assert doc["files"] == {"trainer_state": TRAINER_STATE_FILE}
    state.save_individual(IndividualState(negative_count=1, last_round=1))
    state.record_private_model(_model_state(), 0.75, 2, "key-a")
    # No temp file is left beside it, and a reopened state reads every field back.
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [STATE_FILE]
    again = ClientState.open(tmp_path / "s")
    assert again.client_id() == cid
    assert again.individual() == IndividualState(negative_count=1, last_round=1)
    assert again.private_accuracy(fingerprint(manifest_of(_model_state())), "key-a") == 0.75
    assert again.private_accuracy("another model", "key-a") is None
    # Trained as something else (other data, seed, epochs or settings): not reused.
    assert again.private_accuracy(fingerprint(manifest_of(_model_state())), "key-b") is None


def test_a_failed_write_leaves_the_previous_state_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = ClientState.open(tmp_path)
    state.save_individual(IndividualState(negative_count=1, last_round=1))
    before = (tmp_path / STATE_FILE).read_bytes()

    def no_rename(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="No space"):
        state.save_individual(IndividualState(negative_count=2, last_round=2))
    assert (tmp_path / STATE_FILE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]  # the temp file is removed


def test_without_a_state_dir_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    state = ClientState.open("")
    state.save_individual(IndividualState(negative_count=3))
    state.save_trainer_state(TrainerState())
    assert state.individual().negative_count == 3 and state.load_trainer_state() is None
    assert list(tmp_path.iterdir()) == []


def test_the_old_layout_is_migrated_and_only_then_moved_aside(tmp_path: Path) -> None:
    d = tmp_path / "old"
    _old_layout(d)
    trainer_bytes = (d / TRAINER_STATE_FILE).read_bytes()
    old_bytes = {name: (d / name).read_bytes() for name in LEGACY_FILES}
    state = ClientState.open(d, LOG)
    assert sorted(p.name for p in d.iterdir()) == sorted([STATE_FILE, TRAINER_STATE_FILE, LEGACY_DIR])
    # Nothing is deleted: the old files, byte for byte, under legacy-layout/ (the private model's weights too).
    assert {p.name: p.read_bytes() for p in (d / LEGACY_DIR).iterdir()} == old_bytes
    assert (d / TRAINER_STATE_FILE).read_bytes() == trainer_bytes  # the tensor file stays as it is
    assert state.client_id() == "client-0123456789ab"
    assert state.individual() == IndividualState(negative_count=2, adapting=True, started_round=4, last_round=5)
    assert state.doc.private_model is not None and state.doc.private_model.accuracy == 0.8125
    assert state.doc.private_model.epochs == 0  # the old file did not say
    # ... nor what it was trained as (data, seed, settings): kept, never reused in place of a trained one.
    assert state.doc.private_model.trained_as == ""
    assert state.private_accuracy(fingerprint(manifest_of(_model_state())), "any key") is None
    loaded = state.load_trainer_state()
    assert loaded is not None and loaded.active and loaded.adapted is not None
    assert torch.equal(loaded.adapted["w"], _model_state()["w"])
    # A FedClient on the migrated dir keeps its identity.
    assert FedClient(ClientConfig(state_dir=str(d))).client_id == "client-0123456789ab"


def test_a_failed_migration_removes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "old"
    _old_layout(d)
    names = sorted(p.name for p in d.iterdir())

    def no_rename(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError):
        ClientState.open(d)
    assert sorted(p.name for p in d.iterdir()) == names
    assert set(LEGACY_FILES) <= set(names)


@pytest.mark.parametrize("broken", ["client.json", "individual_nfl.json", "private_model.fgt"])
def test_an_unreadable_old_file_stops_the_migration_naming_it(tmp_path: Path, broken: str) -> None:
    d = tmp_path / "old"
    _old_layout(d)
    (d / broken).write_bytes(b"\x00garbage")
    with pytest.raises(ClientStateError, match=broken) as err:
        ClientState.open(d)
    assert "ways on" in str(err.value)
    assert not (d / STATE_FILE).exists() and (d / broken).read_bytes() == b"\x00garbage"


@pytest.mark.parametrize(("content", "match"), [
    (b"{not json", "unreadable client state"),
    (json.dumps({"format": "something else", "version": 1}).encode(), "not a fedguard client state file"),
    (json.dumps({"format": FORMAT, "version": 1, "client_id": 7}).encode(), "corrupt client state.*client_id"),
    (json.dumps({"format": FORMAT, "version": 1, "individual": {"negative_count": -1}}).encode(),
     "corrupt client state.*individual.negative_count"),
    (json.dumps({"format": FORMAT, "version": 1, "private_model": {"fingerprint": "x"}}).encode(),
     "corrupt client state.*private_model"),
])
def test_an_unreadable_state_file_is_refused_and_left_alone(tmp_path: Path, content: bytes, match: str) -> None:
    (tmp_path / STATE_FILE).write_bytes(content)
    with pytest.raises(ClientStateError, match=match) as err:
        ClientState.open(tmp_path)
    assert str(tmp_path / STATE_FILE) in str(err.value) and "ways on" in str(err.value)
    assert (tmp_path / STATE_FILE).read_bytes() == content


def test_a_newer_version_is_refused_with_the_ways_on(tmp_path: Path) -> None:
    content = json.dumps({"format": FORMAT, "version": VERSION + 1, "client_id": "c", "new_field": 1}).encode()
    (tmp_path / STATE_FILE).write_bytes(content)
    with pytest.raises(ClientStateError, match=rf"version {VERSION + 1} was written by a newer fedguard") as err:
        read_state_file(tmp_path / STATE_FILE)
    assert "ways on: run the newer fedguard" in str(err.value)
    # FedClient says the same as a FedClientError (the CLI's exit 2), before anything else happens.
    with pytest.raises(FedClientError, match="newer fedguard"):
        FedClient(ClientConfig(state_dir=str(tmp_path)))
    assert (tmp_path / STATE_FILE).read_bytes() == content


def test_old_files_beside_a_state_file_are_ignored_not_removed(tmp_path: Path) -> None:
    ClientState.open(tmp_path).client_id()
    (tmp_path / "client.json").write_text(json.dumps({"client_id": "stale"}))
    assert ClientState.open(tmp_path).client_id() != "stale"
    assert (tmp_path / "client.json").exists()


def test_a_configured_client_id_wins_and_is_not_recorded(tmp_path: Path) -> None:
    a = FedClient(ClientConfig(state_dir=str(tmp_path), client_id="device-7"))
    assert a.client_id == "device-7" and not (tmp_path / STATE_FILE).exists()
    b = FedClient(ClientConfig(state_dir=str(tmp_path)))
    assert b.client_id.startswith("client-") and FedClient(ClientConfig(state_dir=str(tmp_path))).client_id == \
        b.client_id


def test_the_cli_exits_2_with_one_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedclient.cli import main

    (tmp_path / STATE_FILE).write_bytes(b"{")
    assert main(["--server", "127.0.0.1:1", "--insecure", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedclient: ") and str(tmp_path / STATE_FILE) in err[0]
    assert "ways on" in err[0] and (tmp_path / STATE_FILE).read_bytes() == b"{"
