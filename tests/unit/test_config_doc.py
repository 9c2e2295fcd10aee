"""docs/configuration.md is generated from the configuration dataclasses (fedcore.config_doc) and must be current."""

from __future__ import annotations

from pathlib import Path

from fedcore import config_doc
from fedcore.aggregation import AggregationConfig, TrimmedMeanOptions

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_committed_reference_is_current() -> None:
    text, _ = config_doc.generate()
    assert DOC.read_text() == text, (
        "docs/configuration.md is stale: run `python -m fedcore.config_doc > docs/configuration.md` and commit it")


def test_every_field_is_described() -> None:
    _, missing = config_doc.generate()
    assert not missing, f"configuration fields without a comment above them: {missing}"


def test_comments_types_and_defaults() -> None:
    comments = config_doc.field_comments(AggregationConfig)
    assert comments["clip_norm"].startswith("Server-side DP (LINDT Eq. 4): clip every update")
    # one comment above a group of fields that names them all is shared
    assert comments["sketch_seed"] == comments["sketch_dim"]
    assert config_doc.field_comments(TrimmedMeanOptions)["trim_fraction"] == \
        config_doc.field_comments(TrimmedMeanOptions)["trim_m"]
    text, _ = config_doc.generate()
    assert "| `aggregation.clip_norm` | float or unset | unset |" in text
    assert "| `dp.on_budget` | string | `\"warn\"` |" in text
    assert "| `rounds.num_rounds` | integer | `10` |" in text
    # a plugin's options: one table per section, and each plugin's options with their defaults under "Plugins"
    assert "| `aggregation.options` | table or unset | unset |" in text
    assert "| `nfl.detector_options` | table or unset | unset |" in text
    assert "| `trimmed_mean` | the coordinate-wise mean without the trim_m (or trim_fraction) largest and smallest " \
           "values | `trim_m` = unset, `trim_fraction` = unset |" in text
    assert "`cusum_k` = 0.05, `cusum_h` = 2.0 |" in text and "`dev_type` = \"std\"" in text
    assert "### [dp]" in text and "### `simulation`" in text
