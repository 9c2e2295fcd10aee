"""Flower side by side: fedguard's framework overhead per round next to Flower's, in one invocation.

Each pair runs (a) fedguard: ``tools/bench/bench_rounds.py`` (a fedserver + K fedclient processes on loopback, no-op
trainer) and then (b) Flower's deployment engine: a SuperLink, K SuperNodes and the ServerApp of
``tools/bench/flower_bench/`` submitted with ``flwr run``, all insecure on loopback, with a no-op ClientApp (it returns
the
arrays it received, num-examples 1) and a model of the same parameter shapes (read from fedguard's model registry:
the mlp fedserver builds for ``--hidden``). Both sides run the same K and the same rounds, one warm-up round first.

What each timer covers (both server-side, round start -> aggregated, median over the timed rounds):
  fedguard: the ``seconds`` of the server's ``round.completed`` events (selection, hand-out, client turnaround,
            upload, aggregation; bench_rounds.py's "median seconds per round").
  Flower:   the ServerApp's FedAvg strategy, from ``configure_train`` (before sampling the nodes) to the end of
            ``aggregate_train``: messages pushed to the SuperLink, picked up by the polling SuperNodes, run in
            their ClientApp processes, replies pulled back by the polling ServerApp, FedAvg.

Flower runs from its own environment (flwr pins grpcio/protobuf versions fedguard's cannot share): create it once
with ``bash tools/flower_env.sh`` (FEDGUARD_FLOWER_VENV, default ~/.cache/fedguard/venv-flower).

    python tools/bench/bench_flower.py                      # K = 10, 10 timed rounds, 4,554-parameter MLP, one pair
    python tools/bench/bench_flower.py --pairs 2            # fedguard, Flower, fedguard, Flower
    python tools/bench/bench_flower.py -k 5 --rounds 5 --hidden 1024 512
    python tools/bench/bench_flower.py --simulation         # also Flower's simulation engine (Ray; reported apart)

``--simulation`` adds, in each pair, Flower's simulation engine: a ``flower-superlink --simulation`` whose
simulation runtime runs the same app with K virtual SuperNodes in Ray actors of one process tree (no SuperNode
processes, no Fleet API, no per-message process). It is not comparable with fedguard's real processes and is
reported on its own line; it needs ``FEDGUARD_FLOWER_SIMULATION=1 bash tools/flower_env.sh``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from tempfile import TemporaryDirectory

ROOT = Path(__file__).resolve().parents[2]
APP_DIR = ROOT / "tools" / "bench" / "flower_bench"
VENV_ENV = "FEDGUARD_FLOWER_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "fedguard" / "venv-flower"
FLOWER_EXECUTABLES = ("python", "flwr", "flower-superlink", "flower-supernode")


@dataclass(frozen=True)
class SideResult:
    """One side's figures: the median, min and max server-side seconds per timed round, and the wall seconds
    between consecutive round completions."""

    median: float
    low: float
    high: float
    wall: float


def mlp_shapes(hidden: list[int]) -> list[tuple[int, ...]]:
    """The parameter shapes of the model fedserver builds in bench_rounds.py (``--model-kwargs {"hidden": ...}``
    on the default model), in state_dict order: what the Flower ServerApp must send."""
    from fedcore.config import ModelConfig
    from fedcore.models import build_model

    state = build_model(ModelConfig().name, {"hidden": list(hidden)}, seed=0).state_dict()
    return [tuple(int(d) for d in t.shape) for t in state.values() if t.is_floating_point()]


def flower_venv(arg: str | None) -> Path:
    return Path(arg or os.environ.get(VENV_ENV) or DEFAULT_VENV).expanduser()


def missing_executables(venv: Path) -> list[str]:
    return [name for name in FLOWER_EXECUTABLES if not os.access(venv / "bin" / name, os.X_OK)]


def has_ray(venv: Path) -> bool:
    """Whether Flower's environment can import Ray (the simulation engine's backend)."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('ray') else 1)"
    return subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, timeout=60).returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"not listening on {port} after {timeout:.0f} s")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join("    " + line for line in path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "    (no log)"


def run_fedguard(k: int, rounds: int, hidden: list[int], log: Path, transport: str = "session") -> tuple[
    SideResult, int
]:
    """tools/bench/bench_rounds.py as a subprocess with fedguard's python (this one); its figures and parameter count.
    ``transport``: bench_rounds.py's ``--transport`` (session, framed or unary)."""
    cmd = [sys.executable, str(ROOT / "tools" / "bench" / "bench_rounds.py"), "-k", str(k), "--rounds", str(rounds),
           "--hidden", *map(str, hidden), "--transport", transport]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_rounds.py failed with code {proc.returncode}:\n{_tail(log)}")
    parsed = parse_bench_rounds(proc.stdout)
    if parsed is None:
        raise RuntimeError(f"bench_rounds.py's output lacks the lines this script reads:\n{_tail(log)}")
    return parsed


def parse_bench_rounds(stdout: str) -> tuple[SideResult, int] | None:
    """bench_rounds.py's median (min, max) and wall seconds per round and its model's parameter count; None when
    a line is missing."""
    med = re.search(r"median seconds per round \(start -> aggregated\): ([0-9.]+)\s+\(min ([0-9.]+), max ([0-9.]+)\)",
                    stdout)
    wall = re.search(r"wall seconds per round \(between completions\):\s+([0-9.]+)", stdout)
    params = re.search(r"([0-9,]+)-parameter", stdout)
    if not (med and wall and params):
        return None
    result = SideResult(float(med.group(1)), float(med.group(2)), float(med.group(3)), float(wall.group(1)))
    return result, int(params.group(1).replace(",", ""))


def flower_result(rows: list[dict[str, float]], k: int, total: int) -> SideResult:
    """The ServerApp's timing rows -> figures: each round's end - start, the first (warm-up) round left out."""
    done = [r for r in rows if "round" in r]
    if len(done) != total or any(r["replies"] != k or r["failures"] for r in done):
        raise RuntimeError(f"the Flower run's rounds are not {total} rounds of {k} replies: {done}")
    if total < 2:
        raise RuntimeError("no timed round after the warm-up")
    per_round = [r["end"] - r["start"] for r in done[1:]]
    wall = (done[-1]["end"] - done[0]["end"]) / (len(done) - 1)
    return SideResult(statistics.median(per_round), min(per_round), max(per_round), wall)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each started process's group (each was started in its own session, so the group holds what it
    spawned: SuperExec, ServerApp and ClientApp processes), then SIGKILL what is left after 10 s."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(ProcessLookupError):  # the group may outlive its leader (SuperExec children)
            os.killpg(p.pid, signal.SIGKILL)
        if p.poll() is None:
            p.wait(5)


