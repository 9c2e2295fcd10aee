"""The rule, NFL detector and attack slots hold ``name + options``: each plugin's frozen options dataclass, parsed and
validated through the registry (errors name the field), with the old flat keys still read into it, and a run dir
written with the old flat shape still resuming."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from fedcore.aggregation import AggregationConfig, KrumOptions, MultiKrumOptions, TrimmedMeanOptions
from fedcore.attacks import AttackConfig, AttackError, DynOptOptions, LabelFlipOptions, ModelReplacementOptions
from fedcore.config import ConfigError, ServerConfig, build_config, current_shape, from_dict, redacted, to_dict
from fedcore.migrate import LEGACY_ATTACK_OPTIONS, LEGACY_DETECTOR_OPTIONS, LEGACY_RULE_OPTIONS
from fedcore.models import build_model
from fedcore.nfl import CusumOptions, NflConfig, WarmupOptions
from fedserver.global_models import GlobalModels
from fedserver.persistence import Persistence, check_identity

# Every old flat key with a value of its own, beside the rule / detector / kind that declares it.
LEGACY_CASES: list[tuple[type, str, dict[str, Any], Any]] = [
    (AggregationConfig, "aggregation", {"rule": "trimmed_mean", "trim_m": 2}, TrimmedMeanOptions(trim_m=2)),
    (AggregationConfig, "aggregation", {"rule": "trimmed_mean", "trim_fraction": 0.2},
     TrimmedMeanOptions(trim_fraction=0.2)),
    (AggregationConfig, "aggregation", {"rule": "krum", "krum_f": 3}, KrumOptions(krum_f=3)),
    (AggregationConfig, "aggregation", {"rule": "multi_krum", "krum_f": 2, "multi_krum_m": 4},
     MultiKrumOptions(krum_f=2, multi_krum_m=4)),
    (NflConfig, "nfl", {"detector": "beta_hat_warmup", "warmup": 3}, WarmupOptions(warmup=3)),
    (NflConfig, "nfl", {"detector": "beta_hat_cusum", "cusum_k": 0.1, "cusum_h": 1.5},
     CusumOptions(cusum_k=0.1, cusum_h=1.5)),
    (AttackConfig, "attack", {"kind": "label_flip", "flip": "swap", "pairs": [[0, 4], [1, 5]]},
     LabelFlipOptions(flip="swap", pairs=((0, 4), (1, 5)))),
    (AttackConfig, "attack", {"kind": "model_replacement", "boost": 4.0, "flip": "all", "target": 2},
     ModelReplacementOptions(flip="all", target=2, boost=4.0)),
    (AttackConfig, "attack", {"kind": "dyn_opt", "knowledge": "full", "dev_type": "unit", "gamma_tol": 1e-3},
     DynOptOptions(dev_type="unit", gamma_tol=1e-3)),
]


def _options_key(cls: type) -> str:
    return "detector_options" if cls is NflConfig else "options"


def _new_shape(cls: type, table: dict[str, Any]) -> dict[str, Any]:
    flat = {**LEGACY_RULE_OPTIONS, **LEGACY_DETECTOR_OPTIONS, **LEGACY_ATTACK_OPTIONS}
    return {**{k: v for k, v in table.items() if k not in flat},
            _options_key(cls): {k: v for k, v in table.items() if k in flat}}


@pytest.mark.parametrize(("cls", "path", "table", "options"), LEGACY_CASES)
def test_the_old_flat_keys_read_into_the_plugins_options(cls: type, path: str, table: dict[str, Any],
                                                         options: Any) -> None:
    old = from_dict(cls, table, path)
    new = from_dict(cls, _new_shape(cls, table), path)
    assert old == new and getattr(new, _options_key(cls)) == options
    assert type(getattr(new, _options_key(cls))) is type(options)  # the typed dataclass, not a dict
    assert from_dict(cls, to_dict(new), path) == new  # the saved form loads back


def test_a_toml_file_and_set_overrides_in_either_shape_give_the_same_server_config(tmp_path: Path) -> None:
    old = tmp_path / "old.toml"
    old.write_text('[security]\ninsecure = true\n[aggregation]\nrule = "trimmed_mean"\ntrim_m = 2\n'
                   '[nfl]\ndetector = "beta_hat_cusum"\n'
                   'cusum_h = 1.5\n[simulation_harness.attack]\nkind = "stat_opt"\nknowledge = "full"\nstat_b = 3.0\n')
    new = tmp_path / "new.toml"
    new.write_text('[security]\ninsecure = true\n[aggregation]\nrule = "trimmed_mean"\noptions = { trim_m = 2 }\n'
                   '[nfl]\ndetector = "beta_hat_cusum"\n'
                   'detector_options = { cusum_h = 1.5 }\n[simulation_harness.attack]\nkind = "stat_opt"\n'
                   'knowledge = "full"\noptions = { stat_b = 3.0 }\n')
    a, b = build_config(ServerConfig, old), build_config(ServerConfig, new)
    assert a == b and a.aggregation.options == TrimmedMeanOptions(trim_m=2)
    assert a.nfl.detector_options == CusumOptions(cusum_h=1.5)
    # --set aggregation.trim_m=1 (tools/dev/golden_seams.py, fedguard-launch --server-set) and the new key agree
    insecure: list[tuple[list[str], Any]] = [(["security", "insecure"], True),
                                             (["aggregation", "rule"], "trimmed_mean")]
    flat = build_config(ServerConfig, None, [*insecure, (["aggregation", "trim_m"], 1)])
    table = build_config(ServerConfig, None, [*insecure, (["aggregation", "options", "trim_m"], 1)])
    assert flat == table and flat.aggregation.options == TrimmedMeanOptions(trim_m=1)


def test_the_migrated_example_configs_mean_what_their_flat_form_meant() -> None:
    root = Path(__file__).resolve().parents[2]
    for name in ("hydra_mnist_ntd.toml", "hydra_mnist_moon.toml"):
        cfg = build_config(ServerConfig, None, [(["security", "insecure"], True),
                                                (["aggregation"], {"rule": "trimmed_mean", "trim_m": 2})])
        text = (root / "configs" / name).read_text()
        assert "options = { trim_m = 2 }" in text
        assert cfg.aggregation.options == TrimmedMeanOptions(trim_m=2)


@pytest.mark.parametrize(("cls", "table", "match"), [
    (AggregationConfig, {"rule": "trimmed_mean", "options": {"trim_m": -1}}, r"^aggregation\.options\.trim_m: must"),
    (AggregationConfig, {"rule": "trimmed_mean", "trim_m": -1}, r"^aggregation\.options\.trim_m: must"),
    (AggregationConfig, {"rule": "trimmed_mean", "options": {"trim_m": "two"}},
     r"^aggregation\.options\.trim_m: expected"),
    (AggregationConfig, {"rule": "trimmed_mean", "options": {"krum_f": 2}},
     r"^aggregation\.options\.krum_f: aggregation rule 'trimmed_mean' has no option 'krum_f'; its options: trim_m, "
     r"trim_fraction$"),
    (AggregationConfig, {"rule": "trimmed_mean", "krum_f": 2},
     r"^aggregation\.options\.krum_f: aggregation rule 'trimmed_mean' has no option 'krum_f' \(given as the old "
     r"flat key aggregation\.krum_f\); its options: trim_m, trim_fraction$"),
    (AggregationConfig, {"rule": "median", "options": {"trim_m": 1}}, r"^aggregation\.options: aggregation rule "
                                                                       r"'median' takes no options"),
    (AggregationConfig, {"rule": "krum", "krum_f": 2, "options": {"krum_f": 3}},
     r"^aggregation\.options\.krum_f: given twice"),
    (NflConfig, {"detector": "beta_hat_warmup", "detector_options": {"warmup": -1}},
     r"^nfl\.detector_options\.warmup: must be an integer >= 0"),
    (NflConfig, {"detector": "beta_hat_cusum", "warmup": 3}, r"^nfl\.detector_options\.warmup: NFL detector "
                                                              r"'beta_hat_cusum' has no option 'warmup'"),
    (AttackConfig, {"kind": "label_flip", "options": {"boost": 2.0}},
     r"^attack\.options\.boost: attack 'label_flip' has no option 'boost'; its options: flip, pairs, target$"),
    (AttackConfig, {"kind": "backdoor", "poison_per_batch": 10}, r"attack\.options\.poison_per_batch: must be in"),
])
def test_errors_name_the_field(cls: type, table: dict[str, Any], match: str) -> None:
    path = "nfl" if cls is NflConfig else "aggregation" if cls is AggregationConfig else "attack"
    with pytest.raises(ValueError, match=match):
        cfg = from_dict(cls, table, path)
        if cls is NflConfig:
            cfg.validate()


def test_an_old_flat_key_holding_its_old_default_means_nothing_for_another_plugin() -> None:
    # what the old code wrote out for every section (to_dict): every flat key, most at their defaults
    old = {"rule": "trimmed_mean", "trim_m": 1, "trim_fraction": None, "krum_f": 1, "multi_krum_m": None,
           "knorm_k": 1, "weighted": True}
    assert from_dict(AggregationConfig, old, "aggregation").options == TrimmedMeanOptions(trim_m=1)


def test_python_constructors_take_the_dataclass_or_a_table_and_refuse_another_plugins_options() -> None:
    assert AggregationConfig(rule="krum", options={"krum_f": 2}) == AggregationConfig(rule="krum",
                                                                                     options=KrumOptions(krum_f=2))
    assert AggregationConfig(rule="krum").options == KrumOptions() and AggregationConfig().options is None
    with pytest.raises(ConfigError, match="takes KrumOptions, got TrimmedMeanOptions"):
        AggregationConfig(rule="krum", options=TrimmedMeanOptions())
    with pytest.raises(AttackError, match=r"^attack\.options\.boost: must be a finite number > 0"):
        AttackConfig(kind="model_replacement", options=ModelReplacementOptions(boost=math.inf))
    with pytest.raises(ValueError, match=r"^options\.trim_fraction: must be in \[0, 0\.5\)"):
        AggregationConfig(rule="trimmed_mean", options={"trim_fraction": 0.5}).validate(10)


def _old_shape(d: dict[str, Any]) -> dict[str, Any]:
    """A redacted config dict as the code before plugin options wrote it: every option flat, at its default
    unless set."""
    old = json.loads(json.dumps(d))
    for node, key, flat in ((old, "aggregation", LEGACY_RULE_OPTIONS), (old, "nfl", LEGACY_DETECTOR_OPTIONS),
                            (old["simulation_harness"], "attack", LEGACY_ATTACK_OPTIONS)):
        section = node[key]
        options = section.pop("detector_options" if key == "nfl" else "options") or {}
        section.update({k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()})
        section.update(options)
    return old


def test_a_run_dir_written_with_the_old_flat_config_resumes(tmp_path: Path) -> None:
    overrides: list[tuple[list[str], Any]] = [
        (["server", "run_dir"], str(tmp_path / "run")), (["security", "insecure"], True),
        (["aggregation", "rule"], "trimmed_mean"), (["aggregation", "trim_m"], 1),
        (["nfl", "detector"], "beta_hat_warmup"), (["nfl", "warmup"], 3)]
    cfg = build_config(ServerConfig, None, overrides)
    models = GlobalModels.of(build_model("mlp", seed=0))
    p = Persistence(cfg, models)
    assert p.restore(now=0.0) is None
    assert p.store is not None
    old = _old_shape(redacted(cfg))
    assert old["aggregation"]["trim_m"] == 1 and "options" not in old["aggregation"]
    p.store.put_meta("config", old)  # as the old code stored it
    (tmp_path / "run" / "config.json").write_text(json.dumps(old))
    p.close()
    assert current_shape(old) == json.loads(json.dumps(redacted(cfg)))
    p2 = Persistence(cfg, GlobalModels.of(build_model("mlp", seed=0)))
    assert p2.restore(now=1.0) is not None
    p2.close()
    # a changed option is still a changed federation, named by its new key
    changed = build_config(ServerConfig, None, [*overrides, (["aggregation", "trim_m"], 2)])
    with pytest.raises(ConfigError, match=r"^aggregation\.options: was"):
        check_identity(current_shape(old), json.loads(json.dumps(redacted(changed))))
