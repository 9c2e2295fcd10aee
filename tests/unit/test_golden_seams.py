"""Every trainer and recovery method trains bit-identically to the golden recorded before the typed-seams refactor
(issue 27; ``tools/dev/golden_seams.py``). Bit-identity is the contract on the machine type that recorded it (the
same CPU/ISA and torch/numpy builds run the same kernels); elsewhere the test says why it does not apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.dev import golden_seams


def _golden() -> dict[str, object]:
    return json.loads(golden_seams.GOLDEN.read_text())  # type: ignore[no-any-return]


def test_the_golden_records_every_registered_trainer() -> None:
    from fedcore.train.trainers import TRAINERS

    recorded = {case.split("-")[0] for case in _golden()["parts"]["trainers"]}  # type: ignore[index]
    assert set(TRAINERS.names()) <= recorded


def test_every_trainer_trains_bit_identically_to_the_golden(capsys: pytest.CaptureFixture[str]) -> None:
    golden = _golden()
    if golden["machine"] != golden_seams.machine_signature():
        pytest.skip(f"golden recorded on {golden['machine']}, this machine is {golden_seams.machine_signature()}: "
                    "other floating-point kernels, bit-identity is not the contract here")
    problems = golden_seams.check("trainers", golden)
    assert problems == [], "\n".join(problems)


def test_the_comparison_names_the_first_difference() -> None:
    want = {"a": [{"x": "1.0"}, {"x": "2.0"}]}
    assert golden_seams._first_difference(want, {"a": [{"x": "1.0"}, {"x": "2.5"}]}) == (
        "/a[1]/x: recorded '2.0', now '2.5'")
    assert golden_seams._first_difference(want, want) is None
    assert golden_seams.untimed({"seconds": 1.0, "m": {"personal_seconds": 2.0, "loss": 3.0}}) == {"m": {"loss": 3.0}}


def test_the_golden_file_is_the_one_the_tool_reads() -> None:
    assert Path(__file__).resolve().parents[1] / "golden" / "seams.json" == golden_seams.GOLDEN
