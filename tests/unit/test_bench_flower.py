"""tools/bench/bench_flower.py without flwr: the Flower model matches fedguard's, the figures it reads, and the message
when the Flower environment is missing. (Flower itself runs only in its own venv: tools/flower_env.sh.)"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.config import ModelConfig
from fedcore.models import build_model
from fedserver.global_models import GlobalModels
from tools.bench import bench_flower as bf
from tools.bench.flower_bench.fgbench.model import format_shapes, make_arrays, parse_shapes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "bench" / "bench_flower.py"


@pytest.mark.parametrize("hidden", [[64], [32, 16], [], [1024, 512]])
def test_flower_model_has_fedguard_mlp_shapes_and_count(hidden: list[int]) -> None:
    # What the Flower ServerApp builds from the run config string bench_flower.py writes ...
    arrays = make_arrays(parse_shapes(format_shapes(bf.mlp_shapes(hidden))), seed=0)
    # ... against the parameters of the model fedserver builds for bench_rounds.py's --model-kwargs.
    model = build_model("mlp", {"hidden": hidden}, seed=0)
    params = [p for p in model.state_dict().values() if p.is_floating_point()]
    assert [a.shape for a in arrays] == [tuple(p.shape) for p in params]
    assert all(a.dtype == np.float32 for a in arrays) and all(p.dtype == torch.float32 for p in params)
    assert sum(a.size for a in arrays) == sum(p.numel() for p in params)
    if hidden == [64]:  # the documented benchmark model
        assert sum(a.size for a in arrays) == 4554 == sum(math.prod(s) for s in bf.mlp_shapes(hidden))


def test_fedserver_aggregates_the_same_parameters() -> None:
    """The vector fedserver aggregates (its GlobalModels, from the configured default model with bench_rounds.py's
    kwargs) has the Flower model's shapes, in the same order."""
    models = GlobalModels.of(build_model(ModelConfig().name, {"hidden": [64]}, seed=0))
    shapes = bf.mlp_shapes([64])
    assert models.num_params == sum(math.prod(s) for s in shapes) == 4554
    assert [m.shape for m in models.manifest if m.name in models.float_names] == shapes


def test_make_arrays_is_seeded() -> None:
    a, b, c = (make_arrays([(3, 4), (4,)], seed) for seed in (7, 7, 8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("bad", ["", "64x", "64x0", "ax3", "64,,10", "-1"])
def test_parse_shapes_refuses_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="bad shapes"):
        parse_shapes(bad)


def test_format_shapes_round_trip_and_refusals() -> None:
    shapes = [(64, 60), (64,), (2, 3, 4)]
    assert format_shapes(shapes) == "64x60,64,2x3x4"
    assert parse_shapes(format_shapes(shapes)) == shapes
    for bad in ([], [()], [(3, 0)]):
        with pytest.raises(ValueError):
            format_shapes(bad)


def test_flower_result_leaves_out_the_warm_up_and_checks_replies() -> None:
    rows: list[dict[str, float]] = [
        {"round": 1, "start": 0.0, "end": 100.0, "replies": 2, "failures": 0},  # warm-up: waits for the nodes
        {"round": 2, "start": 100.0, "end": 103.0, "replies": 2, "failures": 0},
        {"round": 3, "start": 103.0, "end": 109.0, "replies": 2, "failures": 0},
        {"round": 4, "start": 109.0, "end": 113.0, "replies": 2, "failures": 0},
        {"finished": True, "seconds": 113.0, "params": 10},
    ]
    r = bf.flower_result(rows, k=2, total=4)
    assert (r.median, r.low, r.high) == (4.0, 3.0, 6.0)
    assert r.wall == pytest.approx(13.0 / 3)
    with pytest.raises(RuntimeError, match="rounds of 3 replies"):
        bf.flower_result(rows, k=3, total=4)
    with pytest.raises(RuntimeError, match="not 5 rounds"):
        bf.flower_result(rows, k=2, total=5)
    failed = [dict(rows[0]), *rows[1:]]
    failed[0]["failures"] = 1
    with pytest.raises(RuntimeError):
        bf.flower_result(failed, k=2, total=4)


def test_parse_bench_rounds_output() -> None:
    out = ("K = 10 of N = 10 clients (one process each), no-op trainer, 4,554-parameter MLP, 10 timed rounds after "
           "1 warm-up\nmedian seconds per round (start -> aggregated): 0.0251  (min 0.0200, max 0.0402)\n"
           "wall seconds per round (between completions):   0.0301\n")
    parsed = bf.parse_bench_rounds(out)
    assert parsed is not None
    result, params = parsed
    assert params == 4554
    assert (result.median, result.low, result.high, result.wall) == (0.0251, 0.0200, 0.0402, 0.0301)
    assert bf.parse_bench_rounds(out.replace("wall seconds", "wall time")) is None


@pytest.mark.system
def test_reads_real_bench_rounds_output(tmp_path: Path) -> None:
    """bench_rounds.py's real output still holds the lines bench_flower.py reads (K = 2, one timed round)."""
    result, params = bf.run_fedguard(2, 1, [8], tmp_path / "fedguard.log")
    assert params == sum(math.prod(s) for s in bf.mlp_shapes([8]))
    assert 0 < result.low <= result.median <= result.high
    assert result.wall > 0


def _run_script(*args: str, venv_env: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != bf.VENV_ENV}
    if venv_env is not None:
        env[bf.VENV_ENV] = venv_env
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


def test_missing_flower_venv_says_how_to_create_it(tmp_path: Path) -> None:
    venv = tmp_path / "no-such-venv"
    proc = _run_script("--rounds", "1", venv_env=str(venv))
    assert proc.returncode == 2
    assert f"no Flower environment at {venv}" in proc.stderr
    assert f"{bf.VENV_ENV}={venv} bash tools/flower_env.sh" in proc.stderr
    assert "bin/flower-superlink" in proc.stderr
    assert "fedguard (" not in proc.stdout  # stopped before running anything


def test_half_built_flower_venv_names_what_is_missing(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "flwr"):
        exe = venv / "bin" / name
        exe.write_text("#!/bin/sh\nexit 1\n")
        exe.chmod(0o755)
    proc = _run_script("--flower-venv", str(venv))
    assert proc.returncode == 2
    assert "missing: bin/flower-superlink, bin/flower-supernode" in proc.stderr
    assert "bin/python" not in proc.stderr.split("missing:")[1].split(")")[0]
    assert bf.missing_executables(venv) == ["flower-superlink", "flower-supernode"]


def test_simulation_without_ray_says_how_to_add_it(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in bf.FLOWER_EXECUTABLES:  # a python that cannot import ray (nor anything)
        exe = venv / "bin" / name
        exe.write_text("#!/bin/sh\nexit 1\n")
        exe.chmod(0o755)
    assert not bf.has_ray(venv)
    proc = _run_script("--simulation", "--flower-venv", str(venv))
    assert proc.returncode == 2
    assert f"{bf.VENV_ENV}={venv} FEDGUARD_FLOWER_SIMULATION=1 bash tools/flower_env.sh" in proc.stderr
