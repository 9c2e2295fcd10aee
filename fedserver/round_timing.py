"""Where a round's time goes: monotonic timestamps at the phase boundaries of a round's critical path, reduced to
one typed :class:`RoundTiming` per completed round (issue 30, item 1).

The critical path runs through the *last accepted* update of the round (the one the round waited for):

===============  ==========================================================================================
``selection``    the round machine waits for ready clients and selects K (from the previous round's row, the
                 server's start, or an abandoned attempt, to ``round.started``)
``hand_out``     ``round.started`` -> that client's long-poll answered with its task (the wake-up, the
                 dispatch, the model packed once per round)
``turnaround``   task answered -> the client's upload header arrives: the model chunks written out, the
                 client's receive, training, pack and upload call, the network
``upload``       upload header -> the update accepted (stream receive, reassembly, validation, folding)
``aggregation``  the round's close begins -> the aggregate is ready
``snapshot``     the persistence of the completed round (state store)
``report``       the round report, the report stages (DistFL, NFL, DP) and the subscribers before the
                 ``rounds.jsonl`` row (the history, the ``round.completed`` line)
===============  ==========================================================================================

``round`` is the whole span (``selection`` start -> the row), ``server_cpu`` the server process's CPU seconds (all
threads, user + system) over it. Beside the critical path, how the round's accepted updates spread over it:
``first_update`` and ``median_update``, seconds from ``round.started`` to the first and the median acceptance (the
last one is ``hand_out + turnaround + upload``); 0 when none was accepted. They replace counting the per-update
``update.accepted`` log lines, which are debug-level (one line per client-round is a tenth of the server's CPU at
scale). A round that closes at its deadline waits between the last upload and the
aggregation; that wait is in ``round`` only, so the phases sum to at most ``round``. A boundary that was never
stamped (no update accepted, a test that drives the coordinator's parts directly) takes the one before it: its
phase reads 0.

Cheap by construction: a few ``time.monotonic()`` calls and two dict entries per client-round; nothing here
changes what the federation computes. The stamps are taken by the long-polls (:mod:`fedserver.polls`), the
upload gate (:mod:`fedserver.uploads`), the round closer (:mod:`fedserver.round_close`) and the coordinator. The
records are the ``timing_seconds`` object of the ``rounds.jsonl`` rows (docs/outputs.md); the last :data:`KEEP`
stay in memory (:attr:`RoundTimer.recent`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fedcore.report import RoundReport

PHASES = ("selection", "hand_out", "turnaround", "upload", "aggregation", "snapshot", "report")
# Completed rounds' records kept in memory.
KEEP = 1000
# Decimals of the seconds in a rounds.jsonl row (microseconds).
DECIMALS = 6


@dataclass(frozen=True)
class RoundTiming:
    """One completed round's critical path, in seconds (module docstring)."""

    round: int
    attempt: int
    selected: int
    selection_seconds: float
    hand_out_seconds: float
    turnaround_seconds: float
    upload_seconds: float
    aggregation_seconds: float
    snapshot_seconds: float
    report_seconds: float
    round_seconds: float
    server_cpu_seconds: float
    first_update_seconds: float = 0.0
    median_update_seconds: float = 0.0

    @classmethod
    def from_boundaries(cls, round_: int, attempt: int, selected: int, stamps: Sequence[float | None],
                        cpu_seconds: float, accepted_at: Sequence[float] = ()) -> RoundTiming:
        """The record of the ten boundary stamps: selection began, round started, task handed out, upload call,
        update accepted, close began, aggregated, report completed, snapshot saved, row written. A missing (None)
        or earlier-than-the-previous stamp takes the previous boundary, so every phase is >= 0 and they sum to
        at most the round. ``accepted_at``: the stamps of the round's acceptances in order (the first and the
        median update)."""
        if len(stamps) != 10 or stamps[0] is None:
            raise ValueError("ten boundary stamps, the first one set")
        b: list[float] = [stamps[0]]
        for s in stamps[1:]:
            b.append(b[-1] if s is None else max(b[-1], s))
        return cls(round=round_, attempt=attempt, selected=selected,
                   selection_seconds=b[1] - b[0], hand_out_seconds=b[2] - b[1], turnaround_seconds=b[3] - b[2],
                   upload_seconds=b[4] - b[3], aggregation_seconds=b[6] - b[5], snapshot_seconds=b[8] - b[7],
                   report_seconds=(b[7] - b[6]) + (b[9] - b[8]), round_seconds=b[9] - b[0],
                   server_cpu_seconds=max(0.0, cpu_seconds),
                   first_update_seconds=max(0.0, accepted_at[0] - b[1]) if accepted_at else 0.0,
                   median_update_seconds=(max(0.0, statistics.median(accepted_at) - b[1]) if accepted_at
                                          else 0.0))

    def phases(self) -> dict[str, float]:
        """Phase name (:data:`PHASES`) -> seconds."""
        return {p: float(getattr(self, f"{p}_seconds")) for p in PHASES}

    def row(self) -> dict[str, float]:
        """The ``timing_seconds`` object of the round's ``rounds.jsonl`` row."""
        out = {p: round(v, DECIMALS) for p, v in self.phases().items()}
        out["round"] = round(self.round_seconds, DECIMALS)
        out["server_cpu"] = round(self.server_cpu_seconds, DECIMALS)
        out["first_update"] = round(self.first_update_seconds, DECIMALS)
        out["median_update"] = round(self.median_update_seconds, DECIMALS)
        return out


