"""Memory of fedguard's processes (issue 30, item 5): what a client costs beyond ``import torch``, its model and its
data; what one more virtual client costs a host process; which heavy modules each process imports.

One run, a real ``fedserver`` on loopback (``--insecure``, no-op trainer, synthetic data, the default MLP):

(a) the private memory of ``python -c "import torch"`` and of ``python -c "import torch, grpc, numpy"`` (the
    import baseline a client cannot avoid);
(b) one ``fedclient`` process at steady state (sampled from the 3rd round's completion until it exits), with
    its model's bytes (parameters and buffers x element size) and its data's bytes (the shard's tensors' nbytes,
    derived here exactly as the client derives them) reported apart: beyond = RssAnon - baseline - model - data,
    against the 30 MiB target;
(c) two ``fedlaunch worker`` host processes with N1 and N2 virtual clients in one federation: the slope
    (RssAnon(N2) - RssAnon(N1) - (model + data of N2's clients - of N1's)) / (N2 - N1) against the 1 MiB target;
    threads per virtual client (/proc/PID/status Threads) and the N2 host's idle CPU while its clients are parked
    (the server waits for the N1 host before its first round);
(d) the heavy modules (torchvision, matplotlib, ray, pandas, scipy, ...) in ``sys.modules`` of the server, the
    client and the hosts when they exit (each process runs under a small wrapper that records them);
(e) with ``--decompose N``: where a virtual client's memory goes (N clients parked in the bench's own process:
    two idle threads, model + data built apart, a started FedClient; tracemalloc's largest Python allocations).

Private memory: RssAnon from /proc/PID/status; USS (Private_Clean + Private_Dirty) and PSS from
/proc/PID/smaps_rollup where readable.

    python tools/bench/bench_memory.py                          # N1 = 10, N2 = 510, MLP hidden 64
    python tools/bench/bench_memory.py --hosts 10 110 --hidden 1024 512
    python tools/bench/bench_memory.py --decompose 200          # (e) as well (docs/benchmarks.md's figures)
    python tools/bench/bench_memory.py --figures docs/figures.toml   # and write (b) and (c) into the figures file
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, TextIO

MIB = 1024 * 1024
CLIENT_TARGET_MIB = 30.0  # a client process: <= import torch + 30 MiB beyond its model and data
VIRTUAL_TARGET_MIB = 1.0  # one more virtual client in a host: <= 1 MiB beyond its model and data
HEAVY_MODULES = ("torchvision", "matplotlib", "ray", "pandas", "scipy", "sklearn", "PIL", "tensorboard", "IPython")

# Runs ``python -m MODULE ARGS`` and writes the names in sys.modules at exit to $FEDGUARD_BENCH_MODULES.
_WRAPPER = ("import atexit, json, os, runpy, sys\n"
            "def _dump():\n"
            "    with open(os.environ['FEDGUARD_BENCH_MODULES'], 'w') as f:\n"
            "        json.dump(sorted(sys.modules), f)\n"
            "atexit.register(_dump)\n"
            "sys.argv = [sys.argv[1], *sys.argv[2:]]\n"
            "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


# ---- pure accounting helpers (tests/unit/test_bench_memory.py) ----

def parse_proc_fields(text: str) -> dict[str, int]:
    """``Name:  value [kB]`` lines of /proc/PID/status or /proc/PID/smaps_rollup: kB values in bytes, plain integers
    as they are; other lines (the rollup's address header, non-numeric fields) are skipped."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts or " " in name.strip() or not parts[0].isdigit():
            continue
        value = int(parts[0])
        if len(parts) > 1 and parts[1].lower() == "kb":
            value *= 1024
        fields[name.strip()] = value
    return fields


@dataclass(frozen=True)
class Memory:
    """One process's memory, bytes: RssAnon and VmRSS (status), USS and PSS (smaps_rollup, None if unreadable),
    and its thread count."""

    rss_anon: int
    rss: int
    threads: int
    uss: int | None = None
    pss: int | None = None


def memory_of(status_text: str, rollup_text: str | None = None) -> Memory:
    """A :class:`Memory` from the texts of /proc/PID/status and (optionally) /proc/PID/smaps_rollup."""
    status = parse_proc_fields(status_text)
    if "RssAnon" not in status:
        raise ValueError("no RssAnon line in the status text")
    uss = pss = None
    if rollup_text is not None:
        rollup = parse_proc_fields(rollup_text)
        if "Private_Clean" in rollup and "Private_Dirty" in rollup:
            uss = rollup["Private_Clean"] + rollup["Private_Dirty"]
        pss = rollup.get("Pss")
    return Memory(status["RssAnon"], status.get("VmRSS", 0), status.get("Threads", 0), uss, pss)


def beyond(process: int, baseline: int, model: int, data: int) -> int:
    """What a process holds beyond its import baseline, its model and its data (bytes; may be negative)."""
    return process - baseline - model - data


def per_client_slope(n1: int, mem1: int, own1: int, n2: int, mem2: int, own2: int) -> float:
    """Bytes one more virtual client costs beyond its model and data: hosts of ``n1`` and ``n2`` clients holding
    ``mem1``/``mem2`` bytes, of which ``own1``/``own2`` are their clients' model and data bytes."""
    if n1 == n2:
        raise ValueError("the two hosts need different client counts")
    return ((mem2 - own2) - (mem1 - own1)) / (n2 - n1)


def verdict(value_mib: float | None, target_mib: float) -> str:
    if value_mib is None:
        return "n/a"
    return "PASS" if value_mib <= target_mib else "MISS"


def heavy_imports(modules: Iterable[str], heavy: Iterable[str] = HEAVY_MODULES) -> list[str]:
    """The top-level packages of ``heavy`` that ``modules`` (names in sys.modules) holds."""
    tops = {m.partition(".")[0] for m in modules}
    return [h for h in heavy if h in tops]


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.2f}"


