"""The one record a client reports with its update (fedcore.update_report), its wire form and serde pair
(fedguard.wire), an old client's metrics map, and a guard that the server reads no client number by name."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest

from fedcore.update_report import UpdateReport, from_metrics_map
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {f.name for f in dataclasses.fields(UpdateReport)}

FULL = UpdateReport(num_samples=37, train_loss=0.1 + 0.2, beta_hat=-1 / 3, test_accuracy=0.7, test_loss=1e-17,
                    private_accuracy=0.0, adapting=True, infers_adapted=True, train_seconds=2.5, passes=2.0,
                    extras={"lindt_global_ce": 0.3, "attack_gamma": -7.25})


def _header(report: UpdateReport) -> pb.UpdateHeader:
    """The header as it travels: serialised and parsed again."""
    h = pb.UpdateHeader(session_id="s", round=3, report=wire.update_report_to_pb(report))
    return pb.UpdateHeader.FromString(h.SerializeToString())


# ---- the serde pair ----

@pytest.mark.parametrize("report", [FULL, UpdateReport(num_samples=1, train_loss=0.0),
                                    dataclasses.replace(FULL, beta_hat=0.0, test_accuracy=None, passes=1.0)])
def test_the_report_crosses_the_wire_bit_for_bit(report: UpdateReport) -> None:
    back = wire.update_report_from_pb(_header(report))
    assert back == report
    assert all(type(getattr(back, f)) is type(getattr(report, f)) for f in FIELDS if f != "extras")


def test_not_measured_stays_distinct_from_zero() -> None:
    bare = wire.update_report_from_pb(_header(UpdateReport(num_samples=1, train_loss=0.5)))
    assert bare.beta_hat is None and bare.test_accuracy is None and bare.private_accuracy is None
    zero = wire.update_report_from_pb(_header(UpdateReport(num_samples=1, train_loss=0.5, beta_hat=0.0)))
    assert zero.beta_hat == 0.0


def test_every_field_of_the_record_is_a_field_of_the_message_and_back() -> None:
    assert {f.name for f in pb.UpdateReport.DESCRIPTOR.fields} == FIELDS


# ---- an old client: num_samples, train_loss, beta_hat and the metrics map in the header ----

def test_an_old_clients_metrics_map_is_read_into_the_report() -> None:
    h = pb.UpdateHeader(session_id="s", round=2, num_samples=12, train_loss=0.25, beta_hat=-0.5, metrics={
        "test_accuracy": 0.75, "test_loss": 0.5, "private_accuracy": 0.875, "beta_hat_measured": -0.5,
        "adapting": 1.0, "infers_adapted": 0.0, "train_seconds": 0.125, "lambda_mean": 0.3})
    r = wire.update_report_from_pb(pb.UpdateHeader.FromString(h.SerializeToString()))
    assert r == UpdateReport(num_samples=12, train_loss=0.25, beta_hat=-0.5, test_accuracy=0.75, test_loss=0.5,
                             private_accuracy=0.875, adapting=True, infers_adapted=False, train_seconds=0.125,
                             passes=1.0, extras={"lambda_mean": 0.3})
    bare = wire.update_report_from_pb(pb.UpdateHeader(session_id="s", num_samples=3, train_loss=0.5))
    assert bare == UpdateReport(num_samples=3, train_loss=0.5)


def test_the_report_message_wins_over_the_old_fields() -> None:
    h = _header(FULL)
    h.num_samples, h.train_loss = 999, 9.0
    h.metrics["test_accuracy"] = 0.01
    assert wire.update_report_from_pb(h) == FULL


def test_the_metrics_view_reads_back_as_the_same_report() -> None:
    m = FULL.as_metrics()
    assert m["adapting"] == 1.0 and m["passes"] == 2.0 and m["attack_gamma"] == -7.25 and "beta_hat" not in m
    assert from_metrics_map(FULL.num_samples, FULL.train_loss, FULL.beta_hat, m) == FULL


# ---- bounds: the server never takes a client's numbers without them ----

@pytest.mark.parametrize(("change", "field"), [
    ({"num_samples": 0}, "num_samples"),
    ({"train_loss": math.nan}, "train_loss"),
    ({"train_loss": -math.inf}, "train_loss"),
    ({"beta_hat": math.nan}, "beta_hat"),
    ({"beta_hat": 1.5}, "beta_hat"),
    ({"test_accuracy": 1.01}, "test_accuracy"),
    ({"private_accuracy": math.nan}, "private_accuracy"),
    ({"test_loss": -0.1}, "test_loss"),
    ({"train_seconds": math.inf}, "train_seconds"),
    ({"passes": -1.0}, "passes"),
    ({"extras": {"x": math.nan}}, "extras['x']"),
    ({"extras": {"test_accuracy": 0.9}}, "extras['test_accuracy']"),
])
def test_an_implausible_number_is_refused_naming_its_field(change: dict[str, object], field: str) -> None:
    reason = dataclasses.replace(FULL, **change).bounds_error()  # type: ignore[arg-type]
    assert reason is not None and reason.startswith(field), reason


def test_plausible_reports_pass() -> None:
    assert FULL.bounds_error() is None
    assert UpdateReport(num_samples=1, train_loss=0.0, beta_hat=-1.0, test_accuracy=1.0).bounds_error() is None


# ---- the server reads no client number by name ----

# Numbers the server computes itself and reads by name (the aggregation pipeline's metrics, RoundReport.metrics):
# checked below to be written by fedcore.aggregation, so this list cannot hide a client's number.
SERVER_METRICS = frozenset({"delta", "num_updates", "clip_norm", "num_unclipped"})  # the aggregation's own figures
SERVER_FILES = (*sorted((ROOT / "fedserver").rglob("*.py")), ROOT / "fedcore" / "report.py",
                ROOT / "fedcore" / "client_state.py")


def string_keyed_metric_reads(source: str) -> list[tuple[int, str]]:
    """(line, key) of every read of a constant string key from a map whose expression names metrics or extras, or
    from a name assigned from one (``m = dict(metrics)``): ``X["k"]``, ``X.get("k", ...)`` and ``"k" in X`` (writes
    are not reads)."""
    tree = ast.parse(source)

    def names_a_map(node: ast.expr) -> bool:
        text = ast.unparse(node)
        return "metrics" in text or "extras" in text

    aliases = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and names_a_map(n.value)
               for t in n.targets if isinstance(t, ast.Name)}

    def metric_map(node: ast.expr) -> bool:
        return names_a_map(node) or (isinstance(node, ast.Name) and node.id in aliases)

    def key(node: ast.expr) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    reads: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.expr):
            continue
        k: str | None = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and metric_map(node.value):
            k = key(node.slice)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and metric_map(node.func.value)):
            k = key(node.args[0])
        elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In | ast.NotIn)
              and metric_map(node.comparators[0])):
            k = key(node.left)
        if k is not None:
            reads.append((node.lineno, k))
    return sorted(reads)


def test_the_scan_finds_string_keyed_reads() -> None:
    src = ("a = r.metrics['test_acc']\nb = report.extras.get('adapting', 0.0)\nc = 'passes' in r.metrics\n"
           "r.metrics['written'] = 1.0\nd = cfg['metrics']\nm = dict(h.metrics)\ne = m.get('train_seconds')\n")
    assert string_keyed_metric_reads(src) == [(1, "test_acc"), (2, "adapting"), (3, "passes"), (7, "train_seconds")]


def test_every_number_the_server_reads_from_a_client_is_a_field_of_update_report() -> None:
    aggregation = "".join(p.read_text() for p in (ROOT / "fedcore" / "aggregation").rglob("*.py"))
    assert all(f'"{k}"' in aggregation for k in SERVER_METRICS), "SERVER_METRICS must be aggregation metrics"
    found = []
    for path in SERVER_FILES:
        for line, k in string_keyed_metric_reads(path.read_text()):
            if k in SERVER_METRICS:
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            found.append(f"{where} reads {k!r} by name: " + (
                f"read it as the typed field UpdateReport.{k}" if k in FIELDS else
                "a number the server reads from a client must be a field of fedcore.update_report.UpdateReport"))
    assert not found, "\n".join(found)


def test_the_intake_refuses_an_implausible_report_naming_the_field_and_records_it() -> None:
    from fedcore import rounds as rm
    from fedcore.config import ServerConfig
    from fedcore.models import build_model, model_manifest
    from fedserver.errors import ProtocolError
    from fedserver.global_models import GlobalModels
    from fedserver.intake import UpdateIntake

    model = build_model("mlp")
    state = rm.RoundState(round=1, attempt=0, phase=rm.TRAINING, selected=["a", "b"])
    seen: list[rm.Observation] = []
    intake = UpdateIntake(ServerConfig(), GlobalModels.of(model), lambda: state, seen.append, lambda: 0.0,
                          lambda cid: "global")
    intake.open_round(1, 0, 2, 0.0)
    with pytest.raises(ProtocolError) as e:
        intake.begin("a", 1, dataclasses.replace(FULL, private_accuracy=1.5), False, model_manifest(model), 0)
    assert e.value.code == "INVALID_ARGUMENT" and e.value.message.startswith("private_accuracy must be in [0, 1]")
    assert isinstance(seen[0], rm.UpdateRejected) and seen[0].client_id == "a"
    ticket = intake.begin("b", 1, FULL, False, model_manifest(model), 0)
    assert ticket.report is FULL  # the record itself travels on, no copy into another type
