"""tools/bench/bench_secagg.py on a tiny configuration: the table's rows, and the secure sum the benchmark unmasks
equals
the plain FixedPointSum's limbs bit for bit (the benchmark measures a correct round, not just any work)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from fedcore.aggregation.fixedpoint import FixedPointSum
from tools.bench import bench_secagg as bs

TINY = ["--ks", "5", "--params", "1000", "--dropouts", "0,0.2", "--plain-reps", "1"]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_tiny_run_prints_one_row_per_dropout_fraction(capsys: pytest.CaptureFixture[str]) -> None:
    assert bs.main(TINY) == 0
    out = capsys.readouterr().out
    main = [_cells(line) for line in out.splitlines() if line.startswith("| P=1,000 | 1,000 |")]
    assert [r[:6] for r in main] == [["P=1,000", "1,000", "5", "4", "3", "0 (0)"],
                                     ["P=1,000", "1,000", "5", "4", "3", "0.2 (1)"]]
    for r, survivors in zip(main, (5, 4), strict=True):
        assert r[-1] == "yes"  # exact
        assert r[12] == r[14] == "4,000"  # plain: 4 B/param up and down
        # secagg up per client: the survivors' masked vectors alone are 16 B/coordinate; down: the model and more
        assert int(r[11].replace(",", "")) > 16 * 1000 * survivors / 5
        assert int(r[13].replace(",", "")) > 4000
        assert float(r[6]) > 0 and float(r[7]) > 0 and float(r[9]) > 0  # CPU measured
    parts = [_cells(line) for line in out.splitlines() if line.startswith("| P=1,000 | 5 |")]
    assert [r[2] for r in parts] == ["0", "0.2"] and all(len(r) == 3 + 4 + 5 for r in parts)
    assert "skipped" not in out


def test_secure_sum_equals_the_plain_fixedpoint_sum_bit_for_bit() -> None:
    rows = bs.run_unit("tiny", 1000, 5, [0.0, 0.2], seed=3, keep=True, plain_reps=1)
    ids = bs.client_ids(5)
    weights = dict(zip(ids, bs.weights(3, 5), strict=True))
    assert [r.dropped for r in rows] == [0, 1]
    for r in rows:
        assert r.exact and r.secure is not None and r.plain is not None
        assert len(r.secure.survivors) == 5 - r.dropped
        # the reference, recomputed here: one FixedPointSum.add per survivor, as streaming FedAvg does
        ref = FixedPointSum(1000)
        for i, c in enumerate(ids):
            if c in r.secure.survivors:
                ref.add(torch.from_numpy(bs.update(3, i, 1000)), weights[c])
        secure = r.secure.params(1)
        assert secure.count == ref.count == r.plain.count
        assert torch.equal(secure.hi, ref.hi) and torch.equal(secure.lo, ref.lo)
        assert torch.equal(r.plain.hi, ref.hi) and torch.equal(r.plain.lo, ref.lo)
        assert bool(torch.any(ref.hi != 0))  # a real sum, not an empty one
    # the dropped client's update is missing from the second sum only
    full, less = rows[0].secure, rows[1].secure
    assert full is not None and less is not None
    assert not torch.equal(full.params(1).hi, less.params(1).hi)


def test_a_configuration_past_the_budget_is_skipped_not_extrapolated(capsys: pytest.CaptureFixture[str]) -> None:
    assert bs.main([*TINY, "--budget-s", "0"]) == 0
    out = capsys.readouterr().out
    main = [_cells(line) for line in out.splitlines() if line.startswith("| P=1,000 | 1,000 |")]
    assert len(main) == 2 and all(r[6] == "skipped (budget)" and r[-1] == "-" for r in main)


# ---- --federation: its parts, without running a federation ----

def test_computed_bytes_extrapolate_the_in_process_round_exactly() -> None:
    """The bytes printed for a real model come from the in-process round at two small sizes: the extrapolation to a
    third size equals that size's round (the payloads are affine in P)."""
    up, down = bs.computed_bytes(40, 5, seed=1)
    row = bs.run_unit("tiny", 40, 5, [0.0], seed=1, plain_reps=1)[0]
    assert (up, down) == (row.up / 5, row.down / 5)
    up2, down2 = bs.computed_bytes(41, 5, seed=1)
    assert up2 - up == 16 and down2 - down == 4  # two uint64 limbs up and the float32 model down per parameter


