"""Golden fingerprints of fedguard's numbers, to show that a refactor changes no number (issue 27).

Captured once on the commit before the refactor (``capture``) and checked after it (``--check``):

- ``trainers``: every registered trainer/recovery method (and its main option variants) trained in process for
  three rounds on a seeded task, recovery off in round 1 and on after: the sha256 of the trained model, of the
  trainer state (adapted/personal model, kept models, scalars, metrics), of the inference weights and of the
  inference module's logits, and the exact train loss/steps/samples.
- ``federation``: small federations through the launcher on loopback (``python -m fedlaunch``: one per
  recovery method, one with attackers under a robust rule, one DistFL run): the final model's sha256 and every
  ``rounds.jsonl`` value except timings, plus the per-round β̂ written out.
- ``demo``: ``tools/demo.sh``'s federation (40 clients, 40 rounds): final model sha256, per-round β̂ and the rows.

Bit-identity is the contract only on the same machine type (BLAS/oneDNN kernels differ between CPUs), so the
golden records the machine's signature; ``--check`` on another signature says so and compares anyway.

    python tools/dev/golden_seams.py capture trainers federation demo     # on the base commit: writes the golden
    python tools/dev/golden_seams.py --check trainers                     # ~20 s
    python tools/dev/golden_seams.py --check federation                   # a few minutes on 2 cores
    python tools/dev/golden_seams.py --check demo                         # ~1 min
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "seams.json"
PARTS = ("trainers", "federation", "demo")
# Check the tree this file lives in (not whatever fedguard the interpreter has installed): in process and in the
# launcher's processes.
sys.path.insert(0, str(ROOT))
# Fields that measure time, not numbers of the federation: any key ending in "seconds" (rounds.jsonl's
# ``seconds``/``client_seconds``, trainers' ``personal_seconds``), at any depth.
TIMING_SUFFIX = "seconds"


def untimed(x: Any) -> Any:
    """``x`` without the timing fields (recursively)."""
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items() if not str(k).endswith(TIMING_SUFFIX)}
    if isinstance(x, list):
        return [untimed(v) for v in x]
    return x


def machine_signature() -> dict[str, str]:
    """What decides which floating-point kernels run: CPU model and ISA level, torch and numpy versions."""
    import numpy as np
    import torch

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor()
    return {"cpu": model, "isa": str(torch.backends.cpu.get_cpu_capability()), "torch": torch.__version__,
            "numpy": np.__version__, "machine": platform.machine()}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tensors_sha(state: Mapping[str, Any] | None) -> str | None:
    """sha256 over (key, dtype, shape, bytes) of a state dict in key order; None for None."""
    import torch

    if state is None:
        return None
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k]
        assert isinstance(t, torch.Tensor), k
        t = t.detach().to("cpu").contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _exact(x: Any) -> Any:
    """A JSON value that keeps floats exactly (repr) and NaN/inf distinguishable."""
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, dict):
        return {str(k): _exact(v) for k, v in sorted(x.items())}
    if isinstance(x, (list, tuple)):
        return [_exact(v) for v in x]
    return x


# ---- trainers (in process) ----

def _trainer_cases() -> list[tuple[str, str, dict[str, Any], str, dict[str, Any], dict[str, Any]]]:
    """(case id, trainer, options, model, model kwargs, training overrides)."""
    img = {"in_channels": 1, "image_size": 16}
    return [
        ("vanilla", "vanilla", {}, "mlp", {}, {}),
        ("vanilla-prox-momentum-clip", "vanilla", {}, "mlp", {},
         {"prox_mu": 0.1, "momentum": 0.9, "grad_clip_norm": 0.5, "weight_decay": 1e-4}),
        ("noop", "noop", {}, "mlp", {}, {}),
        ("flguard", "flguard", {}, "mlp", {}, {}),
        ("flguard-momentum", "flguard", {}, "mlp", {}, {"momentum": 0.9, "weight_decay": 1e-4}),
        ("flguard-mnist-cnn", "flguard", {}, "mnist_cnn", img, {}),
        ("lindt", "lindt", {}, "mlp", {}, {}),
        ("lindt-detached", "lindt", {"detach_global": True}, "mlp", {}, {}),
        ("lindt-cnn", "lindt", {}, "mnist_cnn", img, {"momentum": 0.5}),
        ("ditto", "ditto", {}, "mlp", {}, {}),
        ("ditto-momentum", "ditto", {}, "mlp", {}, {"momentum": 0.9, "grad_clip_norm": 0.5}),
        ("apfl", "apfl", {}, "mlp", {}, {}),
        ("ft", "ft", {}, "mlp", {}, {}),
        ("fb", "fb", {}, "mlp", {}, {}),
        ("fedntd", "fedntd", {}, "fedntd_cnn", img, {}),
        ("moon", "moon", {}, "moon_cnn", img, {"momentum": 0.9}),
        ("hydra-fedntd", "hydra", {}, "hydra_ntd_cnn", img, {}),
        ("hydra-moon", "hydra", {"base": "moon"}, "moon_cnn", img, {}),
    ]


def _task(model_kwargs: Mapping[str, Any], n: int = 120) -> tuple[Any, Any, Any]:
    """Seeded inputs/labels for the model's input shape, and a fixed probe batch for inference logits."""
    import numpy as np
    import torch

    g = np.random.default_rng(11)
    shape: tuple[int, ...]
    if "image_size" in model_kwargs:
        side = int(model_kwargs["image_size"])
        shape = (int(model_kwargs.get("in_channels", 1)), side, side)
    else:
        shape = (int(model_kwargs.get("in_features", 60)),)
    x = g.normal(0.0, 1.0, size=(n, *shape)).astype(np.float32)
    y = g.integers(0, 10, size=n)
    # Labels that depend on x so training has something to learn.
    flat = x.reshape(n, -1)
    y = (np.argmax(flat[:, :10], axis=1) + y * (g.random(n) < 0.2)) % 10
    probe = torch.from_numpy(g.normal(0.0, 1.0, size=(8, *shape)).astype(np.float32))
    return torch.from_numpy(x), torch.from_numpy(y.astype(np.int64)), probe


