"""Where a server's (or a client's) CPU goes, per function, measured in place: run ``fedserver`` (``fedclient``) with
each function of :data:`FUNCTIONS` (:data:`CLIENT_FUNCTIONS`) wrapped to add up the CPU time of the thread that runs
it (``time.thread_time_ns``) and its calls, and write the sums as JSON when the process exits.

A sampling profiler misreads an event loop (py-spy counts a thread parked in ``epoll_wait`` as busy unless told
``--idle``, and its native mode stops the process for each sample) and cProfile's own cost per call is as large as
the sub-10 µs steps it would time; a thread-CPU clock read around a few chosen functions costs ~0.5 µs per call and
counts what the function costs *in the running server* (cold caches, a busy machine: 3-5× what ``timeit`` says).
Nested functions are counted in each (inclusive times). The cyclic garbage collector's passes are summed too, by
generation (:func:`time_gc`). ``tools/bench/bench_rounds.py --cpu-breakdown`` runs the server this way and prints the
sums
per client-round::

    python -m tools.bench.cpu_breakdown OUT.json -- --address 127.0.0.1:50051 ...   # fedserver's own arguments after --
    python -m tools.bench.cpu_breakdown OUT.json --client -- --server 127.0.0.1:50051 ...   # a fedclient's

This is a measuring tool for benchmarks, never part of a deployment: it patches the named functions in the server
process it starts and nothing else.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib
import json
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (module, qualified name) of the functions timed: the update's path, the round machine, the hand-out, the log.
FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("fedserver.uploads", "UploadGate.begin"),
    ("fedserver.uploads", "UploadGate.submit"),
    ("fedserver.intake", "UpdateIntake.submit"),
    ("fedserver.global_models", "GlobalModels.flatten_update"),
    ("fedcore.aggregation.base", "StreamingFedAvg.add"),
    ("fedcore.aggregation.metrics", "CountSketch.__call__"),
    ("fedcore.aggregation.fixedpoint", "FixedPointSum.add"),
    ("fedcore.aggregation.steps", "Validate.check"),
    ("fedserver.bounds", "check_update_header"),
    ("fedguard.wire", "update_report_from_pb"),
    ("fedserver.membership", "Membership.touch"),
    ("fedserver.coordinator", "Coordinator.observe"),
    ("fedcore.rounds", "step_in_place"),
    ("fedserver.dispatch", "TaskDispatcher.task_for"),
    ("fedserver.persistence", "Persistence.snapshot"),
    ("fedserver.framed", "_Connection.data_received"),
    # once per round: the round's start, its close (the aggregate, the report, the snapshot, the row)
    ("fedserver.intake", "UpdateIntake.open_round"),
    ("fedcore.aggregation.base", "StreamingFedAvg.finalize"),
    ("fedserver.global_models", "GlobalModels.apply_flat"),
    ("fedserver.finalize", "build_report"),
    ("fedserver.round_close", "RoundCloser._complete_and_persist"),
    ("fedserver.store", "StateStore.save"),
    ("fedserver.pipeline", "write_round"),
    ("fedserver.coordinator", "log_event"),
    ("structlog.stdlib", "BoundLogger.info"),
    ("structlog.stdlib", "BoundLogger.debug"),
)
# A client's round: the task read (its reassembly and tensor views), the local round (the received model's evaluation
# on the test split, the NFL measurement; the state dicts; the mode switches), the state dict's load, the update's
# payload, report and frames, the embedding API's callbacks and the stream's replies.
CLIENT_FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("fedclient.runner", "RoundRunner._read_task"),
    ("fedclient.local_round", "LocalRound.run"),
    ("fedclient.local_round", "evaluate"),
    ("torch.nn.modules.module", "Module.load_state_dict"),
    ("fedclient.runner", "update_frames"),
    ("fedclient.runner", "RoundRunner._work"),
    ("fedclient.runner", "RoundRunner._push"),
    ("fedclient.runner", "payload_of"),
    ("fedguard.wire", "update_report_to_pb"),
    ("fedguard.wire", "metas_to_pb"),
    ("fedclient.runner", "RoundRunner._pull_request"),
    ("fedclient.embed", "EmbeddingApi._task_received"),
    ("fedclient.embed", "EmbeddingApi._trained"),
    ("fedclient.embed", "EmbeddingApi._reported"),
    ("fedclient.embed", "EmbeddingApi._publish"),
    ("fedcore.serialization", "Reassembler.__init__"),
    ("fedcore.serialization", "ReceivedTensors.__getitem__"),
    ("torch.nn.modules.module", "Module.state_dict"),
    ("torch.nn.modules.module", "Module.train"),
    ("fedclient.local_round", "round_seeds"),
    ("fedclient.local_round", "LocalRound._individual_step"),
    ("fedclient.local_round", "LocalRound.ensure_trainer"),
    ("fedclient.local_round", "LocalRound._trainer_state"),
    ("fedclient.stream", "SessionStream.reply"),
    ("fedclient.stream", "SessionStream.send"),
    ("fedclient.framed", "FramedSession.reply"),
    ("fedclient.framed", "FramedSession.send"),
)


def _timed(fn: Callable[..., Any], sums: list[int]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            sums[0] += time.thread_time_ns() - began
            sums[1] += 1

    return wrapper


def install(functions: tuple[tuple[str, str], ...] = FUNCTIONS) -> dict[str, list[int]]:
    """Wrap ``functions`` (imported now); returns ``{qualified name: [thread CPU ns, calls]}``, updated as they run.
    Callers that look the function up when they call it (a method, ``module.function``) are counted; a name
    imported with ``from module import function`` before this ran keeps the original."""
    sums: dict[str, list[int]] = {}
    for module_name, qualname in functions:
        owner: Any = importlib.import_module(module_name)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        sums[qualname] = [0, 0]
        setattr(owner, name, _timed(getattr(owner, name), sums[qualname]))
    return sums


def time_gc() -> dict[str, list[int]]:
    """Sum the thread CPU of the cyclic garbage collector's passes, by generation (``gc.callbacks``): the
    collector runs inside whichever function allocated last, so a profile spreads it over everything."""
    sums: dict[str, list[int]] = {f"gc generation {g}": [0, 0] for g in range(3)}
    began = [0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.thread_time_ns()
        else:
            row = sums[f"gc generation {info['generation']}"]
            row[0] += time.thread_time_ns() - began[0]
            row[1] += 1

    gc.callbacks.append(callback)
    return sums


def main(argv: list[str]) -> None:
    client = len(argv) > 1 and argv[1] == "--client"
    rest = argv[2 if client else 1:]
    if not argv or not rest or rest[0] != "--":
        raise SystemExit("usage: python -m tools.bench.cpu_breakdown OUT.json [--client] -- "
                         "FEDSERVER-OR-FEDCLIENT-ARGS...")
    out = Path(argv[0])
    module = "fedclient" if client else "fedserver"
    sums = install(CLIENT_FUNCTIONS if client else FUNCTIONS)
    sums.update(time_gc())
    main_thread_began = time.thread_time_ns()
    process_began = time.process_time_ns()

    def dump() -> None:
        out.write_text(json.dumps({
            "functions": {k: {"cpu_ns": v[0], "calls": v[1]} for k, v in sums.items()},
            "main_thread_cpu_ns": time.thread_time_ns() - main_thread_began,
            "process_cpu_ns": time.process_time_ns() - process_began,
        }, indent=1))

    atexit.register(dump)
    sys.argv = [module, *rest[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
