"""A Flower ServerApp running FedAvg over every connected SuperNode, timing each round on the server side.

Each round's ``start`` is taken when the strategy is asked to configure training (before the nodes are
sampled) and its ``end`` when the replies are aggregated: fedguard's ``round.started`` -> aggregated. No
federated evaluation (``fraction_evaluate = 0``), as fedguard's no-op round has none. One JSON line per round
goes to the run config's ``timing-file``, then ``{"finished": true, ...}``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fgbench.model import make_arrays, parse_shapes

app = ServerApp()


class TimedFedAvg(FedAvg):
    """FedAvg that appends each round's server-side start and end (``time.time()``) to ``timing_file``."""

    def __init__(self, timing_file: Path | None, k: int) -> None:
        super().__init__(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=k, min_evaluate_nodes=0,
                         min_available_nodes=k)
        self.timing_file = timing_file
        self.started: dict[int, float] = {}

    def _write(self, row: dict[str, object]) -> None:
        if self.timing_file is not None:
            with self.timing_file.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.started[server_round] = time.time()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        result = super().aggregate_train(server_round, replies)
        end = time.time()
        failures = sum(1 for r in replies if r.has_error())
        self._write({"round": server_round, "start": self.started[server_round], "end": end,
                     "replies": len(replies) - failures, "failures": failures})
        return result


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    shapes = parse_shapes(str(cfg["shapes"]))
    timing = str(cfg["timing-file"])
    strategy = TimedFedAvg(Path(timing) if timing else None, k=int(cfg["min-nodes"]))
    t0 = time.time()
    strategy.start(grid=grid, initial_arrays=ArrayRecord(make_arrays(shapes, int(cfg["seed"]))),
                   num_rounds=int(cfg["num-server-rounds"]))
    strategy._write({"finished": True, "seconds": time.time() - t0, "params": sum(math.prod(s) for s in shapes)})
