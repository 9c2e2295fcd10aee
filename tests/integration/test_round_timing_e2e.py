"""A loopback federation's rounds.jsonl rows carry the server's per-round timing (fedserver.round_timing)."""

from __future__ import annotations

import json
from pathlib import Path

from fedcore.report import RoundReport
from fedserver.round_timing import PHASES
from tests.integration.helpers import run_federation, server_config


def test_rounds_jsonl_rows_carry_every_phase(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 3, "clients_per_round": 3})
    status, _ = run_federation(cfg, 3, timeout=90)
    assert status is not None and status.outcome == "completed"
    rows = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        timing = row["timing_seconds"]
        assert set(timing) == {*PHASES, "round", "server_cpu", "first_update", "median_update"}, timing
        assert all(isinstance(v, float) and v >= 0.0 for v in timing.values()), timing
        assert sum(timing[p] for p in PHASES) <= timing["round"] + 1e-5
        # Over gRPC every boundary is stamped: the critical client's task, its upload and the close take time.
        for phase in ("hand_out", "turnaround", "upload", "aggregation", "report"):
            assert timing[phase] > 0.0, (phase, timing)
        assert timing["server_cpu"] > 0.0
        # The acceptances' spread: the first and the median come no later than the last (the critical path's).
        last = timing["hand_out"] + timing["turnaround"] + timing["upload"]
        assert 0.0 < timing["first_update"] <= timing["median_update"] <= last + 1e-5, timing
        # The rest of the row is the report as before (a reader of rounds.jsonl ignores the new key).
        assert RoundReport.from_dict(row).to_dict().keys() == {k for k in row if k != "timing_seconds"}
    # Persistence is on in the tests' configuration: the snapshot is timed too.
    assert all(r["timing_seconds"]["snapshot"] > 0.0 for r in rows)
