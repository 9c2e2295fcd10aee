"""The ``[pipeline]`` configuration section: server stages added to the round's close (``fedserver.pipeline``).

Torch-free, like every section: the stages' registry lives with the server (``fedserver.stage.STAGES``), which
checks the names and options when it composes the pipeline, before it listens (errors name
``pipeline.stages[i].name`` / ``pipeline.stages[i].options.<field>``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedcore.errors import require


@dataclass
class StageEntry:
    # A registered server stage, or the import path of a stage factory ("mypkg.stages:make_stage"; docs/extending.md,
    # "Add a server algorithm").
    name: str = ""
    # The stage's options (a table), decoded into the stage's options dataclass and validated by it.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class PipelineConfig:
    # Stages run after the built-in ones (server_optimizer, adaptive_clip, distfl, nfl, dp, history, round_line,
    # rounds_file), in this order: e.g. [{name = "mypkg.stages:make_stage", options = {every = 5}}].
    stages: list[StageEntry] = field(default_factory=list)

    def validate(self, prefix: str = "pipeline") -> PipelineConfig:
        for i, entry in enumerate(self.stages):
            require(isinstance(entry.name, str) and bool(entry.name), f"{prefix}.stages[{i}].name",
                    f"must name a registered stage or an import path 'module:factory', got {entry.name!r}")
        return self