# ---- measuring ----

def read_memory(pid: int) -> Memory | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    try:
        rollup: str | None = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        rollup = None
    try:
        return memory_of(status, rollup)
    except ValueError:
        return None


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def import_baseline(py: str, modules: str, env: Mapping[str, str]) -> Memory:
    """The memory of ``python -c "import MODULES"`` once the imports are done."""
    code = f"import {modules}, sys\nsys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"
    p = subprocess.Popen([py, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(env))
    assert p.stdout is not None and p.stdin is not None
    try:
        if p.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"python -c 'import {modules}' failed")
        time.sleep(0.2)
        mem = read_memory(p.pid)
        if mem is None:
            raise RuntimeError(f"cannot read /proc/{p.pid}")
        return mem
    finally:
        p.stdin.close()
        p.wait(30)


def model_bytes(hidden: list[int], model: str) -> int:
    """Parameters and buffers of the announced model x their element sizes."""
    from fedcore.models import build_model

    m = build_model(model, {"hidden": hidden} if model == "mlp" else {})
    return sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))


def data_bytes(indices: Iterable[int], seed: int) -> dict[int, int]:
    """The nbytes of each client's shard tensors (synthetic dataset, derived as the client derives it)."""
    import dataclasses

    import torch

    from fedcore.data import load_client_data

    out = {}
    for i in indices:
        d = load_client_data("synthetic", i, seed, {})
        out[i] = sum(v.nbytes for f in dataclasses.fields(d) if isinstance(v := getattr(d, f.name), torch.Tensor))
    return out


