"""One source for the current figures (issue 54): docs/figures.toml holds them, README.md, docs/features.md and
docs/benchmarks.md quote them inside ``<!-- fig:NAME -->TEXT<!-- /fig -->`` markers, and a page whose TEXT differs
from the file fails here, naming the page, the line and both texts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.dev import figures as fig

ROOT = Path(__file__).resolve().parents[2]
FIGURES = fig.load(ROOT / "docs" / "figures.toml")

# The README's benchmark table (issue 54, item 2): one figure per row.
README_FIGURES = {"round_overhead_k10", "fleet_1000_round", "connected_10000_join", "memory_virtual_client",
                  "snapshot_cpu_late", "flower_idle_latency_ratio"}


def test_every_figure_has_its_fields_and_an_existing_source() -> None:
    assert FIGURES, "docs/figures.toml is empty"
    assert fig.problems(FIGURES) == []


@pytest.mark.parametrize("page", fig.pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_figure_is_the_current_one(page: Path) -> None:
    assert fig.mismatches(page.read_text(), FIGURES, str(page.relative_to(ROOT))) == []


def test_the_three_pages_quote_the_figures() -> None:
    readme = fig.quoted((ROOT / "README.md").read_text())
    assert readme >= README_FIGURES, f"README.md does not quote {sorted(README_FIGURES - readme)}"
    features = fig.quoted((ROOT / "docs" / "features.md").read_text())
    assert {"round_overhead_k10", "fleet_1000_round", "flower_idle_latency_ratio"} <= features
    benchmarks = fig.quoted((ROOT / "docs" / "benchmarks.md").read_text())
    assert set(FIGURES) <= benchmarks, f"docs/benchmarks.md does not quote {sorted(set(FIGURES) - benchmarks)}"


def test_a_page_with_a_stale_figure_fails() -> None:
    """The check can fail: a stale value, an unknown name and an unclosed marker are each reported."""
    entry = FIGURES["round_overhead_k10"]
    good = f"K = 10: <!-- fig:round_overhead_k10 -->{fig.render(entry)}<!-- /fig -->."
    assert fig.mismatches(good, FIGURES) == []
    stale = "K = 10: <!-- fig:round_overhead_k10 -->0.012–0.016 s<!-- /fig -->."
    found = fig.mismatches(stale, FIGURES, "README.md")
    assert len(found) == 1 and "README.md:1" in found[0] and "0.012–0.016 s" in found[0]
    assert fig.mismatches("<!-- fig:no_such_figure -->1 s<!-- /fig -->", FIGURES)
    assert fig.mismatches("<!-- fig:round_overhead_k10 -->0.0046–0.0082 s", FIGURES)


def test_render_joins_value_and_unit() -> None:
    assert fig.render({"value": "707", "unit": "×"}) == "707×"
    assert fig.render({"value": "0.155", "unit": "MiB"}) == "0.155 MiB"
    assert fig.render({"value": "3", "unit": ""}) == "3"
    assert fig.span([0.0082, 0.0046, 0.0057]) == "0.0046–0.0082"
    assert fig.span([1.0, 1.0]) == "1"


def test_update_rewrites_one_entry_and_then_the_pages_disagree(tmp_path: Path) -> None:
    """What a tool's ``--figures PATH`` does: the entry's value and date change, nothing else; a page quoting the old
    value then fails the check."""
    path = tmp_path / "figures.toml"
    original = (ROOT / "docs" / "figures.toml").read_text()
    path.write_text(original)
    fig.update(path, "round_overhead_k10", "0.0050–0.0090", date="2030-01-02")
    after = fig.load(path)
    assert after["round_overhead_k10"]["value"] == "0.0050–0.0090"
    assert after["round_overhead_k10"]["date"] == "2030-01-02"
    assert {k: v for k, v in after.items() if k != "round_overhead_k10"} == \
        {k: v for k, v in FIGURES.items() if k != "round_overhead_k10"}
    assert len(path.read_text().splitlines()) == len(original.splitlines())
    readme = (ROOT / "README.md").read_text()
    assert any("fig:round_overhead_k10" in m for m in fig.mismatches(readme, after))
    with pytest.raises(KeyError):
        fig.update(path, "no_such_figure", "1")


def test_bench_targets_turns_its_samples_into_figures() -> None:
    """``tools/bench/bench_targets.py --figures``: the min–max over the samples, formatted as the pages write them."""
    from tools.bench import bench_targets as bt

    samples = [bt.Sample("k10", "03:29:00", {"round_s": 0.0051}), bt.Sample("k10", "03:32:00", {"round_s": 0.0077}),
               bt.Sample("fleet", "03:29:30", {"round_s": 0.046, "server_ms_per_cr": 0.219})]
    assert bt.figure_values(samples) == {"round_overhead_k10": "0.0051–0.0077", "fleet_1000_round": "0.046",
                                         "fleet_1000_server_cpu": "0.219"}
    assert set(bt.FIGURE_ENTRIES) <= set(FIGURES)
