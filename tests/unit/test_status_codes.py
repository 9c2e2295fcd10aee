"""Status codes travel as protobuf enums (fedguard.wire's StatusCode tables), readable from older servers' strings.

Every value the server can put in a status (the round machine's phases and outcomes, why a round closed, the NFL
detector's state and mode) has an enum value; a known value travels without its name; an older server's reply
(the name in the string field, no enum) and a value newer than the enum both read back as the name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from fedcore import nfl, rounds
from fedcore.nfl.config import NflConfig
from fedcore.nfl.detectors import NflState
from fedcore.report import FederationStatus, NflStatus, RoundReport
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from fedserver.dp_monitor import OUTCOME as DP_BUDGET
from fedserver.nfl_monitor import nfl_state_name

ROOT = Path(__file__).resolve().parents[2]


def _round_close_reasons() -> set[str]:
    """The reasons the round machine closes a round with (``_close(s, now, "quorum", ...)``)."""
    return set(re.findall(r'_close\(s, now, "(\w+)"', (ROOT / "fedcore" / "rounds.py").read_text()))


def _federation_outcomes() -> set[str]:
    """The outcomes the round machine and the DP monitor end a federation with."""
    source = (ROOT / "fedcore" / "rounds.py").read_text()
    return {*re.findall(r'finish or "(\w+)"', source), *re.findall(r'FINISHED, "(\w+)"', source), DP_BUDGET}


def _nfl_state_names() -> set[str]:
    states = [NflState(mode=mode) for mode in nfl.MODES] + [NflState(mode=nfl.DETECT_AND_RECOVER, reported=True)]
    return {nfl_state_name(s) for s in states}


@pytest.mark.parametrize(("code", "domain"), [
    (wire.PHASES, lambda: {rounds.SAMPLING, rounds.TRAINING, rounds.AGGREGATING, rounds.FINISHED}),
    (wire.FEDERATION_OUTCOMES, _federation_outcomes),
    (wire.ROUND_OUTCOMES, _round_close_reasons),
    (wire.NFL_STATES, _nfl_state_names),
    (wire.NFL_MODES, lambda: set(nfl.MODES)),
])
def test_every_value_the_server_sets_has_an_enum_value(code: wire.StatusCode, domain: object) -> None:
    values = domain()  # type: ignore[operator]
    assert len(values) >= 3, values  # the source patterns above still find the values
    assert set(code.numbers) == values
    assert 0 not in code.names and len(code.names) == len(code.numbers)  # 0 is UNSPECIFIED, numbers distinct


def test_the_tables_use_the_enums_of_their_fields() -> None:
    fields: dict[tuple[Any, str], wire.StatusCode] = {
              (pb.StatusReply, "phase"): wire.PHASES, (pb.StatusReply, "outcome"): wire.FEDERATION_OUTCOMES,
              (pb.RoundSummary, "outcome"): wire.ROUND_OUTCOMES, (pb.RoundSummary, "nfl"): wire.NFL_STATES,
              (pb.NflStatus, "mode"): wire.NFL_MODES, (pb.NflStatus, "state"): wire.NFL_STATES}
    for (message, name), code in fields.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        assert field.enum_type is not None, f"{message.DESCRIPTOR.name}.{name} is not an enum"
        assert set(code.numbers.values()) == {v.number for v in field.enum_type.values} - {0}
        assert message.DESCRIPTOR.fields_by_name[f"{name}_name"].type == field.TYPE_STRING


def _status(**changes: object) -> FederationStatus:
    base: dict[str, object] = dict(
        federation_id="f", round=3, num_rounds=9, phase="training", outcome="", clients_known=2, clients_alive=2,
        selected=2, accepted=1, rejected=0, rejected_total=0, finished=False,
        history=(RoundReport(round=1, outcome="quorum", nfl="watching", nfl_count=1),
                 RoundReport(round=2, outcome="deadline", nfl="reported", recovery=True)),
        nfl=NflStatus(mode="detect-and-recover", detector="beta_hat_plateau", state="reported", recovery=True))
    base.update(changes)
    return FederationStatus(**base)  # type: ignore[arg-type]


def test_known_values_travel_as_enums_without_their_names() -> None:
    p = wire.status_to_pb(_status(phase="finished", outcome="dp_budget", finished=True))
    assert (p.phase, p.outcome) == (pb.FEDERATION_PHASE_FINISHED, pb.FEDERATION_OUTCOME_DP_BUDGET)
    assert (p.nfl.mode, p.nfl.state) == (pb.NFL_MODE_DETECT_AND_RECOVER, pb.NFL_STATE_REPORTED)
    assert [(r.outcome, r.nfl) for r in p.history] == [(pb.ROUND_OUTCOME_QUORUM, pb.NFL_STATE_WATCHING),
                                                      (pb.ROUND_OUTCOME_DEADLINE, pb.NFL_STATE_REPORTED)]
    names = [p.phase_name, p.outcome_name, p.nfl.mode_name, p.nfl.state_name,
             *(n for r in p.history for n in (r.outcome_name, r.nfl_name))]
    assert names == [""] * len(names)
    # repr: the reports' NaN fields compare unequal to themselves
    assert repr(wire.status_from_pb(p)) == repr(_status(phase="finished", outcome="dp_budget", finished=True))


def test_a_running_federation_has_no_outcome_on_the_wire() -> None:
    p = wire.status_to_pb(_status())
    assert p.outcome == pb.FEDERATION_OUTCOME_UNSPECIFIED and p.outcome_name == ""
    assert wire.status_from_pb(p).outcome == ""


def test_an_older_servers_string_codes_read_back() -> None:
    """A reply written before the enums: the names in the string fields (same field numbers), no enum set."""
    old = pb.StatusReply(federation_id="f", round=3, num_rounds=9, phase_name="training", outcome_name="stalled",
                         history=[pb.RoundSummary(round=1, outcome_name="all_responded", nfl_name="always")],
                         nfl=pb.NflStatus(mode_name="always-recover", detector="beta_hat", state_name="always"))
    s = wire.status_from_pb(pb.StatusReply.FromString(old.SerializeToString()))
    assert (s.phase, s.outcome, s.nfl.mode, s.nfl.state) == ("training", "stalled", "always-recover", "always")
    assert (s.history[0].outcome, s.history[0].nfl) == ("all_responded", "always")


def test_a_value_newer_than_the_enum_travels_by_name() -> None:
    s = _status(phase="draining", history=(RoundReport(round=1, outcome="operator_closed", nfl="paused"),),
                nfl=NflStatus(mode="shadow", state="paused"))
    p = wire.status_to_pb(s)
    assert (p.phase, p.phase_name) == (pb.FEDERATION_PHASE_UNSPECIFIED, "draining")
    assert (p.history[0].outcome, p.history[0].outcome_name) == (pb.ROUND_OUTCOME_UNSPECIFIED, "operator_closed")
    assert repr(wire.status_from_pb(p)) == repr(s)


def test_the_detector_state_names_of_a_default_config_are_coded() -> None:
    """The state a fresh server reports first (its [nfl] defaults) has an enum value."""
    mode = NflConfig().mode
    assert mode in wire.NFL_MODES.numbers and nfl_state_name(NflState(mode=mode)) in wire.NFL_STATES.numbers
