"""What transport security costs and what the stream limits save, one measurement per subcommand.

  flood      Rounds completed per minute of K = -k honest no-op fedclient processes (fedserver subprocess,
             plaintext, a shared token from a token file) in a --window before and a --window from the moment one
             holder of the token joins --ids made-up client ids over one channel, each followed by one zero-wait
             poll (the server then counts it ready) and silence. Counts rows of the run dir's rounds.jsonl.

  transport  Plaintext vs TLS vs mutual TLS, side by side in one run (absolute times on a small VM drift; the
             ratios are what to read).
             Join latency: one fedserver.ServerThread per mode (a federation that never starts a round: it
             waits for 10^6 clients), then --joins fresh joins per mode, the modes in
             rotation join by join: a new channel with the mode's credentials (its own subchannel, so a new
             TCP connection and TLS handshake each time), Join with a new client id, the time until the
             JoinReply arrives, close. Median and p90 per mode, and the ratio to plaintext.
             Per-round overhead: a federation of K = -k no-op clients (trainer "noop", FedClient threads of this
             process, mlp on synthetic data) on a ServerThread for --rounds rounds, per mode; the modes run in
             rotation --repeats times (the first mode of each repetition rotating too) and the rounds are pooled
             per mode. A round's time is RoundReport.seconds (round start -> aggregated; round 1 skipped).
             Median and p90 per mode, the ratio to plaintext and the overhead per round in ms; the medians of
             each federation show the federation-to-federation spread (several ms here): a difference between
             modes smaller than that spread is no difference (--repeats 10 narrows it).
             Modes: plaintext = security.insecure on both sides; tls = the server has tls_cert/tls_key and a
             client verifies it with ca_cert only; mtls = the server also has client_ca and every client
             presents its own certificate (the client id is the certificate's). Certificates: a throw-away CA
             (fedlaunch.credentials.make_tls_dir, ECDSA P-256). persistence.enabled is off in these federations (it is
             the same in every mode and only adds noise). Channels are long-lived (one per client for the
             whole federation), so a round pays no handshake: only the record encryption of the model and
             update bytes.

  stalled    The server's memory under 40 stalled uploads: `python -m fedserver` as a subprocess of the source
             tree --tree (PYTHONPATH=TREE, cwd=TREE; plaintext; --insecure only where that server knows it, and
             server.stream_idle_timeout_s=--idle only where its configuration has the field), so that its RSS
             (VmRSS of /proc/PID/status) is its own. A model big enough for a partial update to matter (mlp with
             --hidden, default 2048 2048: ~17 MB of float32). Raw gRPC: join the session(s), mark them ready,
             pull the round's model, then start --uploads uploads that each send the UpdateHeader and the first
             half of the chunks (so the pages of the server's buffer are really written) and then stall.
             Scenario "one": all uploads from one session (K = 1); "many": each from its own session
             (K = min_available = --uploads). RSS: baseline (sessions joined, model pulled, before the uploads;
             median of 5 samples), peak (sampled every 0.2 s from the first upload until --window s after the
             last one stalled), after the idle timeout (--idle + 3 s after the last stall), and after the
             stalled streams are released (they end short; the server refuses each truncated update, which
             may restart the round: what it does then is counted too). Uploads that end before the stall
             window closes are "refused at once", with their status codes. RSS is what the kernel charges:
             memory the server has freed but its allocator keeps (glibc returns freed pages in the middle of
             its heap only on malloc_trim) still counts, so a drop after the idle timeout can be smaller than
             the buffers released.

    python tools/bench/bench_security.py transport                        # K = 10, 30 rounds x 3 repetitions, 30 joins
    python tools/bench/bench_security.py transport --rounds 50 --repeats 5 --joins 100
    git worktree add /tmp/fg-before 6bf967d                         # the server before the stream limits
    python tools/bench/bench_security.py stalled --tree /tmp/fg-before --tree .
    python tools/bench/bench_security.py stalled --scenario one --hidden 4096 2048 --idle 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
MODES = ("plaintext", "tls", "mtls")
SERVICE = "/fedguard.v1.Federation/"
MB = 1e6


def _pct(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` (nearest rank)."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- transport: plaintext vs TLS vs mutual TLS ----

def _server_security(mode: str, tls_dir: Path) -> dict[str, Any]:
    if mode == "plaintext":
        return {"insecure": True}
    sec = {"tls_cert": str(tls_dir / "server.pem"), "tls_key": str(tls_dir / "server.key")}
    if mode == "mtls":
        sec["client_ca"] = str(tls_dir / "ca.pem")
    return sec


def _client_security(mode: str, tls_dir: Path, cid: str) -> dict[str, Any]:
    from fedlaunch.credentials import client_tls_options

    if mode == "plaintext":
        return {"insecure": True}
    if mode == "tls":
        return {"ca_cert": str(tls_dir / "ca.pem")}
    return client_tls_options(tls_dir, cid)


def _server_config(run_dir: Path, security: dict[str, Any], **sections: dict[str, Any]) -> Any:
    from fedcore.config import ServerConfig, build_config

    overrides: list[tuple[list[str], Any]] = [
        (["server", "address"], "127.0.0.1:0"), (["server", "run_dir"], str(run_dir)),
        (["server", "log_level"], "error"), (["model", "name"], "mlp"), (["data", "dataset"], "synthetic"),
        (["persistence", "enabled"], False)]
    overrides += [(["security", k], v) for k, v in security.items()]
    overrides += [([section, k], v) for section, values in sections.items() for k, v in values.items()]
    return build_config(ServerConfig, None, overrides)


def _channel_credentials(mode: str, tls_dir: Path, cid: str) -> Any:
    import grpc

    if mode == "plaintext":
        return None
    ca = (tls_dir / "ca.pem").read_bytes()
    if mode == "tls":
        return grpc.ssl_channel_credentials(ca)
    return grpc.ssl_channel_credentials(ca, (tls_dir / "clients" / f"{cid}.key").read_bytes(),
                                        (tls_dir / "clients" / f"{cid}.pem").read_bytes())


def _join_once(mode: str, address: str, creds: Any, cid: str) -> float:
    """Seconds from a new channel to the JoinReply (connection and handshake included); the channel is closed."""
    import grpc

    from fedguard.v1 import fedguard_pb2 as pb

    opts = [("grpc.use_local_subchannel_pool", 1)]  # never reuse another channel's connection
    t0 = time.perf_counter()
    ch = grpc.insecure_channel(address, options=opts) if creds is None else \
        grpc.secure_channel(address, creds, options=opts)
    try:
        join = ch.unary_unary(SERVICE + "Join", request_serializer=pb.JoinRequest.SerializeToString,
                              response_deserializer=pb.JoinReply.FromString)
        reply = join(pb.JoinRequest(client_id=cid), timeout=10)
        elapsed = time.perf_counter() - t0
    finally:
        ch.close()
    if not reply.session_id:
        raise SystemExit(f"transport: {mode} join of {cid} got no session")
    return elapsed


def bench_joins(args: argparse.Namespace, tls_dir: Path, tmp: Path) -> dict[str, list[float]]:
    from fedserver import ServerThread

    servers = {}
    for mode in MODES:
        # A federation that never starts a round: it waits for 10^6 clients (for an hour).
        cfg = _server_config(tmp / f"join-{mode}", _server_security(mode, tls_dir),
                             rounds={"num_rounds": 1000, "clients_per_round": 1_000_000,
                                     "sampling_timeout_s": 3600.0})
        servers[mode] = ServerThread(cfg, linger_s=0.1).start()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for i in range(-2, args.joins):  # two untimed warm-up joins per mode
            order = MODES[i % 3:] + MODES[:i % 3]
            for mode in order:
                cid = f"joiner-{i + 2:04d}"
                t = _join_once(mode, servers[mode].address, _channel_credentials(mode, tls_dir, cid), cid)
                if i >= 0:
                    times[mode].append(t)
    finally:
        for srv in servers.values():
            srv.stop()
    return times


def run_federation(mode: str, args: argparse.Namespace, tls_dir: Path, run_dir: Path) -> list[float]:
    """One federation of K no-op clients in ``mode``; RoundReport.seconds of rounds 2..R."""
    from fedclient import ClientConfig, FedClient
    from fedserver import ServerThread

    cfg = _server_config(run_dir, _server_security(mode, tls_dir),
                         rounds={"num_rounds": args.rounds, "clients_per_round": args.k})
    srv = ServerThread(cfg, linger_s=0.5).start()
    clients = [FedClient(ClientConfig(server=srv.address, client_id=f"client-{i}", data_index=i, trainer="noop",
                                      long_poll_s=5.0, torch_threads=1,
                                      **_client_security(mode, tls_dir, f"client-{i}"))).start()
               for i in range(args.k)]
    status = None
    try:
        status = srv.wait(300)
    finally:
        for c in clients:
            if status is None:
                c.stop(10)
            else:
                c.join(30)
        if status is None:
            srv.stop()
    if status is None or not status.finished or status.outcome != "completed" or len(status.history) != args.rounds:
        raise SystemExit(f"transport: the {mode} federation did not complete: {status}")
    return [r.seconds for r in status.history if r.round > 1]


def bench_transport(args: argparse.Namespace) -> None:
    import grpc
    import torch

    from fedcore.log import configure_logging
    from fedcore.models import build_model
    from fedlaunch.credentials import make_tls_dir

    configure_logging(level="error")
    torch.set_num_threads(1)
    if args.rounds < 2:
        raise SystemExit("transport: --rounds must be >= 2 (round 1 is not counted)")
    params = sum(p.numel() for p in build_model("mlp", {}).state_dict().values())
    t_begin = time.monotonic()
    print(f"transport: plaintext / tls (server certificate, verified with the CA) / mtls (client certificates "
          f"too); ECDSA P-256 certificates; grpcio {grpc.__version__}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(dir=args.dir) as name:
        tmp = Path(name)
        tls_dir = make_tls_dir([f"client-{i}" for i in range(args.k)] +
                               [f"joiner-{i:04d}" for i in range(args.joins + 2)], tmp / "tls")
        joins = bench_joins(args, tls_dir, tmp)
        rounds: dict[str, list[float]] = {m: [] for m in MODES}
        per_rep: list[dict[str, float]] = []
        for rep in range(args.repeats):
            medians: dict[str, float] = {}
            for mode in MODES[rep % 3:] + MODES[:rep % 3]:
                secs = run_federation(mode, args, tls_dir, tmp / f"fed-{rep}-{mode}")
                rounds[mode] += secs
                medians[mode] = statistics.median(secs)
            per_rep.append(medians)

    def summary(values: dict[str, list[float]], scale: float, digits: int) -> str:
        base = statistics.median(values["plaintext"])
        parts = []
        for mode in MODES:
            med, p90 = statistics.median(values[mode]), _pct(values[mode], 0.9)
            part = f"{mode} {med * scale:.{digits}f}/{p90 * scale:.{digits}f}"
            if mode != "plaintext":
                part += f" ({med / base:.2f}x)"
            parts.append(part)
        return ", ".join(parts)

    n_joins = len(joins["plaintext"])
    print(f"join latency (ms, median/p90 over {n_joins}): {summary(joins, 1e3, 2)}")
    jbase = statistics.median(joins["plaintext"])
    print("join overhead vs plaintext (median): " + ", ".join(
        f"{m} {(statistics.median(joins[m]) - jbase) * 1e3:+.2f} ms" for m in MODES[1:]))
    n_rounds = len(rounds["plaintext"])
    print(f"per-round seconds (K = {args.k}, noop, mlp {params:,} parameters, median/p90 over {n_rounds} rounds): "
          f"{summary(rounds, 1.0, 4)}")
    rbase, rbase90 = statistics.median(rounds["plaintext"]), _pct(rounds["plaintext"], 0.9)

    def mean_diff(mode: str) -> str:
        a, b = rounds[mode], rounds["plaintext"]
        ci = 1.96 * (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
        return f"mean {(statistics.fmean(a) - statistics.fmean(b)) * 1e3:+.1f} ± {ci * 1e3:.1f} ms"

    print("per-round overhead vs plaintext: " + "; ".join(
        f"{m} {(statistics.median(rounds[m]) - rbase) * 1e3:+.1f} ms median, "
        f"{(_pct(rounds[m], 0.9) - rbase90) * 1e3:+.1f} ms p90, {mean_diff(m)}" for m in MODES[1:])
          + " (± = 95 %, rounds taken as independent)")
    for rep, medians in enumerate(per_rep, 1):
        order = MODES[(rep - 1) % 3:] + MODES[:(rep - 1) % 3]
        print(f"  repetition {rep} (order {'/'.join(order)}), median s per round: " +
              ", ".join(f"{m} {medians[m]:.4f}" for m in MODES))
    print(f"join = new channel -> JoinReply (TCP connect + TLS handshake + one call), modes interleaved join by "
          f"join; round = RoundReport.seconds (round start -> aggregated), {args.rounds - 1} rounds per federation "
          f"x {args.repeats} repetitions per mode, modes in rotation; whole run {time.monotonic() - t_begin:.1f} s")


# ---- stalled: the server's RSS under stalled uploads, from a subprocess of any source tree ----

def _status_kb(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _rss_mb(pid: int) -> float:
    kb = _status_kb(pid, "VmRSS")
    if kb is None:
        raise SystemExit(f"stalled: the server (pid {pid}) is gone")
    return kb * 1024 / MB


@dataclass
class Upload:
    stalled_at: float | None = None  # when the generator had handed its half to gRPC and began to wait
    ended_at: float | None = None
    code: str = ""
    details: str = ""


@dataclass
class Stalled:
    tree: str
    scenario: str
    uploads: int
    total_bytes: int
    sent_bytes: int
    idle: float | None  # the server's stream idle timeout (None: the server has none)
    baseline: float = 0.0
    peak: float = 0.0
    after_idle: float = 0.0
    after_release: float = 0.0
    hwm: float = 0.0
    results: list[Upload] = field(default_factory=list)
    stall_window_end: float = 0.0
    released_at: float = 0.0


def _server_features(tree: Path, env: dict[str, str]) -> tuple[bool, bool]:
    """(knows --insecure, has server.stream_idle_timeout_s) for the fedserver of ``tree``."""
    py = sys.executable
    help_text = subprocess.run([py, "-m", "fedserver", "--help"], cwd=tree, env=env, capture_output=True,
                               text=True, timeout=120).stdout
    insecure = "--insecure" in help_text
    printed = subprocess.run([py, "-m", "fedserver", "--print-config", *(["--insecure"] if insecure else [])],
                             cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    if printed.returncode != 0:
        raise SystemExit(f"stalled: {tree}: fedserver --print-config failed: {printed.stderr[-500:]}")
    return insecure, "stream_idle_timeout_s" in printed.stdout


def _stalling(header: Any, payload: bytes, chunk: int, upload: Upload, release: threading.Event) -> Iterator[Any]:
    from fedguard.v1 import fedguard_pb2 as pb

    yield pb.UpdateMessage(header=header)
    half = len(payload) // 2
    for off in range(0, half, chunk):
        yield pb.UpdateMessage(chunk=pb.Chunk(offset=off, data=payload[off:min(off + chunk, half)]))
    upload.stalled_at = time.monotonic()
    release.wait(600)


def run_stalled(tree: Path, scenario: str, args: argparse.Namespace) -> Stalled:
    import grpc

    from fedguard.v1 import fedguard_pb2 as pb

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)}
    insecure, has_idle = _server_features(tree, env)
    sessions_n = 1 if scenario == "one" else args.uploads
    address = f"127.0.0.1:{_free_port()}"
    py = sys.executable
    release = threading.Event()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        cmd = [py, "-m", "fedserver", "--address", address, "--run-dir", str(Path(tmp) / "run"), "--rounds", "1",
               "-k", str(sessions_n), "--min-available", str(sessions_n), "--round-timeout", "3600",
               "--model", "mlp", "--model-kwargs", json.dumps({"in_features": 60, "hidden": args.hidden}),
               "--dataset", "synthetic", "--log-json", "--log-level", "warning", "--linger", "0",
               "--set", "server.heartbeat_patience_s=3600", "--set", "rounds.sampling_timeout_s=3600"]
        if insecure:
            cmd.append("--insecure")
        if has_idle:
            cmd += ["--set", f"server.stream_idle_timeout_s={args.idle}"]
        log_path = Path(tmp) / "server.log"
        log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 (closed below)
        server = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
        ch = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                     ("grpc.max_send_message_length", 64 << 20)])
        try:
            try:
                grpc.channel_ready_future(ch).result(timeout=120)
            except grpc.FutureTimeoutError:
                raise SystemExit(f"stalled: {tree}: the server did not come up") from None
            join = ch.unary_unary(SERVICE + "Join", request_serializer=pb.JoinRequest.SerializeToString,
                                  response_deserializer=pb.JoinReply.FromString)
            pull = ch.unary_stream(SERVICE + "PullTask", request_serializer=pb.PullTaskRequest.SerializeToString,
                                   response_deserializer=pb.TaskMessage.FromString)
            push = ch.stream_unary(SERVICE + "PushUpdate", request_serializer=pb.UpdateMessage.SerializeToString,
                                   response_deserializer=pb.PushReply.FromString)
            sessions = [join(pb.JoinRequest(client_id=f"staller-{i:03d}"), timeout=30).session_id
                        for i in range(sessions_n)]
            for sid in sessions:  # a zero-wait poll: the session counts as available
                list(pull(pb.PullTaskRequest(session_id=sid, max_wait_s=0.0), timeout=30))
            header: Any = None
            payload = b""
            for sid in sessions:  # every session pulls its task (the same model); the first one's bytes are kept
                msgs = list(pull(pb.PullTaskRequest(session_id=sid, max_wait_s=10.0), timeout=60))
                if msgs[0].WhichOneof("kind") != "header":
                    raise SystemExit(f"stalled: {tree}: no task for session {sid[:8]}: {msgs[0]}")
                if header is None:
                    header = msgs[0].header
                    payload = b"".join(m.chunk.data for m in msgs[1:])
            assert header is not None and len(payload) == header.total_bytes
            time.sleep(1.0)
            samples = []
            for _ in range(5):
                samples.append(_rss_mb(server.pid))
                time.sleep(0.2)
            res = Stalled(str(tree), scenario, args.uploads, len(payload),
                          sum(min(args.chunk, len(payload) // 2 - o) for o in range(0, len(payload) // 2, args.chunk)),
                          args.idle if has_idle else None, baseline=statistics.median(samples))
            futures = []
            for i in range(args.uploads):
                up = Upload()
                res.results.append(up)
                h = pb.UpdateHeader(session_id=sessions[i % sessions_n], round=header.round, num_samples=10,
                                    train_loss=0.5, kind=pb.WEIGHTS, tensors=header.tensors,
                                    total_bytes=header.total_bytes)
                fut = push.future(_stalling(h, payload, args.chunk, up, release), timeout=3600)

                def done(f: Any, up: Upload = up) -> None:
                    up.ended_at = time.monotonic()
                    err = f.exception()
                    if err is None:
                        up.code = "OK"
                    else:
                        up.code = err.code().name
                        up.details = str(err.details() or "")

                fut.add_done_callback(done)
                futures.append(fut)
            peak = res.baseline
            deadline = time.monotonic() + 300
            while True:  # until every upload stalled or ended, then --window more seconds
                peak = max(peak, _rss_mb(server.pid))
                if all(u.stalled_at is not None or u.ended_at is not None for u in res.results):
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"stalled: {tree}: the uploads did not stall within 300 s")
                time.sleep(0.2)
            last_stall = max([u.stalled_at for u in res.results if u.stalled_at is not None] or [time.monotonic()])
            res.stall_window_end = last_stall + args.window
            while time.monotonic() < res.stall_window_end:
                peak = max(peak, _rss_mb(server.pid))
                time.sleep(0.2)
            res.peak = peak
            time.sleep(max(0.0, last_stall + args.idle + 3.0 - time.monotonic()))
            res.after_idle = _rss_mb(server.pid)
            res.released_at = time.monotonic()
            release.set()
            for fut in futures:
                with contextlib.suppress(Exception):
                    fut.exception(timeout=60)
            time.sleep(1.0)
            res.after_release = _rss_mb(server.pid)
            res.hwm = (_status_kb(server.pid, "VmHWM") or 0) * 1024 / MB
            return res
        except BaseException:
            tail = "\n  ".join(log_path.read_text(errors="replace").splitlines()[-10:])
            print(f"stalled: server log tail ({tree}):\n  {tail}", file=sys.stderr)
            raise
        finally:
            release.set()
            ch.close()
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(20)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            log.close()


def report_stalled(r: Stalled) -> None:
    def ended_by(t: float) -> list[Upload]:
        return [u for u in r.results if u.ended_at is not None and u.ended_at <= t]

    refused = ended_by(r.stall_window_end)
    cancelled = [u for u in ended_by(r.released_at) if u not in refused]
    still_open = len(r.results) - len(refused) - len(cancelled)
    codes = Counter(u.code for u in refused)
    code_text = ", ".join(f"{c} {n}" if len(codes) > 1 else c for c, n in codes.most_common()) or "-"
    who = "one session" if r.scenario == "one" else f"{r.uploads} sessions"
    print(f"stalled ({who}, tree={r.tree}): {r.uploads} uploads of {r.sent_bytes / MB:.1f} MB each (of "
          f"{r.total_bytes / MB:.1f} MB), refused at once {len(refused)} ({code_text}), rss baseline "
          f"{r.baseline:.0f} MB, peak {r.peak:.0f} MB, after idle timeout {r.after_idle:.0f} MB")
    idle = f"{r.idle:g} s" if r.idle is not None else "none (no server.stream_idle_timeout_s in this tree)"
    cancel_codes = Counter(u.code for u in cancelled)
    print(f"    stream idle timeout: {idle}; ended after the stall window, before the release: {len(cancelled)}"
          f"{' (' + ', '.join(f'{c} {n}' for c, n in cancel_codes.most_common()) + ')' if cancelled else ''}; "
          f"still open at the release: {still_open}; peak - baseline {r.peak - r.baseline:+.0f} MB, after idle "
          f"timeout - baseline {r.after_idle - r.baseline:+.0f} MB; after the release {r.after_release:.0f} MB; "
          f"VmHWM {r.hwm:.0f} MB")
    details = sorted({u.details.split(";")[0][:90] for u in refused + cancelled if u.details})
    if details:
        print(f"    reasons: {' | '.join(details)}")


def bench_stalled(args: argparse.Namespace) -> None:
    trees = [Path(t).resolve() for t in (args.tree or [str(ROOT)])]
    if args.window >= args.idle:
        raise SystemExit("stalled: --window must be shorter than --idle (or idle cancellations count as refusals)")
    scenarios = ["one", "many"] if args.scenario == "both" else [args.scenario]
    print(f"stalled: fedserver subprocess per tree and scenario (plaintext, mlp hidden {args.hidden} on synthetic "
          f"data); {args.uploads} uploads, each the header + the first half of the chunks ({args.chunk} B each), "
          f"then a stall; RSS = VmRSS of the server, MB = 10^6 bytes; peak sampled every 0.2 s until {args.window:g}"
          f" s after the last stall; 'after idle timeout' = {args.idle:g} + 3 s after the last stall")
    for tree in trees:
        for scenario in scenarios:
            report_stalled(run_stalled(tree, scenario, args))


# ---- flood: a token holder joins hundreds of made-up client ids ----

def _rounds_done(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.startswith("{"))
    except OSError:
        return 0


def _flood(address: str, token: str, ids: int, poll: bool) -> tuple[int, int, float]:
    """Join ``ids`` made-up client ids with the shared token from one channel (each followed by one zero-wait
    poll when ``poll``: the server then counts it as ready); (joined, refused, seconds)."""
    import grpc

    from fedguard.v1 import fedguard_pb2 as pb

    joined = refused = 0
    started = time.monotonic()
    with grpc.insecure_channel(address) as ch:
        join = ch.unary_unary(SERVICE + "Join", pb.JoinRequest.SerializeToString, pb.JoinReply.FromString)
        pull = ch.unary_stream(SERVICE + "PullTask", pb.PullTaskRequest.SerializeToString,
                               pb.TaskMessage.FromString)
        for i in range(ids):
            try:
                reply = join(pb.JoinRequest(client_id=f"fake-{i}", token=token), timeout=10)
                joined += 1
                if poll:
                    list(pull(pb.PullTaskRequest(session_id=reply.session_id, max_wait_s=0.0), timeout=10))
            except grpc.RpcError:
                refused += 1
    return joined, refused, time.monotonic() - started


def bench_flood(args: argparse.Namespace) -> None:
    """Rounds completed per minute by K honest no-op fedclient processes, in a window before and in a window
    right after one token holder joins --ids made-up client ids (each polling once, then silent)."""
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t = Path(tmp)
        run_dir = t / "run"
        token_file = t / "token"
        token = "flood-bench-" + os.urandom(8).hex()
        token_file.write_text(token + "\n")
        address = f"127.0.0.1:{_free_port()}"
        server = subprocess.Popen(
            [py, "-m", "fedserver", "--address", address, "--rounds", "100000", "-k", str(args.k), "--run-dir",
             str(run_dir), "--token-file", str(token_file), "--insecure", "--log-level", args.log_level,
             "--round-timeout", str(args.round_timeout), "--model", "mlp", "--dataset", "synthetic"],
            stdout=open(t / "server.log", "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
        clients = [subprocess.Popen(
            [py, "-m", "fedclient", "--server", address, "--client-id", f"honest-{i}", "--data-index", str(i),
             "--token-file", str(token_file), "--trainer", "noop", "--torch-threads", "1", "--log-level", "warning",
             "--insecure"], stdout=open(t / f"client-{i}.log", "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
            for i in range(args.k)]
        try:
            deadline = time.monotonic() + 120
            while _rounds_done(run_dir) < 3:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("flood: the federation did not start:\n" + (t / "server.log").read_text()[-3000:])
                time.sleep(0.2)
            r0, t0 = _rounds_done(run_dir), time.monotonic()
            time.sleep(args.window)
            r1, t1 = _rounds_done(run_dir), time.monotonic()
            joined, refused, flood_s = _flood(address, token, args.ids, poll=True)
            time.sleep(max(0.0, args.window - flood_s))
            r2, t2 = _rounds_done(run_dir), time.monotonic()
            gaps: list[float] = []
        finally:
            for p in [*clients, server]:
                p.send_signal(signal.SIGTERM)
            for p in [*clients, server]:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()
                if line.startswith("{")]
        gaps = [float(r.get("seconds", 0.0)) for r in rows[r1:r2]]
    before = (r1 - r0) * 60 / (t1 - t0)
    during = (r2 - r1) * 60 / (t2 - t1)
    print(f"flood: K = {args.k} honest no-op fedclient processes, fedserver (plaintext, mlp on synthetic data, "
          f"round_timeout {args.round_timeout:g} s); windows of {args.window:g} s")
    print(f"    without flood: {r1 - r0} rounds in {t1 - t0:.1f} s = {before:.0f} rounds/min")
    print(f"    flood: {joined} made-up ids joined ({refused} refused) and polled once in {flood_s:.1f} s by one "
          f"token holder")
    print(f"    during/after the flood: {r2 - r1} rounds in {t2 - t1:.1f} s = {during:.0f} rounds/min; slowest "
          f"round {max(gaps, default=float('nan')):.2f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    tr = sub.add_parser("transport", help="join latency and per-round time: plaintext vs TLS vs mutual TLS")
    tr.add_argument("-k", type=int, default=10, help="clients per round K (= clients)")
    tr.add_argument("--rounds", type=int, default=30, help="rounds per federation (round 1 is not counted)")
    tr.add_argument("--repeats", type=int, default=3, help="federations per mode, modes in rotation")
    tr.add_argument("--joins", type=int, default=30, help="timed fresh joins per mode")
    tr.add_argument("--dir", default=None, help="where the temp run dirs go (default: the system temp dir)")
    tr.set_defaults(func=bench_transport)
    st = sub.add_parser("stalled", help="server RSS under stalled uploads (a fedserver subprocess per tree)")
    st.add_argument("--tree", action="append", default=None,
                    help="source tree whose fedserver runs (repeatable; default: this repository)")
    st.add_argument("--scenario", choices=["one", "many", "both"], default="both",
                    help="all uploads from one session, each from its own session, or both")
    st.add_argument("--uploads", type=int, default=40, help="stalled uploads")
    st.add_argument("--hidden", type=int, nargs="+", default=[2048, 2048], help="MLP hidden widths (model size)")
    st.add_argument("--idle", type=float, default=10.0,
                    help="server.stream_idle_timeout_s for a server that has it; s")
    st.add_argument("--window", type=float, default=3.0, help="seconds of peak sampling after the last stall")
    st.add_argument("--chunk", type=int, default=1 << 20, help="bytes per chunk message")
    st.add_argument("--dir", default=None, help="where the temp run dir goes (default: the system temp dir)")
    st.set_defaults(func=bench_stalled)
    fl = sub.add_parser("flood", help="rounds per minute before and during a join flood of made-up client ids")
    fl.add_argument("-k", type=int, default=2, help="honest clients = K")
    fl.add_argument("--ids", type=int, default=500, help="made-up client ids joined by one token holder")
    fl.add_argument("--window", type=float, default=30.0, help="seconds of each measuring window")
    fl.add_argument("--round-timeout", type=float, default=60.0, help="rounds.round_timeout_s")
    fl.add_argument("--dir", default=None, help="where the temp run dir goes (default: the system temp dir)")
    fl.add_argument("--log-level", default="warning", help="the server's log level (its log is in the temp dir)")
    fl.set_defaults(func=bench_flood)
    args = ap.parse_args(argv)
    if str(ROOT) not in sys.path:  # run as a script: fedlaunch is imported from this repository
        sys.path.insert(0, str(ROOT))
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
