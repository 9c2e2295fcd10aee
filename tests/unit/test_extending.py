"""docs/extending.md's worked example runs: the new trainer file plus its registration line give a trainer the
configuration validates and a client trains with (and smoothing 0 is the vanilla trainer bit for bit)."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fedcore.config import ConfigError, ServerConfig, TrainingConfig, validate_server_config
from fedcore.seeds import RoundSeeds
from fedcore.train.trainers import TRAINERS, make_trainer

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
MODULE = "fedcore.train.label_smoothing"


def example(marker: str) -> str:
    """The python block that follows ``<!-- example: marker -->`` in docs/extending.md."""
    m = re.search(rf"<!-- example: {re.escape(marker)} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert m is not None, f"docs/extending.md has no example {marker!r}"
    return m.group(1)


@pytest.fixture
def label_smoothing() -> Iterator[None]:
    """The doc's declaration run where the doc puts it, then its new file loaded as the module it names, as the
    first use of the declared name imports it."""
    import types

    import fedcore.train.registry as registry_module

    exec(compile(example("registration line"), "<docs/extending.md: registration>", "exec"),
         dict(vars(registry_module)))
    assert "label_smoothing" in TRAINERS.names() and TRAINERS.declared_in("label_smoothing") == MODULE
    module = types.ModuleType(MODULE)
    module.__file__ = f"<docs/extending.md: {MODULE}>"
    sys.modules[MODULE] = module
    try:
        exec(compile(example("new trainer file"), module.__file__, "exec"), module.__dict__)
        yield
    finally:
        sys.modules.pop(MODULE, None)
        if "label_smoothing" in TRAINERS:
            TRAINERS.remove("label_smoothing")


def _round(name: str, options: dict[str, float]) -> tuple[float, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    trainer = make_trainer(name, options)
    result, _ = trainer.train(model, trainer.init(model), x, y, TrainingConfig(batch_size=8), RoundSeeds(1, 2, 3),
                              recovery=False)
    return result.loss, {k: v.clone() for k, v in model.state_dict().items()}


def test_the_worked_example_registers_validates_and_trains(label_smoothing: None) -> None:
    assert TRAINERS.summaries()["label_smoothing"] == "local SGD on label-smoothed cross-entropy"
    assert TRAINERS.plugin("label_smoothing").options_type() is sys.modules[MODULE].LabelSmoothingOptions
    cfg = ServerConfig()
    cfg.recovery.method, cfg.recovery.options = "label_smoothing", {"smoothing": 2.0}
    with pytest.raises(ConfigError, match=r"^recovery\.options\.smoothing: must be in \[0, 1\), got 2\.0$"):
        validate_server_config(cfg)
    loss, smoothed = _round("label_smoothing", {"smoothing": 0.2})
    assert loss > 0
    _, plain = _round("label_smoothing", {"smoothing": 0.0})
    _, vanilla = _round("vanilla", {})
    assert all(torch.equal(plain[k], vanilla[k]) for k in vanilla)
    assert not all(torch.equal(smoothed[k], vanilla[k]) for k in vanilla)


def test_the_example_is_gone_after_the_test() -> None:
    assert "label_smoothing" not in TRAINERS and MODULE not in sys.modules
