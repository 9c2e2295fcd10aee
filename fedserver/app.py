"""Serve a federation: gRPC server + coordinator on one event loop, in the foreground (:func:`serve`, a coroutine)
or in a thread (:class:`ServerThread`, the embedding API: the global model(s), the latest round report, waiting for
a round, stop; docs/embedding.md)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from torch import nn

from fedcore.config import ConfigError, ServerConfig
from fedcore.log import get_logger
from fedcore.models import build_model
from fedcore.report import FederationStatus, RoundReport
from fedserver import event_loop
from fedserver.coordinator import Coordinator
from fedserver.framed import AUTO, WAYS_OUT, FramedServer, framed_address
from fedserver.global_models import GLOBAL
from fedserver.persistence import StoreOpener, open_store
from fedserver.rundir import RunDirLock
from fedserver.servicer import FederationServicer, add_to_server, set_serving

# The server pings every connection this often, and drops one that does not answer within KEEPALIVE_TIMEOUT_S.
KEEPALIVE_S = 20
KEEPALIVE_TIMEOUT_S = 10


def grpc_options(config: ServerConfig) -> list[tuple[str, Any]]:
    limit = config.server.max_message_bytes
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        # Liveness of a connection whose clients sit in long-polls, in gRPC's core instead of application re-polls:
        # a peer that does not answer a ping within 10 s is disconnected (its parked calls end, so it is no longer
        # counted as connected), whatever server.long_poll_s.
        ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
        ("grpc.http2.max_pings_without_data", 0),
        # The backlog of calls not yet taken up by the event loop: one bound, no random early cancelling below it
        # (gRPC's default cancels from 1,000 pending calls on: a fleet's Leaves when the federation ends).
        ("grpc.server.max_pending_requests", config.server.max_pending_calls),
        ("grpc.server.max_pending_requests_hard_limit", config.server.max_pending_calls),
    ]


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    sec = config.security
    try:
        cert, key = Path(sec.tls_cert).read_bytes(), Path(sec.tls_key).read_bytes()
        ca = Path(sec.client_ca).read_bytes() if sec.client_ca else None
    except OSError as e:
        raise ConfigError("security.tls_cert", f"cannot read {e.filename}: {e.strerror}") from None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def check_port_free(address: str, field: str = "server.address") -> None:
    """:class:`ConfigError` naming ``field`` (``server.address``) when its port cannot be bound (in use, no such local
    address): checked with a plain socket first, so the refusal is one line instead of gRPC's core log."""
    host, _, port_s = address.rpartition(":")
    host = host.strip("[]")
    port = int(port_s)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(field, f"cannot resolve {host!r}: {e.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with contextlib.closing(socket.socket(family, kind, proto)) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as e:
            in_use = e.errno == errno.EADDRINUSE
            reason = "is in use by another process" if in_use else f"cannot be bound ({e.strerror})"
            ways = "pick another with --address HOST:PORT (port 0 picks a free one)" if field == "server.address" \
                else WAYS_OUT
            raise ConfigError(field, f"port {port} on {host or '*'} {reason}; {ways}") from None


def listen(server: grpc.aio.Server, config: ServerConfig) -> int:
    """Bind the configured address: TLS (mutual with ``security.client_ca``), or plaintext only when
    ``security.insecure`` opts in, with a loud warning."""
    address = config.server.address
    check_port_free(address)
    if config.security.insecure:
        get_logger("fedserver").warning(
            "security.insecure", address=address,
            warning="PLAINTEXT gRPC: anyone on the network path can read and alter models and updates and play "
                    "this server or its clients. Use --tls-cert/--tls-key (fedguard-certs makes them).")
    credentials = None if config.security.insecure else server_credentials(config)
    try:
        port = server.add_insecure_port(address) if credentials is None else \
            server.add_secure_port(address, credentials)
    except RuntimeError:  # lost a race for the port after the check
        port = 0
    if port == 0:
        raise ConfigError("server.address", f"cannot listen on {address}")
    return int(port)


RoundCallback = Callable[[RoundReport], object]


def guarded(fn: RoundCallback, log: Any) -> Callable[[RoundReport], None]:
    """``fn`` with its exceptions logged (``callback.failed``) instead of raised: an app's bug must not stop the
    federation."""

    def call(report: RoundReport) -> None:
        try:
            fn(report)
        except Exception as e:
            log.exception("callback.failed", callback="on_round_end", round=report.round,
                          error=f"{type(e).__name__}: {e}")

    return call


async def linger(coord: Coordinator, linger_s: float) -> None:
    """After the last round: keep answering until every live client has left (a client leaves once it has read
    that the federation finished, so its Leave says the answer arrived), or until none has left for ``linger_s``
    seconds (a fleet of ten thousand takes seconds to get through its Leaves: the wait is for progress, so it scales
    with the fleet); the clients still there then are named (told or not) in ``federation.linger_ended``."""
    loop = asyncio.get_running_loop()
    here, progress = coord.members.still_here(), loop.time()
    while here and loop.time() - progress < linger_s:
        await asyncio.sleep(0.05)
        now_here = coord.members.still_here()
        if now_here < here:
            progress = loop.time()
        here = now_here
    told, untold = coord.members.not_left()
    if told or untold:
        coord.log.warning("federation.linger_ended", linger_s=linger_s, told_not_left=len(told),
                          never_told=len(untold), examples=(untold or told)[:5],
                          reason=f"no client left for {linger_s:g} s and these had not: a client told that the "
                                 "federation finished leaves at once, so each one here either never heard it (it "
                                 "retries the stopped server until its give_up_after_s) or ended without a Leave")


async def serve(config: ServerConfig, ready: Callable[[int, Coordinator, FederationServicer], None] | None = None,
                stop: asyncio.Event | None = None, linger_s: float = 2.0, fresh: bool = False,
                on_round_end: RoundCallback | None = None, opener: StoreOpener = open_store) -> FederationStatus:
    """Run the federation to its end (or until ``stop`` is set); returns the final status.

    ``opener`` opens the run directory's state store (the fault tests pass one that dies on cue).

    ``on_round_end(report)`` is called with each completed round's :class:`RoundReport`, after the round was
    persisted, on the server's event loop (keep it short: hand heavy work to a thread); an exception it raises is
    logged and the federation carries on.

    A federation already in ``config.server.run_dir`` is resumed (``fresh`` moves it aside and starts a new
    one). After the last round the server keeps answering until every live client has been told that the
    federation finished and has left (until none has left for ``linger_s`` seconds; :func:`linger`), so that
    clients leave cleanly. When ``stop`` is set first, the stop is graceful (:meth:`Coordinator.stop`): the status
    then has ``stopping`` set.
    """
    # Checks the configuration before anything listens or touches the run dir.
    coord = Coordinator(config, opener=opener)
    if on_round_end is not None:
        coord.subscribe(guarded(on_round_end, coord.log))
    check_port_free(config.server.address)  # a taken port is refused before the run dir is created or touched
    framed_at = framed_address(config)
    if framed_at:
        try:
            check_port_free(framed_at, "server.framed_address")
        except ConfigError as e:
            if config.server.framed_address != AUTO:
                raise
            reason = str(e).removeprefix(e.field + ": ")
            raise ConfigError(e.field, f'"auto" is {framed_at} (server.address\'s port + 1): {reason}') from None
    # One writer per run directory, before anything listens or touches it (RunDirLocked names the holder).
    lock = RunDirLock.acquire(config.server.run_dir, config.server.address)
    try:
        return await _serve_locked(config, coord, lock, ready, stop, linger_s, fresh)
    finally:
        lock.release()


async def _serve_locked(config: ServerConfig, coord: Coordinator, lock: RunDirLock,
                        ready: Callable[[int, Coordinator, FederationServicer], None] | None,
                        stop: asyncio.Event | None, linger_s: float, fresh: bool) -> FederationStatus:
    coord.open(fresh)  # resume or start the federation; a damaged state stops here, before anything listens
    try:
        server = grpc.aio.server(options=grpc_options(config))
        servicer, health = add_to_server(server, coord)
        port = listen(server, config)
        framed = FramedServer(servicer, config) if framed_address(config) else None
        framed_port = await framed.start() if framed is not None else 0
    except BaseException:
        coord.close()
        raise
    lock.update(f"{config.server.address.rpartition(':')[0]}:{port}")
    await server.start()
    await set_serving(health, True)
    sec = config.security
    transport = "plaintext" if sec.insecure else ("mutual-tls" if sec.client_ca else "tls")
    coord.log.info("server.listening", address=config.server.address, port=port, transport=transport,
                   **({"framed_port": framed_port} if framed is not None else {}),
                   signed_requests=bool(sec.client_keys), event_loop=event_loop.running_loop_name())
    if ready is not None:
        ready(port, coord, servicer)
    run = asyncio.ensure_future(coord.run())
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    crl_watcher = asyncio.ensure_future(servicer.watch_revocations())
    try:
        done, _ = await asyncio.wait([t for t in (run, stopper) if t is not None],
                                     return_when=asyncio.FIRST_COMPLETED)
        if run in done:
            try:
                run.result()
            except BaseException:
                # The federation stopped on an error (e.g. the state store cannot write): tell the parked
                # long-polls to come back later before the port closes, so they end as answers, not as
                # cancelled handlers; the error then goes to the caller (the CLI prints its one line).
                with contextlib.suppress(Exception):
                    await coord.stop()
                await asyncio.sleep(min(linger_s, 0.2))
                raise
            await linger(coord, linger_s)
        else:
            await coord.stop()
            # Polling clients are told to come back later before the port closes.
            await asyncio.sleep(min(linger_s, 0.2))
            run.cancel()
        return coord.status()
    finally:
        crl_watcher.cancel()
        if stopper is not None:
            stopper.cancel()
        await set_serving(health, False)
        if framed is not None:
            await framed.close()
        await server.stop(grace=0.5)
        coord.close()
        coord.log.info("server.stopped")


class ServerThread:
    """A server running in a background thread (apps embedding the coordinator, tests, benchmarks).

    ``with ServerThread(config, on_round_end=fn) as srv:`` starts it and stops it at the end of the block. Every
    public method is thread-safe: :meth:`global_model` / :meth:`models` (fresh modules of the global and DistFL
    cluster models), :meth:`latest_report`, :meth:`wait_for_round`, :meth:`status`, :meth:`stop`.
    ``on_round_end(report)`` runs on the server's event loop after each round was persisted (keep it short; an
    exception it raises is logged and the federation carries on).
    """

    def __init__(self, config: ServerConfig, linger_s: float = 2.0, fresh: bool = False,
                 on_round_end: RoundCallback | None = None) -> None:
        self.config = config
        self.on_round_end = on_round_end
        self._reports = threading.Condition()
        self._latest: RoundReport | None = None
        self.linger_s = linger_s
        self.fresh = fresh
        self.port = 0
        self.coordinator: Coordinator | None = None
        # The request gate (authentication, bounds, stream limits): tests and benchmarks read its counters.
        self.servicer: FederationServicer | None = None
        self.result: FederationStatus | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="fedserver", daemon=True)

    def _main(self) -> None:
        async def go() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def on_ready(port: int, coord: Coordinator, servicer: FederationServicer) -> None:
                self.port, self.coordinator, self.servicer = port, coord, servicer
                self._ready.set()

            self.result = await serve(self.config, on_ready, self._stop, self.linger_s, self.fresh,
                                      on_round_end=self._round_end)

        try:
            event_loop.run(go, self.config.server.event_loop)
        except BaseException as e:  # surfaced to the caller by wait()/start()
            self.error = e
        finally:
            self._ready.set()
            with self._reports:
                self._reports.notify_all()

    def _round_end(self, report: RoundReport) -> None:
        with self._reports:
            self._latest = report
            self._reports.notify_all()
        if self.on_round_end is not None:
            self.on_round_end(report)  # guarded by serve(): an exception is logged

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def latest_report(self) -> RoundReport | None:
        """The last completed round's report (None before the first, or the restored one's after a resume)."""
        with self._reports:
            if self._latest is not None:
                return self._latest
        coord = self.coordinator
        if coord is not None and self._thread.is_alive():
            history = self.call(lambda: list(coord.history))
            return history[-1] if history else None
        return None

    def wait_for_round(self, n: int, timeout: float | None = None) -> RoundReport:
        """Block until round ``n`` has completed; returns the latest report (of round ``n`` or later).
        :class:`TimeoutError` after ``timeout`` seconds, :class:`RuntimeError` when the server ended first."""
        with self._reports:
            done = self._reports.wait_for(lambda: (self._latest is not None and self._latest.round >= n)
                                          or not self._thread.is_alive(), timeout)
            latest = self._latest
        if latest is not None and latest.round >= n:
            return latest
        if not done:
            raise TimeoutError(f"round {n} did not complete within {timeout} s")
        raise RuntimeError(f"the server ended before round {n} completed"
                           + (f": {self.error}" if self.error is not None else ""))

    def status(self) -> FederationStatus:
        """Where the federation stands now (as the operator's GetStatus shows it)."""
        coord = self.coordinator
        if coord is None:
            raise RuntimeError("the server has not started")
        if not self._thread.is_alive():
            return coord.status()
        return self.call(coord.status)  # type: ignore[no-any-return]

    def models(self) -> dict[str, nn.Module]:
        """Fresh modules (CPU, eval mode) of the server's models by id: ``"global"``, and with DistFL one per
        cluster. Thread-safe; the modules are the caller's."""
        coord = self.coordinator
        if coord is None:
            raise RuntimeError("the server has not started")
        states = (self.call(lambda: coord.models.all()) if self._thread.is_alive() else coord.models.all())
        out = {}
        for model_id, state in states.items():
            module = build_model(self.config.model.name, self.config.model.kwargs, seed=self.config.rounds.seed)
            module.load_state_dict(state)  # copies: the server's tensors are never shared
            module.eval()
            out[model_id] = module
        return out

    def global_model(self, model_id: str = GLOBAL) -> nn.Module:
        """A fresh module of the global model (or of DistFL cluster ``model_id``)."""
        models = self.models()
        if model_id not in models:
            raise KeyError(f"no model {model_id!r}; the server has {sorted(models)}")
        return models[model_id]

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("server did not start")
        if self.error is not None:
            raise self.error
        return self

    @property
    def address(self) -> str:
        host = self.config.server.address.rpartition(":")[0]
        return f"{host}:{self.port}"

    def wait(self, timeout: float | None = None) -> FederationStatus | None:
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.result

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the server's event loop and return its result (state inspection in tests)."""
        assert self._loop is not None

        async def wrapper() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result(timeout)