class Watch:
    """Follows a JSON-lines server log: the events so far."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos = path, 0
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1
        self.pos += end
        new = [json.loads(line) for line in chunk[:end].decode().splitlines() if line.startswith("{")]
        self.events.extend(new)
        return new

    def count(self, event: str) -> int:
        return sum(e["event"] == event for e in self.events)


def _wait_for(what: str, cond: Any, procs: list[subprocess.Popen[bytes]], timeout: float,
              tick: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process ended while waiting for {what}: {[p.poll() for p in procs]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        if tick is not None:
            tick()
        time.sleep(0.02)


@dataclass
class Sampled:
    """The largest of each figure of one process over the samples taken."""

    rss_anon: int = 0
    rss: int = 0
    threads: int = 0
    uss: int | None = None
    pss: int | None = None

    def add(self, m: Memory | None) -> None:
        if m is None:
            return
        self.rss_anon, self.rss, self.threads = max(self.rss_anon, m.rss_anon), max(self.rss, m.rss), max(
            self.threads, m.threads)
        if m.uss is not None:
            self.uss = max(self.uss or 0, m.uss)
        if m.pss is not None:
            self.pss = max(self.pss or 0, m.pss)


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        root = Path(__file__).resolve().parents[2]
        self.py = sys.executable
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
        self.logs: list[TextIO] = []

    def spawn(self, name: str, module: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115  (closed at the end)
        self.logs.append(log)
        env = {**self.env, "FEDGUARD_BENCH_MODULES": str(self.tmp / f"{name}.modules.json")}
        return subprocess.Popen([self.py, "-c", _WRAPPER, module, *argv], stdout=log, stderr=subprocess.STDOUT,
                                env=env)

    def modules(self, name: str) -> list[str] | None:
        path = self.tmp / f"{name}.modules.json"
        return json.loads(path.read_text()) if path.exists() else None

    def server(self, name: str, rounds: int, k: int, min_available: int) -> subprocess.Popen[bytes]:
        a = self.args
        address = f"127.0.0.1:{_free_port()}"
        self.address = address
        return self.spawn(name, "fedserver", [
            "--address", address, "--rounds", str(rounds), "-k", str(k), "--seed", str(a.seed),
            "--run-dir", str(self.tmp / f"{name}-run"), "--log-json", "--log-level", "info", "--linger", "2",
            "--min-available", str(min_available), "--model", a.model, "--insecure",
            "--set", "rounds.sampling_timeout_s=900",
            *(["--model-kwargs", json.dumps({"hidden": a.hidden})] if a.model == "mlp" else [])])

    def finish(self, procs: list[subprocess.Popen[bytes]], timeout: float = 300) -> list[int]:
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes

    def tail(self, name: str, lines: int = 15) -> str:
        return "\n".join((self.tmp / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])

    def client_process(self) -> tuple[Sampled, list[int]]:
        """(b): one fedclient process, sampled from the 3rd round's completion until it exits."""
        a = self.args
        server = self.server("server-b", a.rounds, 1, 1)
        watch = Watch(self.tmp / "server-b.log")
        client = self.spawn("client", "fedclient", [
            "--server", self.address, "--client-id", "bench-client", "--data-index", "0", "--trainer", "noop",
            "--torch-threads", "1", "--log-level", "warning", "--insecure"])
        steady = Sampled()
        _wait_for("the 3rd round", lambda: watch.count("round.completed") >= 3, [server, client], 300, watch.poll)
        while client.poll() is None:  # to its exit: the peaks are what count, and the last rounds are quick
            steady.add(read_memory(client.pid))
            time.sleep(0.01)
        codes = self.finish([client, server])
        if codes != [0, 0]:
            raise RuntimeError(f"(b) failed: client/server exit {codes}\n{self.tail('client')}\n"
                               f"{self.tail('server-b')}")
        return steady, codes

    def hosts(self) -> tuple[Sampled, Sampled, float, float]:
        """(c): hosts of N1 and N2 virtual clients in one federation; (steady N1, steady N2, N2's idle CPU
        fraction, seconds of the idle window)."""
        from fedlaunch.hosts import HostSpec, worker_command

        a = self.args
        n1, n2 = a.hosts
        server = self.server("server-c", a.host_rounds, min(a.k, n1 + n2), n1 + n2)
        watch = Watch(self.tmp / "server-c.log")
        cmd2 = worker_command(HostSpec(self.address, 0, n2, trainer="noop"), self.tmp / "host-n2.json")
        cmd1 = worker_command(HostSpec(self.address, n2, n1, trainer="noop"), self.tmp / "host-n1.json")
        host2 = self.spawn("host-n2", "fedlaunch", cmd2[3:])
        _wait_for(f"{n2} joins", lambda: watch.count("client.joined") >= n2, [server, host2], 600, watch.poll)
        time.sleep(1.0)  # the last joins' long-polls settle
        c0, t0 = cpu_seconds(host2.pid), time.monotonic()
        idle_mem = Sampled()
        while time.monotonic() - t0 < a.idle:
            idle_mem.add(read_memory(host2.pid))
            time.sleep(0.5)
        c1, t1 = cpu_seconds(host2.pid), time.monotonic()
        idle_cpu = ((c1 or 0.0) - (c0 or 0.0)) / (t1 - t0)
        self.idle_mem = idle_mem
        host1 = self.spawn("host-n1", "fedlaunch", cmd1[3:])
        procs = [server, host2, host1]
        _wait_for("the 2nd round", lambda: watch.count("round.completed") >= 2, procs, 600, watch.poll)
        s1, s2 = Sampled(), Sampled()
        while host1.poll() is None and host2.poll() is None:
            s1.add(read_memory(host1.pid))
            s2.add(read_memory(host2.pid))
            watch.poll()
            if watch.count("round.completed") >= a.host_rounds:
                break
            time.sleep(0.05)
        codes = self.finish([host1, host2, server])
        if codes != [0, 0, 0]:
            raise RuntimeError(f"(c) failed: hosts/server exit {codes}\n{self.tail('host-n1')}\n"
                               f"{self.tail('host-n2')}\n{self.tail('server-c')}")
        return s1, s2, idle_cpu, t1 - t0