@dataclass(frozen=True)
class TimedReport(RoundReport):
    """A round's report with its timing, as the ``rounds.jsonl`` row is written (the ``timing_seconds`` object
    after the report's fields). Only the row writer sees it: the state store and GetStatus keep the plain
    :class:`RoundReport`."""

    timing_seconds: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, report: RoundReport, timing: RoundTiming) -> TimedReport:
        values = {f.name: getattr(report, f.name) for f in dataclasses.fields(RoundReport)}
        return cls(**values, timing_seconds=timing.row())


@dataclass
class _Open:
    """The boundary stamps of the round in progress."""

    round: int
    attempt: int
    selected: int
    selection_began: float
    cpu_began: float
    started: float
    handed_out: dict[str, float] = field(default_factory=dict)
    upload_began: dict[str, float] = field(default_factory=dict)
    critical: tuple[str, float, float] | None = None  # (client, upload began, accepted) of the last accepted update
    accepted_at: list[float] = field(default_factory=list)  # every acceptance, in order
    close_began: float | None = None
    aggregated: float | None = None
    reported: float | None = None
    snapshotted: float | None = None


class RoundTimer:
    """Collects the stamps on the event loop (every method is called there) and closes each round's record when its
    row is written. ``clock`` and ``cpu`` are injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.process_time) -> None:
        self.now = clock
        self._cpu = cpu
        self._sampling_since = clock()
        self._cpu_since = cpu()
        self._open: _Open | None = None
        self.recent: deque[RoundTiming] = deque(maxlen=KEEP)

    def sampling(self) -> None:
        """Selection begins (the server starts serving, an attempt was abandoned or failed, a round completed)."""
        self._sampling_since, self._cpu_since = self.now(), self._cpu()

    def started(self, round_: int, attempt: int, selected: int) -> None:
        self._open = _Open(round_, attempt, selected, self._sampling_since, self._cpu_since, self.now())

    def _current(self, round_: int) -> _Open | None:
        o = self._open
        return o if o is not None and o.round == round_ else None

    def handed_out(self, client_id: str, round_: int) -> None:
        """``client_id``'s long-poll was answered with its task of ``round_`` (a later call, e.g. once the model
        chunks are written out, moves the stamp)."""
        o = self._current(round_)
        if o is not None:
            o.handed_out[client_id] = self.now()

    def upload_began(self, client_id: str, round_: int, began: float) -> None:
        """``client_id``'s upload of ``round_`` arrived at ``began`` (:attr:`now`; its header was admitted)."""
        o = self._current(round_)
        if o is not None:
            o.upload_began[client_id] = began

    def accepted(self, client_id: str, round_: int) -> None:
        """``client_id``'s update of ``round_`` was accepted: the latest one is the round's critical path."""
        o = self._current(round_)
        if o is not None:
            now = self.now()
            o.critical = (client_id, o.upload_began.get(client_id, now), now)
            o.accepted_at.append(now)

    def close_began(self, round_: int) -> None:
        o = self._current(round_)
        if o is not None:
            o.close_began = self.now()

    def aggregated(self, round_: int) -> None:
        o = self._current(round_)
        if o is not None:
            o.aggregated = self.now()

    def reported(self, round_: int) -> None:
        o = self._current(round_)
        if o is not None:
            o.reported = self.now()

    def snapshotted(self, round_: int) -> None:
        o = self._current(round_)
        if o is not None:
            o.snapshotted = self.now()

    def finish(self, round_: int) -> RoundTiming | None:
        """Close ``round_``'s record (its row is being written) and start timing the next selection; None when
        the round was not timed here (e.g. completed before a restart)."""
        o = self._current(round_)
        if o is None:
            return None
        written, cpu = self.now(), self._cpu()
        client, call, accepted = o.critical if o.critical is not None else ("", None, None)
        timing = RoundTiming.from_boundaries(
            o.round, o.attempt, o.selected,
            [o.selection_began, o.started, o.handed_out.get(client), call, accepted, o.close_began, o.aggregated,
             o.reported, o.snapshotted, written],
            cpu - o.cpu_began, o.accepted_at)
        self.recent.append(timing)
        self._open = None
        self._sampling_since, self._cpu_since = written, cpu
        return timing

    def timed(self, report: RoundReport) -> RoundReport:
        """``report`` as its ``rounds.jsonl`` row is written: with its timing when the round was timed here."""
        timing = self.finish(report.round)
        return report if timing is None else TimedReport.of(report, timing)
