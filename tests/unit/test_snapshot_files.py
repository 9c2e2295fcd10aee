"""The state store's file rules and snapshot verification as plain functions (fedserver.snapshot_files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedcore.serialization import save_state
from fedserver.snapshot_files import Unverified, parse_history, parse_state, store_file, verify_models


def test_only_the_stores_own_files_in_models_are_named() -> None:
    assert store_file("models/r000003-global-0123abcd.fgt") == "r000003-global-0123abcd.fgt"
    assert store_file("models/r000003-global-0123abcd.fgt.tmp") == "r000003-global-0123abcd.fgt.tmp"
    for rel in ("r000003-global-0123abcd.fgt", "models/../x.fgt", "models/notes.txt", "other/r000003-g-0123abcd.fgt",
                "models/r3-global-0123abcd.fgt"):
        assert store_file(rel) == "", rel


def test_state_and_history_must_be_json_objects_and_complete() -> None:
    assert parse_state('{"a": 1}') == {"a": 1}
    with pytest.raises(Unverified, match="not an object"):
        parse_state("[1]")
    assert parse_history([(0, '{"round": 1}'), (1, '{"round": 2}')], 2) == [{"round": 1}, {"round": 2}]
    with pytest.raises(Unverified, match="1 of the 2 rows"):
        parse_history([(0, '{"round": 1}')], 2)
    with pytest.raises(Unverified, match="row 0 is not valid JSON"):
        parse_history([(0, "{")], 1)


def test_model_files_are_checked_by_size_and_sha256_before_parsing(tmp_path: Path) -> None:
    import hashlib

    name = "r000001-global-0123abcd.fgt"
    save_state(tmp_path / name, {"w": torch.ones(3)}, {"model_id": "global"})
    data = (tmp_path / name).read_bytes()
    row = ("global", f"models/{name}", hashlib.sha256(data).hexdigest(), len(data))
    assert torch.equal(verify_models(tmp_path, [row])["global"]["w"], torch.ones(3))
    assert verify_models(tmp_path, [row], parse=False) == {}
    with pytest.raises(Unverified, match="truncated or half-written"):
        verify_models(tmp_path, [(*row[:3], len(data) + 1)])
    with pytest.raises(Unverified, match="sha256"):
        verify_models(tmp_path, [(*row[:2], "0" * 64, len(data))])
    with pytest.raises(Unverified, match="holds model 'global'"):
        verify_models(tmp_path, [("other", *row[1:])])
    with pytest.raises(Unverified, match="not a path inside"):
        verify_models(tmp_path, [("global", "../escape.fgt", row[2], row[3])])
