from __future__ import annotations

import argparse
import math
import random
from typing import Any

import pytest
import torch

from fedclient.client import Backoff
from fedcore.aggregation import AggregationConfig, make_aggregator
from fedcore.config import TrainingConfig
from fedcore.data import DataError, load_client_data
from fedcore.models import ModelError, build_model, load_weights, model_fingerprint
from fedcore.train import evaluate, mode_free, shuffled_batches, train_local


def test_weighted_fedavg_equals_hand_computation() -> None:
    glob = torch.tensor([1.0, 1.0, 1.0])
    w1, w2, w3 = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.0, 4.0, 1.0]), torch.tensor([1.0, 1.0, 7.0])
    agg = make_aggregator(AggregationConfig(), num_params=3, k=3)
    for w, n in ((w1, 10), (w2, 30), (w3, 60)):
        agg.add(w - glob, n)
    out = agg.finalize(glob).new_global
    # sum n_i w_i / sum n_i = (10*w1 + 30*w2 + 60*w3) / 100
    expected = torch.tensor([(20 + 0 + 60) / 100, (0 + 120 + 60) / 100, (10 + 30 + 420) / 100])
    torch.testing.assert_close(out, expected)


def test_plain_mean_fedavg() -> None:
    agg = make_aggregator(AggregationConfig(weighted=False), num_params=2, k=2)
    agg.add(torch.tensor([1.0, 0.0]), 1)
    agg.add(torch.tensor([3.0, 2.0]), 99)
    torch.testing.assert_close(agg.finalize(torch.zeros(2)).new_global, torch.tensor([2.0, 1.0]))


def test_backoff_grows_exponentially_with_full_jitter_and_caps() -> None:
    b = Backoff(0.1, 1.0, random.Random(0))
    caps = [min(1.0, 0.1 * 2**i) for i in range(8)]
    delays = [b.next_delay() for _ in range(8)]
    assert all(0 <= d <= c for d, c in zip(delays, caps, strict=True))
    assert max(delays[5:]) > 0.2  # it does grow
    b.reset()
    assert b.next_delay() <= 0.1


def test_synthetic_shards_are_deterministic_and_differ_by_client() -> None:
    a = load_client_data("synthetic", 3, seed=1)
    b = load_client_data("synthetic", 3, seed=1)
    c = load_client_data("synthetic", 4, seed=1)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train[:5], c.x_train[:5])
    assert a.x_train.shape[1] == 60 and int(a.y_train.max()) < 10
    n = len(a.y_train) + len(a.y_test)
    assert abs(len(a.y_test) - 0.1 * n) <= 1


def test_unknown_dataset_model_and_bad_options_are_clear() -> None:
    with pytest.raises(DataError, match="unknown dataset 'nope'"):
        load_client_data("nope", 0, 0)
    with pytest.raises(DataError, match="rejected its options"):
        load_client_data("synthetic", 0, 0, {"colour": "blue"})
    with pytest.raises(DataError, match="alpha and beta"):
        load_client_data("synthetic", 0, 0, {"alpha": -1})
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        build_model("nope")
    with pytest.raises(ModelError, match="cannot import"):
        build_model("no_such_module_xyz:make")
    with pytest.raises(ModelError, match="rejected its arguments"):
        build_model("mlp", {"wings": 2})


def test_custom_factory_by_import_path() -> None:
    m = build_model("torch.nn:Linear", {"in_features": 3, "out_features": 2})
    assert isinstance(m, torch.nn.Linear)


def test_seeded_models_are_identical_and_fingerprint_tracks_shapes() -> None:
    a, b = build_model("mlp", seed=3), build_model("mlp", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a) != model_fingerprint(build_model("mlp", {"hidden": [32]}))