def _self_anon() -> int:
    m = read_memory(os.getpid())
    assert m is not None
    return m.rss_anon


def top_lines(stats: Iterable[Any], root: str, n: int) -> list[tuple[str, int]]:
    """tracemalloc statistics ('traceback') grouped by the deepest frame in fedguard's own code (else the
    allocating frame): (file:line, bytes), the ``n`` largest."""
    by: dict[str, int] = {}
    for st in stats:
        own = [f for f in st.traceback if f.filename.startswith(root)]
        f = own[-1] if own else st.traceback[-1]
        key = f"{f.filename.removeprefix(root)}:{f.lineno}"
        by[key] = by.get(key, 0) + st.size
    return sorted(by.items(), key=lambda kv: -kv[1])[:n]


def decompose(bench: Bench, n: int) -> None:
    """Where one virtual client's memory goes: ``n`` clients in this process against a server that waits for more
    (so they stay parked), in steps; RssAnon deltas per client, tracemalloc for the Python part."""
    import gc
    import threading
    import tracemalloc

    import torch

    from fedclient import ClientConfig, FedClient
    from fedcore.data import load_client_data
    from fedcore.log import configure_logging
    from fedcore.models import build_model

    a = bench.args
    configure_logging(json=True, level="error")
    torch.set_num_threads(1)
    server = bench.server("server-e", 1, 1, 2 * n + 2)
    watch = Watch(bench.tmp / "server-e.log")
    kw: dict[str, Any] = {"server": bench.address, "trainer": "noop", "insecure": True, "log_level": "error"}
    warm = FedClient(ClientConfig(client_id="warm-up", data_index=2 * n + 1, **kw)).start()  # one-time costs
    _wait_for("the warm-up join", lambda: watch.count("client.joined") >= 1, [server], 120, watch.poll)
    time.sleep(1.0)
    rows: list[tuple[str, float]] = []
    gc.collect()
    m0 = _self_anon()
    release = threading.Event()
    threads = [threading.Thread(target=release.wait, daemon=True) for _ in range(2 * n)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    m1 = _self_anon()
    release.set()
    for t in threads:
        t.join()
    rows.append(("2 idle Python threads (the client's and gRPC's channel spin thread)", (m1 - m0) / n))
    gc.collect()
    m0 = _self_anon()
    apart = [(load_client_data("synthetic", i, a.seed, {}), build_model(a.model, {"hidden": a.hidden}
                                                                        if a.model == "mlp" else {}))
             for i in range(n)]
    gc.collect()
    m1 = _self_anon()
    rows.append(("model + data built apart (tensors, nn.Module objects, malloc)", (m1 - m0) / n))
    del apart
    tracemalloc.start(12)
    gc.collect()
    t0, m0 = tracemalloc.get_traced_memory()[0], _self_anon() - tracemalloc.get_tracemalloc_memory()
    clients = [FedClient(ClientConfig(client_id=f"parked-{i}", data_index=i, **kw)) for i in range(n)]
    for c in clients:
        c.start()
    _wait_for(f"{n} joins", lambda: watch.count("client.joined") >= n + 1, [server], 600, watch.poll)
    _wait_for("the clients' models and data", lambda: all(c.model is not None and c.data is not None
                                                          for c in clients), [server], 600)
    time.sleep(2.0)  # their long-polls settle
    gc.collect()
    t1, m1 = tracemalloc.get_traced_memory()[0], _self_anon() - tracemalloc.get_tracemalloc_memory()
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    rows.append(("a started, joined, parked FedClient (its model + data included)", (m1 - m0) / n))
    rows.append(("  of which Python objects (tracemalloc; nn.Module objects included)", (t1 - t0) / n))
    for c in [*clients, warm]:
        threading.Thread(target=c.stop, daemon=True).start()
    root = str(Path(__file__).resolve().parents[2]) + "/"
    server.terminate()
    bench.finish([server], 60)
    print(f"(e) where a virtual client's memory goes ({n} clients parked in this process; KiB per client)")
    for what, value in rows:
        _row(what, f"{value / 1024:.1f}")
    print("  largest Python allocations per client (tracemalloc, by fedguard's deepest frame):")
    for where, size in top_lines(snap.statistics("traceback"), root, 12):
        _row(f"  {where}", f"{size / n / 1024:.2f}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _row(what: str, value: str, target: str = "", result: str = "") -> None:
    print(f"  {what:<62} {value:>12} {target:>10} {result:>5}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mlp", help="the announced built-in model (default mlp)")
    ap.add_argument("--hidden", type=int, nargs="*", default=[64], help="MLP hidden widths (default 64)")
    ap.add_argument("--rounds", type=int, default=8, help="(b): rounds of the one-client federation")
    ap.add_argument("--hosts", type=int, nargs=2, default=[10, 510], metavar=("N1", "N2"),
                    help="(c): virtual clients of the two host processes")
    ap.add_argument("-k", type=int, default=10, help="(c): clients per round")
    ap.add_argument("--host-rounds", type=int, default=5, help="(c): rounds of the hosts' federation")
    ap.add_argument("--idle", type=float, default=10.0, help="(c): seconds the N2 host's idle CPU is measured")
    ap.add_argument("--seed", type=int, default=0, help="the federation's seed (the clients' shards)")
    ap.add_argument("--skip-hosts", action="store_true", help="measure (a), (b) and (d) only")
    ap.add_argument("--decompose", type=int, default=0, metavar="N",
                    help="(e): also break one virtual client's memory down, with N clients parked in this process")
    ap.add_argument("--figures", type=Path, metavar="PATH", default=None,
                    help="write (b)'s RssAnon beyond import torch + model + data and (c)'s per-virtual-client slope "
                         "into this figures file (docs/figures.toml: memory_client_process, memory_virtual_client)")
    args = ap.parse_args()
    if args.hosts[0] == args.hosts[1]:
        ap.error("--hosts: N1 and N2 must differ")
    if args.rounds < 6:
        ap.error("--rounds: at least 6 (steady state is sampled from the 3rd round on)")

    with TemporaryDirectory(prefix="fedguard-bench-memory-") as tmp_name:
        bench = Bench(args, Path(tmp_name))
        torch_only = import_baseline(bench.py, "torch", bench.env)
        baseline = import_baseline(bench.py, "torch, grpc, numpy", bench.env)
        n1, n2 = args.hosts
        model = model_bytes(args.hidden, args.model)
        shards = data_bytes([0, *range(n1 + n2)], args.seed)
        client, _ = bench.client_process()
        hosts = None if args.skip_hosts else bench.hosts()
        imported = {name: bench.modules(name) for name in ("server-b", "client", "host-n2")}
        report(args, torch_only, baseline, model, shards, client, hosts, imported)
        if args.figures is not None:
            update_figures(args.figures, figure_values(args, torch_only, model, shards, client, hosts))
        if args.decompose:
            decompose(bench, args.decompose)
        for log in bench.logs:
            log.close()
    return 0


def figure_values(args: argparse.Namespace, torch_only: Memory, model: int, shards: dict[int, int], client: Sampled,
                  hosts: tuple[Sampled, Sampled, float, float] | None) -> dict[str, str]:
    """docs/figures.toml's memory figures from this run: name -> value in MiB, as the pages write it."""
    out = {"memory_client_process": f"{beyond(client.rss_anon, torch_only.rss_anon, model, shards[0]) / MIB:.2f}"}
    if hosts is not None:
        n1, n2 = args.hosts
        s1, s2 = hosts[0], hosts[1]
        own1 = sum(model + shards[i] for i in range(n2, n2 + n1))
        own2 = sum(model + shards[i] for i in range(n2))
        out["memory_virtual_client"] = f"{per_client_slope(n1, s1.rss_anon, own1, n2, s2.rss_anon, own2) / MIB:.3f}"
    return out


def update_figures(path: Path, values: Mapping[str, str]) -> None:
    """Write ``values`` into the figures file ``path`` (tools/dev/figures.py), dated today."""
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from tools.dev import figures as figures_file

    for name, value in values.items():
        figures_file.update(path, name, value)
        print(f"{path}: {name} = {value}")


def report(args: argparse.Namespace, torch_only: Memory, baseline: Memory, model: int, shards: dict[int, int],
           client: Sampled, hosts: tuple[Sampled, Sampled, float, float] | None,
           imported: dict[str, list[str] | None]) -> None:
    n1, n2 = args.hosts

    print(f"fedguard memory (issue 30 item 5): {args.model} {args.hidden if args.model == 'mlp' else ''}, "
          f"synthetic data, no-op trainer, {os.cpu_count()} cores; MiB")
    _row("what", "MiB", "target", "")
    print("(a) import baselines (RssAnon / USS / PSS)")
    for name, m in (("python -c 'import torch'", torch_only), ("python -c 'import torch, grpc, numpy'", baseline)):
        _row(name, f"{mib(m.rss_anon)} / {mib(m.uss)} / {mib(m.pss)}")
    print(f"(b) one fedclient process, steady state (rounds 3..{args.rounds}, peaks)")
    _row("RssAnon / USS / PSS", f"{mib(client.rss_anon)} / {mib(client.uss)} / {mib(client.pss)}")
    _row("model bytes (parameters + buffers x element size)", f"{model / MIB:.4f}")
    _row("data bytes (shard 0's tensors)", f"{shards[0] / MIB:.4f}")
    for label, base in (("import torch", torch_only), ("import torch, grpc, numpy", baseline)):
        b = beyond(client.rss_anon, base.rss_anon, model, shards[0])
        _row(f"RssAnon beyond {label} + model + data", mib(b), f"{CLIENT_TARGET_MIB:.0f}",
             verdict(b / MIB, CLIENT_TARGET_MIB))
    _row("threads", str(client.threads))
    if hosts is not None:
        s1, s2, idle_cpu, window = hosts
        own1 = sum(model + shards[i] for i in range(n2, n2 + n1))
        own2 = sum(model + shards[i] for i in range(n2))
        print(f"(c) virtual clients: hosts of N1 = {n1} and N2 = {n2} (rounds 2..{args.host_rounds}, peaks)")
        _row(f"host N1 RssAnon / USS (model + data {own1 / MIB:.2f})", f"{mib(s1.rss_anon)} / {mib(s1.uss)}")
        _row(f"host N2 RssAnon / USS (model + data {own2 / MIB:.2f})", f"{mib(s2.rss_anon)} / {mib(s2.uss)}")
        slope = per_client_slope(n1, s1.rss_anon, own1, n2, s2.rss_anon, own2)
        _row("per virtual client, RssAnon beyond model + data", f"{slope / MIB:.3f}", f"{VIRTUAL_TARGET_MIB:.0f}",
             verdict(slope / MIB, VIRTUAL_TARGET_MIB))
        if s1.uss is not None and s2.uss is not None:
            slope_u = per_client_slope(n1, s1.uss, own1, n2, s2.uss, own2)
            _row("per virtual client, USS beyond model + data", f"{slope_u / MIB:.3f}", f"{VIRTUAL_TARGET_MIB:.0f}",
                 verdict(slope_u / MIB, VIRTUAL_TARGET_MIB))
        _row("per virtual client, model + data (mean)", f"{(own2 - own1) / (n2 - n1) / MIB:.4f}")
        _row(f"threads: host N1 {s1.threads}, host N2 {s2.threads}; per virtual client",
             f"{(s2.threads - s1.threads) / (n2 - n1):.2f}")
        _row(f"host N2 idle CPU (clients parked, {window:.0f} s), % of one core", f"{100 * idle_cpu:.2f}")
        _row("  per virtual client, ms of CPU per second", f"{1000 * idle_cpu / n2:.4f}")
    print("(d) heavy modules in sys.modules at exit")
    for name, label in (("server-b", "fedserver"), ("client", "fedclient"), ("host-n2", "fedlaunch worker")):
        mods = imported[name]
        found = "(not recorded)" if mods is None else (", ".join(heavy_imports(mods)) or "none")
        _row(f"{label}: {found}", "", "none", "n/a" if mods is None else
             ("PASS" if not heavy_imports(mods, ("torchvision", "matplotlib", "ray")) else "MISS"))


if __name__ == "__main__":
    sys.exit(main())