def _state_fingerprint(state: Any) -> dict[str, Any]:
    return {"adapted": tensors_sha(state.adapted), "active": state.active,
            "frozen_keys": list(state.frozen_keys), "rounds_adapted": state.rounds_adapted,
            "metrics": _exact(untimed(dict(state.metrics))), "scalars": _exact(dict(state.scalars)),
            "kept": {k: tensors_sha(v) for k, v in sorted(state.kept.items())}}


# torch's intra-op threads decide how reductions are split (the sums' order): the trainers part runs on this
# many threads whatever the caller set (the golden was recorded with torch's default on a 2-core machine).
TRAINER_THREADS = 2


def trainer_fingerprints() -> dict[str, Any]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(TRAINER_THREADS)
    try:
        return _trainer_fingerprints()
    finally:
        torch.set_num_threads(before)


def _trainer_fingerprints() -> dict[str, Any]:
    import torch

    from fedcore.config import TrainingConfig
    from fedcore.models import build_model
    from fedcore.seeds import round_seeds
    from fedcore.train.trainers import make_trainer

    out: dict[str, Any] = {}
    for case, name, options, model_name, kwargs, training in _trainer_cases():
        x, y, probe = _task(kwargs)
        cfg = TrainingConfig(**{"local_epochs": 1, "batch_size": 16, "learning_rate": 0.05, **training})
        global_model = build_model(model_name, kwargs, seed=5)
        trainer = make_trainer(name, options)
        state = trainer.init(global_model)
        rounds = []
        for r in (1, 2, 3):
            model = build_model(model_name, kwargs, seed=5)
            model.load_state_dict(global_model.state_dict())
            res, state = trainer.train(model, state, x, y, cfg, round_seeds(7, "client-0", r), recovery=r >= 2)
            row: dict[str, Any] = {"loss": repr(float(res.loss)), "num_samples": res.num_samples,
                                   "steps": res.steps, "model": tensors_sha(model.state_dict()),
                                   "state": _state_fingerprint(state)}
            inf = trainer.inference_state(state, model.state_dict())
            row["inference_state"] = tensors_sha(inf)
            if trainer.inference_module is not None:
                module = trainer.inference_module(state, model)
                if module is not None:
                    module.eval()
                    with torch.no_grad():
                        logits = module(probe)
                    if not isinstance(logits, torch.Tensor):  # KD models return a record of outputs
                        logits = logits.logits
                    row["inference_logits"] = tensors_sha({"logits": logits})
            rounds.append(row)
            global_model.load_state_dict(model.state_dict())
        out[case] = rounds
    return out