def test_local_training_lowers_loss() -> None:
    torch.manual_seed(0)
    data = load_client_data("synthetic", 0, seed=0, options={"min_samples": 200})
    model = build_model("mlp", seed=0)
    before = evaluate(model, data.x_train, data.y_train)
    res = train_local(model, data.x_train, data.y_train, TrainingConfig(local_epochs=3, learning_rate=0.05))
    after = evaluate(model, data.x_train, data.y_train)
    n = len(data.y_train)
    assert res.steps == 3 * (-(-n // 10) - (1 if n > 10 and n % 10 == 1 else 0))
    assert after.loss < before.loss


def test_fedprox_term_keeps_weights_closer_to_the_start() -> None:
    data = load_client_data("synthetic", 0, seed=0, options={"min_samples": 200})
    start = build_model("mlp", seed=0)

    def drift(mu: float) -> float:
        m = build_model("mlp", seed=0)
        train_local(m, data.x_train, data.y_train, TrainingConfig(local_epochs=2, learning_rate=0.1, prox_mu=mu))
        pairs = zip(m.parameters(), start.parameters(), strict=True)
        return sum(float((p.detach() - q.detach()).norm() ** 2) for p, q in pairs)

    assert drift(5.0) < drift(0.0)


def test_registry_refuses_duplicates_and_names_the_known_entries() -> None:
    from fedcore.registry import Registry

    reg: Registry[int] = Registry("widget", LookupError)
    reg.register("b")(2)
    reg.add("a", 1)
    assert reg.get("a") == 1 and reg.names() == ["a", "b"] and "a" in reg
    with pytest.raises(ValueError, match="already registered"):
        reg.add("a", 3)
    reg.add("a", 3, replace=True)
    assert reg.get("a") == 3
    with pytest.raises(LookupError, match="unknown widget 'c'; known: a, b"):
        reg.get("c")


def test_device_resolution_is_clear_when_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedclient import ClientConfig, FedClient, FedClientError
    from fedcore.train import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no usable CUDA GPU"):
        resolve_device("cuda:0")
    # The client refuses before it contacts any server.
    client = FedClient(ClientConfig(server="127.0.0.1:9", device="cuda"))
    with pytest.raises(FedClientError, match="no usable CUDA GPU"):
        client.run()
    assert client.summary.reconnects == 0


def test_launcher_waits_for_the_fleet_unless_the_experiment_says_otherwise() -> None:
    import argparse

    from fedlaunch.plan import configures_min_available

    assert not configures_min_available(argparse.Namespace(server_set=[], server_part={"rounds": {"num_rounds": 3}}))
    assert configures_min_available(argparse.Namespace(server_set=[], server_part={"rounds": {"min_available": 5}}))
    assert configures_min_available(argparse.Namespace(server_set=["rounds.min_available = 2"], server_part={}))



def test_launcher_attack_table_layers_file_options_flags() -> None:
    from fedlaunch.plan import attack_table

    base = {"gamma_tol": 0.001, "dev_type": "std"}
    table = attack_table(base, ["dev_type=unit", "gamma_init = 5.0"], "dyn_opt", "full")
    # the flat keys (file or --attack-set) go into the kind's options
    assert table == {"options": {"gamma_tol": 0.001, "dev_type": "unit", "gamma_init": 5.0}, "kind": "dyn_opt",
                     "knowledge": "full"}
    assert base["dev_type"] == "std"  # the experiment file's table is not changed
    assert attack_table({"options": {"gamma_tol": 0.001}}, ["options.dev_type=unit"], "dyn_opt", None) == \
        {"options": {"gamma_tol": 0.001, "dev_type": "unit"}, "kind": "dyn_opt"}
    # a table shared by an experiment's arms: options of other kinds are left out, as they meant nothing before
    assert attack_table({"options": {"gamma_tol": 0.001}}, [], "stat_opt", "full") == \
        {"kind": "stat_opt", "knowledge": "full"}
    assert attack_table({"gamma_tol": 0.001}, [], None, None) == {}
    assert attack_table({"kind": "stat_opt"}, [], None, None) == {"kind": "stat_opt"}
    with pytest.raises(ValueError, match="--attack-set: expected an attack option"):
        attack_table({}, ["a.b=1"], None, None)
    with pytest.raises(ValueError, match="--attack-set: expected KEY=VALUE"):
        attack_table({}, ["dev_type"], None, None)
    with pytest.raises(ValueError, match=r"attack\.foo: unknown field"):
        attack_table({}, ["foo=1"], "dyn_opt", None)
    with pytest.raises(ValueError, match="dev_type: one of std, sign, unit"):
        attack_table({}, ["dev_type=diagonal"], "dyn_opt", None)

def _launch_args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"clients": 10, "seed": 0, "straggler": "fixed", "straggler_delay": 0.0,
                               "straggler_sigma": 1.0, "stragglers": 1.0, "dropout": 0.0, "dropout_return": 30.0,
                               "crash": 0.0, "crash_rejoin": 5.0, "availability": None}
    return argparse.Namespace(**{**base, **kw})


def test_launcher_simulation_plan_applies_fractions_and_traces(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from fedlaunch.plan import client_id, simulation_plan

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({client_id(3): [[0, 60]], "*": [[5, 1000]]}))
    plan = simulation_plan(_launch_args(straggler="lognormal", straggler_delay=2.0, stragglers=0.3, dropout=0.3,
                                        dropout_return=-1.0, availability=str(trace)))
    stragglers = [cid for cid, sim in plan.items() if sim.get("straggler_delay_s")]
    assert len(stragglers) == 3 and all(plan[c]["straggler"] == "lognormal" for c in stragglers)
    assert stragglers == [cid for cid, sim in simulation_plan(_launch_args(
        straggler_delay=2.0, stragglers=0.3)).items() if sim.get("straggler_delay_s")]  # seeded by --seed
    assert all(sim["dropout"] == 0.3 and sim["dropout_return_s"] == -1.0 for sim in plan.values())
    assert plan[client_id(3)]["availability"] == [[0.0, 60.0]]
    assert plan[client_id(4)]["availability"] == [[5.0, 1000.0]]
    with pytest.raises(ValueError, match=r"simulation\.dropout: must be a probability"):
        simulation_plan(_launch_args(dropout=2.0))
    with pytest.raises(ValueError, match="--stragglers must be a fraction"):
        simulation_plan(_launch_args(stragglers=1.5))


@pytest.mark.parametrize(("n", "sizes"), [(21, [10, 11]), (20, [10, 10]), (1, [1]), (11, [11]), (25, [10, 10, 5])])
def test_a_last_batch_of_one_sample_is_folded_into_the_one_before(n: int, sizes: list[int]) -> None:
    x, y = torch.arange(n, dtype=torch.float32).reshape(n, 1), torch.zeros(n, dtype=torch.long)
    batches = list(shuffled_batches(x, y, 10, seed=3)(0))
    assert [len(b) for _, b in batches] == sizes
    assert sorted(torch.cat([b for b, _ in batches]).reshape(-1).tolist()) == list(range(n))  # each sample once


def test_a_batchnorm_model_trains_on_a_shard_of_one_modulo_the_batch_size() -> None:
    x, y = torch.randn(21, 20, generator=torch.Generator().manual_seed(0)), torch.arange(21) % 4
    model = build_model("mlp_bn", {"in_features": 20, "num_classes": 4, "hidden": [8]}, seed=0)
    res = train_local(model, x, y, TrainingConfig(local_epochs=2, batch_size=10, learning_rate=0.05))
    assert res.steps == 4 and math.isfinite(res.loss)


def test_a_host_spec_writes_certificates_only_inside_its_own_directory() -> None:
    from fedlaunch.hosts import HostSpec, host_clients

    for rel in ("../escape.pem", "/etc/evil.pem"):
        with pytest.raises(ValueError, match="not a path inside the host's own directory"):
            host_clients(HostSpec("127.0.0.1:1", 0, 1, tls_files={rel: "x"}))


def test_evaluate_of_one_batch_is_the_loops_result_and_restores_the_mode() -> None:
    # A test split of at most one batch skips the running sums: the same float32 loss widened once and the same
    # count, so the result must equal the loop's bit for bit (the NFL report of every round depends on it).
    data = load_client_data("synthetic", 1, seed=0, options={"min_samples": 200})
    model = build_model("mlp", seed=3)
    x, y = data.x_test, data.y_test
    n = len(y)
    assert 1 < n <= 512
    correct = torch.zeros((), dtype=torch.long)
    total = torch.zeros((), dtype=torch.float64)
    model.eval()
    with torch.no_grad():  # the loop's arithmetic on the one batch, as evaluate ran it before the fast path
        logits = model(x)
        total += torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(dim=1) == y).sum()
    model.train()
    got = evaluate(model, x, y)
    assert (got.accuracy, got.loss, got.num_samples) == (int(correct) / n, float(total) / n, n)
    looped = evaluate(model, x, y, batch_size=n - 1)  # two batches: the loop itself
    # float32 sums of n positive terms in another grouping: each within n * 2^-24 of the exact sum (relative)
    assert looped.accuracy == got.accuracy and math.isclose(looped.loss, got.loss, rel_tol=2 * n * 2.0**-24)
    assert model.training

    class Broken(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("broken forward")

    broken = Broken()
    with pytest.raises(RuntimeError, match="broken forward"):
        evaluate(broken, x, y)
    assert broken.training  # put back even when the forward fails


def test_a_model_of_mode_free_layers_is_evaluated_without_switching_its_mode() -> None:
    data = load_client_data("synthetic", 1, seed=0, options={"min_samples": 200})
    x, y = data.x_test, data.y_test
    switched: list[bool] = []

    class Watched(torch.nn.Sequential):  # a subclass: its mode could matter, so evaluate switches it
        def train(self, mode: bool = True) -> Watched:
            switched.append(mode)
            return super().train(mode)

    plain = build_model("mlp", seed=3)
    plain_train = plain.train

    def counted(mode: bool = True) -> torch.nn.Module:
        switched.append(mode)
        return plain_train(mode)

    plain.train = counted  # type: ignore[method-assign]
    watched = Watched(*build_model("mlp", seed=3).children())
    assert mode_free(plain) and not mode_free(watched)
    got = evaluate(plain, x, y)
    assert switched == [] and plain.training  # not switched
    assert evaluate(watched, x, y) == got  # the same numbers either way
    assert switched == [False, True] and watched.training
    # A layer whose forward depends on the mode, or a hook that could read it, keeps the switch.
    assert not mode_free(torch.nn.Sequential(torch.nn.Linear(60, 8), torch.nn.Dropout(0.5)))
    assert not mode_free(torch.nn.Sequential(torch.nn.Linear(60, 8), torch.nn.BatchNorm1d(8)))
    hooked = build_model("mlp", seed=3)
    hooked.get_submodule("1").register_forward_hook(lambda m, i, o: None)
    assert not mode_free(hooked)
    dropout = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(60, 10), torch.nn.Dropout(0.9))
    first = evaluate(dropout, x, y)
    assert evaluate(dropout, x, y) == first and dropout.training  # eval mode: no dropout, the same result twice