def test_fed_specs_and_the_launch_commands() -> None:
    specs = bs.parse_fed_specs(" mlp:noop:10:5, cifar_cnn:default:100:2")
    assert specs == [bs.FedSpec("mlp", 10, "noop", 5), bs.FedSpec("cifar_cnn", 100, "default", 2)]
    assert [s.procs for s in specs] == [1, 2]
    for bad in ("mlp:noop:10", "mlp:default:10:2", "resnet:noop:10:2", "mlp:noop:2:2", "mlp:noop:10:0"):
        with pytest.raises(ValueError):
            bs.parse_fed_specs(bad)
    assert [s.name for s in bs.parse_fed_specs(",".join(f"{s.model}:{s.trainer}:{s.clients}:{s.rounds}"
                                                        for s in bs.DEFAULT_FED))][-1] == "cifar_cnn-K100-default"
    run, cache = Path("/tmp/x"), Path("/tmp/c")
    plain = bs.launch_command(specs[0], False, run, 0, cache)
    secure = bs.launch_command(specs[0], True, run, 0, cache)
    # the same federation: the secure run only adds the secure aggregation settings
    assert secure[:len(plain)] == plain and bs.SECURE_SET in secure[len(plain):]
    assert plain[plain.index("--rounds") + 1] == "6" and "--insecure" in plain and "--virtual" in plain
    assert plain[plain.index("--trainer") + 1] == "noop" and plain[plain.index("-k") + 1] == "10"
    goal = bs.launch_command(specs[1], False, run, 0, cache)
    assert "--trainer" not in goal and goal[goal.index("--config") + 1].endswith("configs/cifar10_ideal.toml")
    assert goal[goal.index("--private-epochs") + 1] == "0" and goal[goal.index("--procs") + 1] == "2"
    cnn = bs.launch_command(bs.FedSpec("cifar_cnn", 10, "noop", 3), False, run, 0, cache)
    assert 'model.name="cifar_cnn"' in cnn and 'data.dataset="cifar10"' in cnn


def _event(event: str, t: float, **kw: object) -> dict[str, object]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(1_700_000_000 + int(t)))
    return {"event": event, "timestamp": f"{stamp}.{round((t % 1) * 1e6):06d}Z", **kw}


def test_secure_phases_from_the_server_log_last_attempt_wins() -> None:
    events = [_event("round.started", 0.0, round=2), _event("secagg.phase", 1.0, round=2, phase="share"),
              _event("round.started", 10.0, round=2),  # the attempt was abandoned: re-run
              _event("secagg.phase", 11.0, round=2, phase="share"),
              _event("secagg.phase", 13.0, round=2, phase="masked"),
              _event("secagg.phase", 20.0, round=2, phase="unmask"),
              _event("secagg.completed", 20.5, round=2), _event("round.completed", 21.0, round=2),
              _event("round.started", 30.0, round=3)]  # incomplete: not counted
    got = bs.secure_phases(events, [2, 3])
    assert got == pytest.approx({"advertise": 1.0, "share": 2.0, "masked": 7.0, "unmask": 0.5, "close": 0.5})


def test_the_federation_table_says_what_was_not_measured() -> None:
    spec = bs.FedSpec("mlp", 10, "noop", 2)
    plain = bs.FedRun(seconds=[1.0, 3.0], server_cpu=2.0, client_cpu=4.0)
    secure = bs.FedRun(seconds=[3.0, 5.0], server_cpu=4.0, client_cpu=None)
    pair = bs.FedPair(spec, 4554, plain, secure, up=75148.0, down=21122.0)
    line = next(_cells(x) for x in bs.federation_table([pair]).splitlines() if x.startswith("| mlp |"))
    assert line[5:12] == ["2", "4", "2", "0.1", "0.2", "0.2", bs.NOT_MEASURED]
    assert line[12:] == ["18,216", "75,148", "18,216", "21,122"]
    failed = bs.FedPair(spec, 4554, plain, bs.FedRun(error="timed out after 9 s"))
    line = next(_cells(x) for x in bs.federation_table([failed]).splitlines() if x.startswith("| mlp |"))
    assert line[6].startswith("failed") and line[7] == "-" and line[9] == "-"


def test_the_federation_mode_replaces_run_dirs_only_in_a_directory_it_made(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "results.csv").write_text("do not lose me\n")
    with pytest.raises(SystemExit) as err:
        bs.claim_fed_dir(foreign)
    assert "was not made by this tool" in str(err.value)
    assert (foreign / "results.csv").read_text() == "do not lose me\n"
    fresh = tmp_path / "runs"
    bs.claim_fed_dir(fresh)
    assert (fresh / bs.FED_DIR_MARK).is_file()
    bs.claim_fed_dir(fresh)  # its own: accepted again