# ---- federations (through the launcher, real processes on loopback) ----

def _federation_cases(tmp: Path) -> list[tuple[str, list[str]]]:
    """(case id, launcher arguments); small: 6 clients, 5 rounds, one client host process, plaintext gRPC."""
    base = ["--clients", "6", "-k", "6", "--rounds", "5", "--virtual", "--procs", "1", "--insecure",
            "--private-epochs", "2", "--server-set", "nfl.nr=2", "--server-set", "nfl.c=2"]
    cases = [(f"method-{m}", [*base, "--trainer", m, "--nfl-mode", "always-recover"])
             for m in ("vanilla", "flguard", "lindt", "ditto", "apfl", "ft", "fb")]
    cases.append(("detect-and-recover", [*base, "--seed", "3"]))
    cases.append(("attack-krum", [*base, "--nfl-mode", "off", "--attackers", "0.34", "--attack", "label_flip",
                                  "--server-set", "aggregation.rule=\"trimmed_mean\"",
                                  "--server-set", "aggregation.trim_m=1"]))
    cases.append(("stragglers-dropout", [*base, "-k", "4", "--stragglers", "0.3", "--straggler-delay", "0.0",
                                         "--dropout", "0.2", "--seed", "1"]))
    img = ["--server-set", "model.kwargs={in_channels = 1, image_size = 16}",
           "--server-set", "data.dataset=\"npz\"", "--server-set",
           f"data.options={{path = \"{tmp / 'images.npz'}\", num_clients = 6, partition = \"iid\"}}",
           "--server-set", "nfl.mode=\"off\""]
    base_img = ["--clients", "6", "-k", "6", "--rounds", "3", "--virtual", "--procs", "1", "--insecure"]
    for method, model in (("fedntd", "fedntd_cnn"), ("moon", "moon_cnn"), ("hydra", "hydra_ntd_cnn")):
        cases.append((f"kd-{method}", [*base_img, *img, "--server-set", f"model.name=\"{model}\"",
                                       "--server-set", f"recovery.method=\"{method}\""]))
    return cases


def _images(path: Path) -> None:
    import numpy as np

    g = np.random.default_rng(0)
    y = np.repeat(np.arange(10), 18)
    x = g.normal(0.0, 0.3, size=(len(y), 1, 16, 16)).astype(np.float32)
    for i, c in enumerate(y):
        r, col = divmod(int(c), 5)
        x[i, 0, 2 + 5 * r : 5 + 5 * r, 1 + 2 * col : 3 + 2 * col] += 2.0
    np.savez(path, x=x, y=y)


def _run_fingerprint(run_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.strip()]
    kept = untimed(rows)
    return {"final_model": tensors_sha(load_file(str(run_dir / "final_model.safetensors"))),
            "beta_hat": [_exact(r.get("beta_hat")) for r in rows],
            "rows_sha": _sha(json.dumps(_exact(kept), sort_keys=True).encode()),
            "rows": _exact(kept)}


