"""Strict JSON (fedcore.jsonio): what a run writes parses with parse_constant refusing NaN/Infinity, and readers
take both the strict rows and the NaN rows of older files."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
from pathlib import Path

import pytest

from fedcore import jsonio
from fedcore.report import RoundReport, row_from_json


def test_non_finite_numbers_become_null_at_any_depth() -> None:
    value = {"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], "d": (2, "x"), "e": None}
    text = jsonio.dumps(value)
    assert jsonio.strict_loads(text) == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, "x"], "e": None}
    with pytest.raises(ValueError, match="NaN"):
        jsonio.strict_loads('{"a": NaN}')
    assert math.isnan(jsonio.loads('{"a": NaN}')["a"])  # older files still read
    assert math.isnan(jsonio.number(None)) and jsonio.number(3) == 3.0
    with pytest.raises(ValueError):
        jsonio.number("3")


def test_round_rows_round_trip_through_null(tmp_path: Path) -> None:
    from fedserver.persistence import write_round

    r = RoundReport(round=2, accepted=3, beta=math.nan, beta_hat=0.25, metrics={"delta": math.nan, "w_div": 1.5})
    write_round(tmp_path, r)
    line = (tmp_path / "rounds.jsonl").read_text().splitlines()[0]
    d = jsonio.strict_loads(line)
    assert d["beta"] is None and d["metrics"]["delta"] is None and d["beta_hat"] == 0.25
    back = RoundReport.from_dict(d)
    assert math.isnan(back.beta) and math.isnan(back.metrics["delta"]) and back.metrics["w_div"] == 1.5
    assert back.accepted == 3 and back.beta_hat == 0.25
    row = row_from_json(d)
    assert math.isnan(row["beta"]) and math.isnan(row["metrics"]["delta"]) and row["round"] == 2
    # a row of an older file (NaN written by json.dumps) reads the same
    old = row_from_json(json.loads(json.dumps(r.to_dict())))
    assert math.isnan(old["beta"]) and old["beta_hat"] == 0.25


def test_json_log_lines_are_strict() -> None:
    from fedcore.log import ROOT_LOGGER, configure_logging, get_logger

    logger = logging.getLogger(ROOT_LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    buf = io.StringIO()
    configure_logging(json=True, stream=buf)
    try:
        get_logger("fedserver").info("round.completed", beta=math.nan, eps=math.inf, acc=0.5)
    finally:  # leave the process's logging as it was
        logger.handlers[:], logger.level, logger.propagate = saved
    record = jsonio.strict_loads(buf.getvalue().splitlines()[-1])
    assert record["beta"] is None and record["eps"] is None and record["acc"] == 0.5


def test_a_round_row_is_asdicts_dict_with_its_mappings_copied() -> None:
    """RoundReport.to_dict reads the fields one by one instead of dataclasses.asdict's recursion: the same keys in
    the same order and the same values (a subclass's field too), and no mapping of the report is handed out."""
    from fedserver.round_timing import TimedReport

    r = RoundReport(round=3, accepted=7, beta=math.nan, metrics={"w_div": 1.5, "n": 2}, clusters={"0": 4})
    t = TimedReport(**{f.name: getattr(r, f.name) for f in dataclasses.fields(RoundReport)},
                    timing_seconds={"round": 0.5})
    for report in (r, t):
        row, by_asdict = report.to_dict(), dataclasses.asdict(report)
        by_asdict["metrics"] = {"w_div": 1.5, "n": 2.0}
        assert list(row) == list(by_asdict)
        assert json.dumps(row, sort_keys=True) == json.dumps(by_asdict, sort_keys=True)  # NaN == NaN as text
        assert isinstance(row["metrics"]["n"], float)
        for name in ("metrics", "clusters"):
            assert row[name] is not getattr(report, name)
    row = t.to_dict()
    row["timing_seconds"]["round"] = 9.0
    assert t.timing_seconds["round"] == 0.5