def _loaded(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_load_weights_is_load_state_dict_and_leaves_unusual_models_to_it() -> None:
    source = build_model("mlp", seed=5)
    fast, slow = build_model("mlp", seed=3), build_model("mlp", seed=3)
    calls: list[int] = []
    original = fast.load_state_dict

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    fast.load_state_dict = counted  # type: ignore[method-assign]
    load_weights(fast, source.state_dict())
    slow.load_state_dict(source.state_dict())
    assert calls == []  # the direct copy
    assert all(torch.equal(a, b) for a, b in zip(_loaded(fast).values(), _loaded(slow).values(), strict=True))
    assert all(p.requires_grad for p in fast.parameters())
    # Wrong names or shapes: load_state_dict's own errors.
    with pytest.raises(RuntimeError, match="Missing key"):
        load_weights(fast, {k: v for k, v in source.state_dict().items() if k != "1.bias"})
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_weights(fast, {**source.state_dict(), "1.bias": torch.zeros(3)})
    # A load hook, or a module that loads its own way (batch norm's buffers), goes through load_state_dict.
    seen: list[str] = []
    hooked = build_model("mlp", seed=3)
    hooked.get_submodule("1").register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
        lambda m, keys: seen.append("post"))
    load_weights(hooked, source.state_dict())
    assert seen == ["post"] and torch.equal(hooked.state_dict()["1.weight"], source.state_dict()["1.weight"])
    norm = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    other(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))  # running stats and the count move
    load_weights(norm, other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_loaded(norm).values(), _loaded(other).values(), strict=True))
