"""Units of the embedding API: the declined round, the client's NFL state, data sources, callbacks, logging."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from fedcore import rounds as rm
from fedcore.client_state import (
    ClientNflState,
    ClientRoundReport,
    infers_adapted,
    next_nfl_state,
)
from fedcore.config import ClientConfig, ConfigError, RoundsConfig
from fedcore.data import ClientData, DataError
from fedcore.data.source import DataSource
from fedcore.update_report import UpdateReport

# ---- the round machine: a selected client that declines ----

CFG = RoundsConfig(num_rounds=3, clients_per_round=3, min_available=3, min_updates=2, round_timeout_s=30.0)
LIMITS = rm.Limits(heartbeat_patience_s=60.0)


def _training_round() -> rm.RoundState:
    s = rm.RoundState()
    for cid in ("a", "b", "c"):
        s, _ = rm.step_in_place(s, rm.Joined(cid, 0.0), CFG, LIMITS)
        s, _ = rm.step_in_place(s, rm.Polled(cid, 0.0), CFG, LIMITS)
    assert s.phase == rm.TRAINING and s.selected == ["a", "b", "c"]
    return s


def test_a_declined_client_is_not_waited_for_and_not_counted_as_failed() -> None:
    s = _training_round()
    for cid in ("a", "b"):
        s, _ = rm.step_in_place(s, rm.UpdateAccepted(cid, 1, 1.0), CFG, LIMITS)
    assert s.phase == rm.TRAINING  # c is pending: the round waits for it (up to the 30 s deadline)
    s, events = rm.step_in_place(s, rm.Declined("c", 2.0), CFG, LIMITS)
    assert [type(e) for e in events] == [rm.RoundClosed] and events[0].reason == "all_responded"  # type: ignore
    assert s.declined == ["c"] and s.rejected == {} and s.rejected_total == 0
    assert s.clients["c"].alive and not s.clients["c"].ready and s.clients["c"].last_seen == 2.0
    assert rm.admission(s, "c", 1) is not None


def test_a_declined_client_is_not_selected_until_it_polls_again() -> None:
    s = _training_round()
    s, _ = rm.step_in_place(s, rm.Declined("c", 1.0), CFG, LIMITS)
    assert rm.admission(s, "c", 1) == "the client declined round 1"
    for cid in ("a", "b"):
        s, _ = rm.step_in_place(s, rm.UpdateAccepted(cid, 1, 1.0), CFG, LIMITS)
    s, _ = rm.step_in_place(s, rm.Aggregated(1, 2.0), CFG, LIMITS)
    assert s.phase == rm.SAMPLING and s.round == 2 and s.declined == []
    assert s.available_ids() == ["a", "b"]
    s, _ = rm.step_in_place(s, rm.Polled("c", 3.0), CFG, LIMITS)
    assert s.phase == rm.TRAINING and "c" in s.selected
    # The state round-trips, and a snapshot written before the field existed still loads.
    s2, _ = rm.step_in_place(s, rm.Declined("c", 4.0), CFG, LIMITS)
    assert rm.RoundState.from_dict(s2.to_dict()) == s2
    old = s2.to_dict()
    del old["declined"]
    assert rm.RoundState.from_dict(old).declined == []


def test_declining_while_not_selected_or_sampling_changes_only_readiness() -> None:
    s = rm.RoundState()
    s, _ = rm.step_in_place(s, rm.Joined("a", 0.0), CFG, LIMITS)
    s, _ = rm.step_in_place(s, rm.Polled("a", 0.0), CFG, LIMITS)
    s, events = rm.step_in_place(s, rm.Declined("a", 1.0), CFG, LIMITS)
    assert events == [] and s.declined == [] and not s.clients["a"].ready and s.phase == rm.SAMPLING
    s, events = rm.step_in_place(s, rm.Declined("nobody", 1.0), CFG, LIMITS)
    assert events == [] and "nobody" not in s.clients


# ---- which model a client infers with; its NFL state ----

@pytest.mark.parametrize(("has", "recovering", "opt_out", "after", "expected"), [
    (False, True, False, "adapted", False),   # no v_i yet
    (True, True, True, "adapted", False),     # a holdout always infers with the global model
    (True, True, False, "global", True),      # recovering: v_i
    (True, False, False, "adapted", True),    # recovery stopped, v_i kept (SPEC §6-7)
    (True, False, False, "global", False),    # recovery stopped, back to the global model
])
def test_infers_adapted(has: bool, recovering: bool, opt_out: bool, after: str, expected: bool) -> None:
    assert infers_adapted(has, recovering, opt_out, after) is expected


def test_infer_after_recovery_is_validated() -> None:
    with pytest.raises(ConfigError, match="infer_after_recovery"):
        ClientConfig(infer_after_recovery="personal").validate()


def test_the_nfl_state_records_since_when_the_client_recovers() -> None:
    s0 = ClientNflState()
    s1 = next_nfl_state(s0, 3, True, True, False, False, -0.25)
    assert (s1.recovering, s1.since_round, s1.server_recovery, s1.beta_hat, s1.round) == (True, 3, True, -0.25, 3)
    s2 = next_nfl_state(s1, 4, True, True, True, False, None)  # no beta_hat this round: the last one is kept
    assert s2.since_round == 3 and s2.beta_hat == -0.25 and s2.serving_adapted and not s1.same_mode(s2)
    assert next_nfl_state(s2, 5, True, True, True, False, 0.1).same_mode(s2)
    s3 = next_nfl_state(s2, 6, False, False, False, False, float("nan"))
    assert s3.since_round == 0 and not s3.recovering and s3.beta_hat == -0.25
    assert s0.server_recovery is None and s0.round == 0


def test_the_clients_round_report_holds_the_update_report_it_sent() -> None:
    sent = UpdateReport(num_samples=100, train_loss=0.5, beta_hat=1.0, test_accuracy=0.75, test_loss=0.5,
                        private_accuracy=0.875, adapting=True, train_seconds=0.25, extras={"lindt_global_ce": 0.5})
    r = ClientRoundReport(4, sent, beta_hat_measured=-0.125, accepted=False)
    assert (r.round, r.update.num_samples, r.update.test_accuracy, r.beta_hat_measured, r.update.beta_hat) == (
        4, 100, 0.75, -0.125, 1.0)
    assert r.update.adapting and not r.update.infers_adapted and not r.accepted
    # The client's per-round history row: the names an old client's metrics map used.
    assert r.history_row() == {"round": 4.0, "train_loss": 0.5, "test_accuracy": 0.75, "test_loss": 0.5,
                               "private_accuracy": 0.875, "adapting": 1.0, "infers_adapted": 0.0,
                               "train_seconds": 0.25, "passes": 1.0, "lindt_global_ce": 0.5,
                               "beta_hat_measured": -0.125}
    bare = ClientRoundReport(1, UpdateReport(num_samples=10, train_loss=0.25))
    assert bare.beta_hat_measured is None and bare.update.beta_hat is None and bare.accepted  # none measured
    assert "beta_hat_measured" not in bare.history_row() and "test_accuracy" not in bare.history_row()


# ---- data sources ----

def _tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(23, 4, generator=g), torch.randint(0, 3, (23,), generator=g),
            torch.randn(7, 4, generator=g), torch.randint(0, 3, (7,), generator=g))


class _Samples(IterableDataset[tuple[torch.Tensor, int]]):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Any:
        return ((self.x[i], int(self.y[i])) for i in range(len(self.y)))


def test_every_kind_of_source_reads_the_same_tensors() -> None:
    xt, yt, xs, ys = _tensors()
    reference = ClientData(xt, yt, xs, ys, 3)

    def loader(x: torch.Tensor, y: torch.Tensor) -> Any:
        return lambda: torch.utils.data.DataLoader(TensorDataset(x, y), batch_size=5, shuffle=False)

    sources = [DataSource((xt, yt), (xs, ys), 3), DataSource(TensorDataset(xt, yt), TensorDataset(xs, ys), 3),
               DataSource(loader(xt, yt), loader(xs, ys), 3), DataSource(_Samples(xt, yt), _Samples(xs, ys), 3)]
    for src in sources:
        got = src.load()
        for a, b in ((got.x_train, reference.x_train), (got.y_train, reference.y_train),
                     (got.x_test, reference.x_test), (got.y_test, reference.y_test)):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert got.num_classes == 3 and got.num_train == 23


class _Pairs(Dataset[Any]):
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


@pytest.mark.parametrize(("train", "message"), [
    ((torch.zeros(3, 2), torch.tensor([0, 1, 5])), r"data.train: labels must lie in \[0, 3\)"),
    ((torch.zeros(3, 2), torch.tensor([0.0, 1.0, 2.0])), "data.train: labels must be integer class indices"),
    ((torch.zeros(3, 2), torch.tensor([0, 1])), r"data.train: need x of shape \[N, ...\]"),
    (_Pairs([]), "data.train: the dataset is empty"),
    (_Pairs([torch.zeros(2)]), r"data.train: each sample must be an \(x, y\) pair"),
    (_Pairs([(torch.zeros(2), 0), (torch.zeros(3), 1)]), "data.train: samples of different shapes"),
    (lambda: [], "data.train: the batch factory yielded no batch"),
    (lambda: 1 / 0, "data.train: the batch factory failed: ZeroDivisionError"),
    ("train.csv", "data.train: expected .x, y. tensors, a Dataset or a batch factory, got str"),
])
def test_a_bad_source_is_refused_naming_the_field(train: Any, message: str) -> None:
    _, _, xs, ys = _tensors()
    with pytest.raises(DataError, match=message):
        DataSource(train, (xs[:, :2], ys), 3).load()


def test_train_and_test_samples_must_have_one_shape() -> None:
    xt, yt, xs, ys = _tensors()
    with pytest.raises(DataError, match=r"data.test: samples of shape \[2\], but data.train's are \[4\]"):
        DataSource((xt, yt), (xs[:, :2], ys), 3).load()
    with pytest.raises(DataError, match=r"data\.num_classes"):
        DataSource((xt, yt), (xs, ys), 0).load()


def test_fedclient_refuses_data_of_another_kind_and_a_predicate_that_is_not_callable() -> None:
    from fedclient import FedClient, FedClientError

    with pytest.raises(FedClientError, match="data: expected ClientData, a DataSource or None, got list"):
        FedClient(ClientConfig(insecure=True), data=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(FedClientError, match="can_train: expected a callable"):
        FedClient(ClientConfig(insecure=True), can_train=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_round_end: expected a callable"):
        FedClient(ClientConfig(insecure=True), on_round_end=3)  # type: ignore[arg-type]


# ---- callbacks and logging ----

class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_callback_that_raises_is_logged_and_the_next_one_still_runs() -> None:
    from fedclient.embed import Callbacks
    from fedcore.log import get_logger

    keep = _Keep()
    log = logging.getLogger("fedguard.client")
    log.addHandler(keep)
    try:
        calls: list[int] = []
        cb = Callbacks(get_logger("fedclient"), "c1")

        def bad(r: int) -> None:
            raise ValueError("app bug")

        cb.add("round_end", bad)
        cb.add("round_end", calls.append)
        cb.fire("round_end", 7)
        assert calls == [7]
        failed = [r for r in keep.records if r.fedguard["event"] == "callback.failed"]  # type: ignore[attr-defined]
        assert len(failed) == 1 and failed[0].levelno == logging.ERROR and failed[0].exc_info is not None
        assert failed[0].fedguard["error"] == "ValueError: app bug"  # type: ignore[attr-defined]
    finally:
        log.removeHandler(keep)


def test_the_library_logs_to_stdlib_loggers_and_configures_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from fedcore.log import get_logger, logger_name

    assert (logger_name("fedserver"), logger_name("fedclient"), logger_name("launch")) == (
        "fedguard.server", "fedguard.client", "fedguard.launch")
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("fedguard").handlers)
    keep = _Keep()
    lg = logging.getLogger("fedguard.client")
    lg.addHandler(keep)
    try:
        get_logger("fedclient", "warning").info("dropped.by_level", a=1)
        get_logger("fedclient", "warning").warning("kept", a=1, b="x y")
        [rec] = keep.records
        assert rec.getMessage() == "kept component=fedclient a=1 b=x y" and rec.levelno == logging.WARNING
        assert rec.fedguard == {"component": "fedclient", "a": 1, "b": "x y", "event": "kept",  # type: ignore
                                "level": "warning"}
    finally:
        lg.removeHandler(keep)
    assert capsys.readouterr().out == ""


def test_a_debug_or_info_line_the_stdlib_level_drops_runs_no_processor() -> None:
    """``debug``/``info`` below the stdlib logger's level return before the event dict is built (what
    ``filter_by_level`` would decide after it): nothing is processed; at or above the level the line is kept."""
    import structlog

    from fedcore.log import get_logger

    seen: list[str] = []

    def spy(logger: Any, name: str, event_dict: Any) -> Any:
        seen.append(str(event_dict["event"]))
        return event_dict

    lg = logging.getLogger("fedguard.server")
    keep = _Keep()
    lg.addHandler(keep)
    before = lg.level
    try:
        log = get_logger("fedserver")
        log = structlog.wrap_logger(log._logger, processors=[spy, *log._processors],
                                    wrapper_class=type(log), context_class=dict)
        lg.setLevel(logging.WARNING)
        assert log.debug("d", a=1) is None and log.info("i", a=1) is None
        assert seen == [] and keep.records == []
        log.warning("w")
        lg.setLevel(logging.DEBUG)
        log.bind(x=1).debug("d2")  # a bound logger keeps the class
        log.info("i2")
        assert seen == ["w", "d2", "i2"] and [r.levelno for r in keep.records] == [
            logging.WARNING, logging.DEBUG, logging.INFO]
    finally:
        lg.setLevel(before)
        lg.removeHandler(keep)