def run_flower(venv: Path, k: int, rounds: int, shapes: list[tuple[int, ...]], seed: int, work: Path,
               simulation: bool = False) -> SideResult:
    """A SuperLink, K SuperNodes and ``flwr run`` of tools/bench/flower_bench on loopback; the ServerApp's per-round
    timings. ``simulation``: a simulation SuperLink and K virtual SuperNodes instead (no SuperNode processes).
    ``work`` receives the logs and the Flower home (FLWR_HOME) of this run."""
    from tools.bench.flower_bench.fgbench.model import format_shapes

    bindir = venv / "bin"
    home = work / "flwr-home"
    home.mkdir(parents=True)
    link_port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n')
    env = {key: v for key, v in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", FLWR_HOME=str(home), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    timing = work / "flower-rounds.jsonl"
    total = rounds + 1
    procs: list[subprocess.Popen[bytes]] = []
    names: list[str] = []

    def start(cmd: list[str], name: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(cmd, stdout=open(work / f"{name}.log", "wb"),  # noqa: SIM115
                             stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)
        procs.append(p)
        names.append(name)
        return p

    try:
        link = start([str(bindir / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port",
                      str(link_port), "--disable-runtime-dependency-installation",
                      *(["--simulation"] if simulation else [])], "superlink")
        try:
            _wait_port(link_port, link, 90)
        except RuntimeError as e:
            raise RuntimeError(f"flower-superlink {e}:\n{_tail(work / 'superlink.log')}") from None
        for i in range(0 if simulation else k):
            start([str(bindir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                   "--host", "127.0.0.1", "--port", str(_free_port()),
                   "--node-config", f"partition-id={i} num-partitions={k}"], f"supernode-{i}")
        config = (f"num-server-rounds={total} min-nodes={k} shapes='{format_shapes(shapes)}' seed={seed} "
                  f"timing-file='{timing}'")
        federation = ["--federation-config", f"num-supernodes={k}"] if simulation else []
        runner = start([str(bindir / "flwr"), "run", str(APP_DIR), "bench", "--run-config", config, *federation,
                        "--stream"], "flwr-run")
        deadline = time.monotonic() + 120 + 60 * total
        exited_at: float | None = None
        rows: list[dict[str, float]] = []
        while True:
            rows = [json.loads(line) for line in timing.read_text().splitlines()] if timing.exists() else []
            if rows and rows[-1].get("finished"):
                break
            dead = [(name, p) for name, p in zip(names, procs[:-1], strict=False) if p.poll() is not None]
            if dead:
                name, p = dead[0]
                raise RuntimeError(f"{name} exited early (code {p.returncode}):\n{_tail(work / f'{name}.log')}")
            if runner.poll() is not None:
                exited_at = exited_at or time.monotonic()
                if time.monotonic() - exited_at > 15:
                    raise RuntimeError(f"flwr run ended (code {runner.returncode}) without finishing the run:\n"
                                       f"{_tail(work / 'flwr-run.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Flower run did not finish in time ({len(rows)} rounds done):\n"
                                   f"{_tail(work / 'flwr-run.log')}")
            time.sleep(0.5)
    finally:
        _stop(procs)
    return flower_result(rows, k, total)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def versions(venv: Path) -> tuple[str, str]:
    """A line for fedguard's side (commit, python, grpcio, protobuf) and one for Flower's (its environment)."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    ours = (f"fedguard {commit} (Python {sys.version.split()[0]}, grpcio {_version('grpcio')}, "
            f"protobuf {_version('protobuf')})")
    probe = ("import sys, importlib.metadata as m; print(f'Python {sys.version.split()[0]}, ' + ', '.join("
             "f'{n} {m.version(n)}' for n in ('flwr', 'grpcio', 'protobuf', 'numpy')))")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=60)
    theirs = proc.stdout.strip() if proc.returncode == 0 else f"(cannot read versions: {proc.stderr.strip()[-200:]})"
    return ours, f"Flower environment {venv}: {theirs}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", type=int, default=10, help="clients per round (fedclients / SuperNodes)")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (one warm-up round is added)")
    ap.add_argument("--hidden", type=int, nargs="*", default=[64], help="MLP hidden widths")
    ap.add_argument("--pairs", type=int, default=1, help="fedguard-then-Flower runs, interleaved")
    ap.add_argument("--seed", type=int, default=0, help="seed of the Flower model's initial arrays")
    ap.add_argument("--flower-venv", help=f"Flower's environment (default ${VENV_ENV} or {DEFAULT_VENV})")
    ap.add_argument("--simulation", action="store_true",
                    help="also run Flower's simulation engine (Ray, K virtual SuperNodes), reported apart")
    ap.add_argument("--transport", choices=["session", "framed", "unary"], default="session",
                    help="fedguard's transport (tools/bench/bench_rounds.py --transport): gRPC's Session stream, the "
                         "framed port, or the unary calls")
    ap.add_argument("--keep", metavar="DIR", help="keep every run's logs under DIR (a new directory)")
    args = ap.parse_args(argv)
    if str(ROOT) not in sys.path:  # run as a script: tools.bench.flower_bench is imported from this repository
        sys.path.insert(0, str(ROOT))
    if args.k < 1 or args.rounds < 1 or args.pairs < 1:
        ap.error("-k, --rounds and --pairs must be >= 1")
    venv = flower_venv(args.flower_venv)
    missing = missing_executables(venv)
    if missing:
        create = "bash tools/flower_env.sh" if venv == DEFAULT_VENV else f"{VENV_ENV}={venv} bash tools/flower_env.sh"
        print(f"bench_flower: no Flower environment at {venv} (missing: {', '.join('bin/' + m for m in missing)}).\n"
              f"Create it (a separate venv with flwr; never fedguard's) with:\n    {create}\n"
              f"or point --flower-venv / ${VENV_ENV} at one.", file=sys.stderr)
        return 2
    if args.simulation and not has_ray(venv):
        print(f"bench_flower: --simulation needs Flower's simulation extra (Ray) in {venv}; add it with:\n"
              f"    {VENV_ENV}={venv} FEDGUARD_FLOWER_SIMULATION=1 bash tools/flower_env.sh", file=sys.stderr)
        return 2
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=False)  # never writes into a directory it did not make
    shapes = mlp_shapes(args.hidden)
    params = sum(math.prod(s) for s in shapes)
    ours, theirs = versions(venv)
    print(ours)
    print(theirs)
    print(f"K = {args.k}, {params:,} parameters ({len(shapes)} arrays: {shapes}), {args.rounds} timed rounds after "
          f"1 warm-up, {args.pairs} pair(s), loopback, insecure")
    fed: list[SideResult] = []
    flo: list[SideResult] = []
    sim: list[SideResult] = []
    with TemporaryDirectory() as tmp:
        base = keep or Path(tmp)
        for pair in range(1, args.pairs + 1):
            work = base / f"pair-{pair}"
            work.mkdir()
            try:
                result, fed_params = run_fedguard(args.k, args.rounds, args.hidden, work / "fedguard.log",
                                                  args.transport)
                if fed_params != params:
                    raise RuntimeError(f"fedguard's model has {fed_params:,} parameters, the Flower model {params:,}")
                fed.append(result)
                print(f"pair {pair}: fedguard (fedserver + {args.k} fedclient processes, {args.transport}): median "
                      f"{result.median:.4f} s per round (min {result.low:.4f}, max {result.high:.4f}); wall between "
                      f"completions {result.wall:.4f} s", flush=True)
                result = run_flower(venv, args.k, args.rounds, shapes, args.seed, work / "flower")
                flo.append(result)
                print(f"pair {pair}: Flower deployment engine (SuperLink + {args.k} SuperNodes + ServerApp): median "
                      f"{result.median:.4f} s per round (min {result.low:.4f}, max {result.high:.4f}); wall between "
                      f"completions {result.wall:.4f} s", flush=True)
                if args.simulation:
                    result = run_flower(venv, args.k, args.rounds, shapes, args.seed, work / "flower-simulation",
                                        simulation=True)
                    sim.append(result)
                    print(f"pair {pair}: Flower SIMULATION engine (Ray, {args.k} virtual SuperNodes; not comparable "
                          f"with real processes): median {result.median:.4f} s per round (min {result.low:.4f}, max "
                          f"{result.high:.4f}); wall between completions {result.wall:.4f} s", flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"bench_flower: pair {pair} failed: {e}", file=sys.stderr)
                if keep is not None:
                    print(f"logs in {work}", file=sys.stderr)
                return 1
    fed_med = statistics.median(r.median for r in fed)
    flo_med = statistics.median(r.median for r in flo)
    print(f"median seconds per round, server-side round start -> aggregated (median over {args.pairs} pair(s)): "
          f"fedguard {fed_med:.4f}, Flower {flo_med:.4f}; Flower / fedguard = {flo_med / fed_med:.0f}x")
    print(f"wall seconds per round (between completions): fedguard {statistics.median(r.wall for r in fed):.4f}, "
          f"Flower {statistics.median(r.wall for r in flo):.4f}")
    if sim:
        sim_med = statistics.median(r.median for r in sim)
        print(f"Flower simulation engine (separately; virtual SuperNodes, not real processes): median {sim_med:.4f} s "
              f"per round; Flower simulation / fedguard = {sim_med / fed_med:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
