from __future__ import annotations

import pytest
import torch

from fedcore.attacks import (
    DISTFL_FLIP_PAIRS,
    AttackConfig,
    AttackError,
    BackdoorBatches,
    attacker_local_epochs,
    backdoor_batches,
    backdoor_set,
    flip_labels,
    label_mapping,
    poison_client_data,
    poisoned_batches,
    target_mapping,
)
from fedcore.data import ClientData


def _data(labels: list[int], num_classes: int = 10) -> ClientData:
    y = torch.tensor(labels)
    x = torch.arange(len(y)).float()[:, None]  # x is the sample id
    return ClientData(x, y, x[:2].clone(), y[:2].clone(), num_classes)


def test_reverse_flip() -> None:
    y = torch.arange(10)
    assert flip_labels(y, AttackConfig.reverse_flip(), 10).tolist() == [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]


def test_distfl_swap_pairs_and_single_source_target() -> None:
    y = torch.arange(10)
    cfg = AttackConfig.distfl_flip()
    assert cfg.flip_options.pairs == DISTFL_FLIP_PAIRS
    assert flip_labels(y, cfg, 10).tolist() == [4, 5, 6, 7, 0, 1, 2, 3, 8, 9]
    single = AttackConfig(kind="label_flip", options={"flip": "directed", "pairs": ((3, 5),)})
    assert flip_labels(y, single, 10).tolist() == [0, 1, 2, 5, 4, 5, 6, 7, 8, 9]
    assert target_mapping(single, 10) == {3: 5}
    everything = AttackConfig(kind="label_flip", options={"flip": "all", "target": 0})
    assert flip_labels(torch.tensor([5, 9, 0]), everything, 80).tolist() == [0, 0, 0]
    assert label_mapping(AttackConfig(), 4).tolist() == [0, 1, 2, 3]


def test_flip_poisons_training_labels_only_and_does_not_mutate() -> None:
    data = _data([0, 1, 2, 3])
    out = poison_client_data(data, AttackConfig.reverse_flip())
    assert out.y_train.tolist() == [9, 8, 7, 6] and data.y_train.tolist() == [0, 1, 2, 3]
    assert torch.equal(out.y_test, data.y_test) and torch.equal(out.x_train, data.x_train)
    assert poison_client_data(data, AttackConfig()) is data


def test_attack_config_validation() -> None:
    with pytest.raises(AttackError, match=r"attack\.kind"):
        AttackConfig(kind="meteor")
    with pytest.raises(AttackError, match=r"^attack\.options\.pairs: "):
        AttackConfig(kind="label_flip", options={"flip": "swap"})
    with pytest.raises(AttackError, match="disjoint"):
        AttackConfig(kind="label_flip", options={"flip": "swap", "pairs": ((0, 1), (1, 2))})
    with pytest.raises(AttackError, match="poison_per_batch"):
        AttackConfig(kind="backdoor", options={"poison_per_batch": 10, "batch_size": 10})
    with pytest.raises(AttackError, match="outside"):
        label_mapping(AttackConfig(kind="label_flip", options={"flip": "directed", "pairs": ((0, 12),)}), 10)


def test_attacker_local_epochs_override() -> None:
    assert attacker_local_epochs(AttackConfig.lindt_backdoor(), 1) == 5
    assert attacker_local_epochs(AttackConfig.reverse_flip(), 1) == 1
    assert attacker_local_epochs(AttackConfig(local_epochs_override=5), 1) == 1  # not an attacker


def test_lindt_backdoor_batches_hold_three_poisoned_of_ten() -> None:
    # 40 clean samples of classes 0-3 and 10 deer (4) / 10 dog (5) samples
    labels = [i % 4 for i in range(40)] + [4] * 10 + [5] * 10
    data = _data(labels)
    cfg = AttackConfig.lindt_backdoor()
    batches = backdoor_batches(data, cfg, seed=3)
    assert target_mapping(cfg, 10) == {4: 7, 5: 6}
    seen_clean: list[int] = []
    epoch = list(batches.epoch(0))
    assert len(epoch) == batches.batches_per_epoch() == 6  # ceil(40 / 7)
    for xb, yb in epoch:
        ids = xb[:, 0].long()
        poisoned = ids >= 40
        assert int(poisoned.sum()) == 3
        src = torch.tensor(labels)[ids[poisoned]]
        # deer -> horse, dog -> frog
        assert torch.equal(yb[poisoned], torch.where(src == 4, torch.tensor(7), torch.tensor(6)))
        assert torch.equal(yb[~poisoned], torch.tensor(labels)[ids[~poisoned]])  # clean: true labels
        seen_clean += ids[~poisoned].tolist()
    assert sorted(seen_clean) == list(range(40))  # one pass over the clean samples per epoch
    assert all(len(yb) == 10 for _, yb in epoch[:-1])
    again = list(backdoor_batches(data, cfg, seed=3).epoch(0))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(epoch, again, strict=True))
    other = list(batches.epoch(1))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(epoch, other, strict=False))


def test_backdoor_without_source_samples_needs_an_extra_set() -> None:
    data = _data([0, 1, 2, 3] * 5)
    with pytest.raises(AttackError, match="no backdoor samples"):
        backdoor_batches(data, AttackConfig.lindt_backdoor(), seed=0)
    donor_x = torch.full((4, 1), 100.0)
    extra = backdoor_set(donor_x, torch.tensor([4, 5, 4, 9]))
    assert extra[1].tolist() == [7, 6, 7]
    batches = backdoor_batches(data, AttackConfig.lindt_backdoor(), seed=0, extra=extra)
    for xb, _ in batches:
        assert int((xb[:, 0] == 100.0).sum()) == 3
    with pytest.raises(AttackError, match="poison_per_batch"):
        BackdoorBatches(data.x_train, data.y_train, donor_x, torch.zeros(4, dtype=torch.int64), 10, 0)


def test_poisoned_batches_dispatch() -> None:
    data = _data(list(range(10)) * 3)
    flipped = torch.cat([yb for _, yb in poisoned_batches(data, AttackConfig.reverse_flip(), 8, seed=0)])
    assert sorted(flipped.tolist()) == sorted((9 - data.y_train).tolist())
    clean = list(poisoned_batches(data, AttackConfig(), 8, seed=0))
    assert [len(yb) for _, yb in clean] == [8, 8, 8, 6]
    bd = list(poisoned_batches(data, AttackConfig.lindt_backdoor(), 8, seed=0))
    assert all(len(yb) <= 10 for _, yb in bd)
