"""The round's pipeline (fedserver.pipeline): the stages composed in one place, in order, their state registered
with the snapshot; a model stage sees views of the previous and proposed models and returns new tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from fedcore.config import ConfigError
from fedcore.report import RoundReport
from fedcore.server_opt import make
from fedserver.coordinator import Coordinator
from fedserver.global_models import GlobalModels
from fedserver.pipeline import DEFAULT_STAGES, Pipeline
from fedserver.server_optimizer import ServerOptimizerShell
from fedserver.stage import STAGES, ModelStep, ServerParts, Stage, register_stage
from fedserver.store import StoreError
from tests.integration.helpers import server_config


def _names(tmp_path: Path, **sections: dict[str, Any]) -> list[str]:
    return Coordinator(server_config(tmp_path, **sections)).pipeline.names


def test_the_default_pipeline_is_the_built_in_stages_in_order(tmp_path: Path) -> None:
    assert DEFAULT_STAGES == ("server_optimizer", "adaptive_clip", "distfl", "nfl", "dp", "history", "round_line",
                              "rounds_file")
    # no server optimizer, no DistFL: those two are not in the pipeline at all (plain FedAvg as before)
    assert _names(tmp_path) == ["nfl", "dp", "history", "round_line", "rounds_file"]
    assert _names(tmp_path / "o", server_optimizer={"name": "fedadam"}) == [
        "server_optimizer", "nfl", "dp", "history", "round_line", "rounds_file"]


def test_a_stage_state_is_registered_with_the_snapshot_under_its_name(tmp_path: Path) -> None:
    c = Coordinator(server_config(tmp_path, server_optimizer={"name": "fedavgm"}))
    assert sorted(c.persistence._slots) == ["dp", "nfl", "server_optimizer"]
    assert sorted(c.persistence._tensor_slots) == ["server_optimizer"]


def test_a_registered_stage_is_appended_with_its_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(STAGES, "_entries", dict(STAGES._entries))  # restored after the test

    @dataclass(frozen=True)
    class Every:
        every: int = 1

        def validate(self) -> None:
            if self.every < 1:
                raise ConfigError("every", f"must be >= 1, got {self.every}")

    seen: list[Any] = []

    def make(parts: ServerParts, options: Every) -> Stage:
        seen.append(options)
        return Stage("counter", report=lambda r: r)

    register_stage("counter", make, options=Every)
    names = _names(tmp_path, pipeline={"stages": [{"name": "counter", "options": {"every": 3}}]})
    assert names[-1] == "counter" and seen == [Every(3)]
    with pytest.raises(ConfigError, match=r"^pipeline\.stages\[0\]\.options\.every: must be >= 1, got 0$"):
        _names(tmp_path / "b", pipeline={"stages": [{"name": "counter", "options": {"every": 0}}]})
    with pytest.raises(ConfigError, match=r"^pipeline\.stages\[1\]\.name: a stage named 'counter' is already"):
        _names(tmp_path / "c", pipeline={"stages": [{"name": "counter"}, {"name": "counter"}]})
    with pytest.raises(ConfigError, match=r"^pipeline\.stages\[0\]\.name: cannot import the stage factory"):
        _names(tmp_path / "d", pipeline={"stages": [{"name": "no_such_module_here:make"}]})


def test_model_stages_run_in_order_on_views_and_report_metrics() -> None:
    models = GlobalModels({"w": torch.tensor([[1.0, 2.0]]), "b": torch.tensor([3.0]),
                           "n": torch.tensor(7, dtype=torch.int64)})
    order: list[str] = []

    def add(name: str, amount: float) -> Stage:
        def hook(step: ModelStep) -> ModelStep:
            order.append(name)
            assert step.previous["w"].shape == (1, 2) and "n" not in step.previous  # floats only, by name
            proposed = {k: v + amount for k, v in step.proposed.items()}
            return ModelStep(step.round, step.previous, proposed, {f"{name}_amount": amount})
        return Stage(name, model=hook)

    pipeline = Pipeline([add("a", 1.0), add("b", 10.0), Stage("r", report=lambda r: r)], models)
    assert pipeline.shapes_model
    proposed = torch.tensor([5.0, 6.0, 7.0])
    shaped, metrics = pipeline.shape_model(4, proposed)
    assert order == ["a", "b"] and torch.equal(shaped, torch.tensor([16.0, 17.0, 18.0]))
    assert metrics == {"a_amount": 1.0, "b_amount": 10.0}
    assert torch.equal(proposed, torch.tensor([5.0, 6.0, 7.0]))  # the proposed vector is left as it was
    assert not Pipeline([Stage("r", report=lambda r: r)], models).shapes_model


def test_report_stages_then_published_hooks_in_order() -> None:
    got: list[str] = []
    stages = [Stage("a", report=lambda r: RoundReport(round=r.round + 1),
                    published=lambda r: got.append(f"a{r.round}")),
              Stage("b", report=lambda r: RoundReport(round=r.round * 10),
                    published=lambda r: got.append(f"b{r.round}"))]
    pipeline = Pipeline(stages, GlobalModels({}))
    pipeline.subscribe(lambda r: got.append(f"app{r.round}"))
    report = pipeline.complete(RoundReport(round=1))
    pipeline.publish(report)
    assert report.round == 20 and got == ["a20", "b20", "app20"]


def test_the_server_optimizer_never_restarts_its_moments_silently() -> None:
    models = GlobalModels({"w": torch.tensor([1.0, 2.0])})
    shell = ServerOptimizerShell(make("fedadam"), models)
    step = ModelStep(1, models.unflatten(models.flat()), {"w": torch.tensor([2.0, 2.0])})
    out = shell(step)
    saved, tensors = shell.save(), shell.save_tensors()
    assert saved == {"optimizer": "fedadam", "step": 1} and sorted(tensors) == ["m/w", "v/w"]
    again = ServerOptimizerShell(make("fedadam"), models)
    again.load(saved)
    again.load_tensors(tensors)
    assert torch.equal(again(step).proposed["w"], shell(step).proposed["w"])  # the same state, the same step
    lost = ServerOptimizerShell(make("fedadam"), models)
    lost.load(saved)  # the JSON part names step 1, the snapshot holds no tensors
    with pytest.raises(StoreError, match="at step 1 but holds no optimizer tensors; nothing was changed"):
        lost.load_tensors({})
    fresh = ServerOptimizerShell(make("fedadam"), models)
    fresh.load({"optimizer": "fedadam", "step": 0})
    fresh.load_tensors({})  # round 0's snapshot: no moments yet, nothing to refuse
    assert fresh.state is None
    with pytest.raises(ValueError, match="the snapshot's state is for 'fedyogi'"):
        lost.load({"optimizer": "fedyogi", "step": 1})
    assert out.metrics == {"server_opt_step": 1.0}