def _launch(args: list[str], run_dir: Path, log: Path) -> None:
    launcher = "fedlaunch" if (ROOT / "fedlaunch").is_dir() else "fedguard.launch"  # its module before issue 27
    cmd = [sys.executable, "-m", launcher, *args, "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        raise SystemExit(f"golden: the launcher failed (exit {rc}): {' '.join(cmd)}; log: {log}")


def federation_fingerprints(only: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="golden-") as t:
        tmp = Path(t)
        _images(tmp / "images.npz")
        for case, args in _federation_cases(tmp):
            if only and only != case:
                continue
            _launch(args, tmp / case, tmp / f"{case}.log")
            out[case] = _run_fingerprint(tmp / case)
            print(f"  {case}: done", flush=True)
    return out


DEMO_ARGS = ["--clients", "40", "-k", "40", "--rounds", "40", "--virtual", "--procs", "2", "--private-epochs", "10",
             "--server-set", "nfl.nr=5", "--server-set", "nfl.c=5", "--server-set", "data.options.shared=0.4",
             "--server-set", "data.options.feature_shift=false"]


def demo_fingerprint() -> dict[str, Any]:
    """tools/demo.sh's federation (the same launcher arguments; its own run dir, TLS as the demo)."""
    demo_sh = (ROOT / "tools" / "demo.sh").read_text()
    if "--clients 40 -k 40 --rounds 40" not in demo_sh:
        raise SystemExit("golden: tools/demo.sh no longer runs the recorded demo; update DEMO_ARGS deliberately")
    with tempfile.TemporaryDirectory(prefix="golden-demo-") as t:
        _launch(DEMO_ARGS, Path(t) / "demo", Path(t) / "demo.log")
        return {"demo": _run_fingerprint(Path(t) / "demo")}


# ---- compare ----

def _first_difference(want: Any, got: Any, path: str = "") -> str | None:
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got)):
            if k not in want or k not in got:
                return f"{path}/{k}: {'missing now' if k not in got else 'new field'}"
            d = _first_difference(want[k], got[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return f"{path}: {len(want)} items recorded, {len(got)} now"
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            d = _first_difference(a, b, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if want == got else f"{path}: recorded {want!r}, now {got!r}"


COMPUTE: dict[str, Callable[[], dict[str, Any]]] = {
    "trainers": trainer_fingerprints, "federation": federation_fingerprints, "demo": demo_fingerprint}


def check(part: str, golden: Mapping[str, Any]) -> list[str]:
    """The differences between the recorded and the current fingerprints of ``part`` (empty: bit-identical)."""
    want = golden["parts"][part]
    got = COMPUTE[part]()
    problems = []
    for case in sorted(set(want) | set(got)):
        d = _first_difference(want.get(case), got.get(case)) if case in want and case in got else (
            "not recorded" if case not in want else "not computed")
        print(f"{part}/{case}: {'bit-identical' if d is None else 'DIFFERS ' + d}", flush=True)
        if d is not None:
            problems.append(f"{part}/{case}: {d}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", nargs="?", choices=["capture"], help="record the golden (on the base commit only)")
    p.add_argument("parts", nargs="*", default=[], help=f"parts to capture: {', '.join(PARTS)} (default all)")
    p.add_argument("--check", nargs="+", choices=PARTS, default=None, help="compare these parts with the golden")
    p.add_argument("--golden", type=Path, default=GOLDEN)
    a = p.parse_args(argv)
    if a.action == "capture":
        parts = a.parts or list(PARTS)
        unknown = sorted(set(parts) - set(PARTS))
        if unknown:
            p.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
        golden = json.loads(a.golden.read_text()) if a.golden.exists() else {"parts": {}}
        golden["machine"] = machine_signature()
        golden["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                          text=True, check=False).stdout.strip()
        for part in parts:
            golden["parts"][part] = COMPUTE[part]()
        a.golden.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.golden.with_suffix(".tmp")
        tmp.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, a.golden)
        print(f"recorded {', '.join(parts)} in {a.golden}")
        return 0
    if not a.check:
        p.error("say capture PARTS or --check PARTS")
    golden = json.loads(a.golden.read_text())
    if golden["machine"] != machine_signature():
        print(f"note: recorded on {golden['machine']}, checking on {machine_signature()}: floating-point kernels "
              "may differ between these machines, so a difference here is not by itself a regression")
    problems = [d for part in a.check for d in check(part, golden)]
    print(f"golden ({golden['commit'][:10]}): " + ("all bit-identical" if not problems else
                                                   f"{len(problems)} case(s) differ"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
