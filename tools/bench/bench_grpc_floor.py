"""The floor under a client-round: what gRPC's asyncio server costs per call on this machine, with no fedguard code.

A client-round of fedguard is two calls: ``PullTask`` (a request answered with a stream of the task header and the
model's chunks) and ``PushUpdate`` (a stream of the update header and its chunks answered with one reply). This
benchmark serves calls of exactly those shapes from a bare ``grpc.aio`` server whose handlers do nothing (bytes in,
bytes out: no protobuf, no validation, no state), drives them from client processes at a given concurrency, and
reports the server's CPU seconds (user + system, from /proc) per call and per client-round. Whatever the server
spends per client-round above this floor is fedguard's own work; what is below it cannot be removed without
fewer or cheaper calls (another transport, batching several devices into one call, or one long-lived stream per
device instead of two calls per round). For the first of those, the same server process also answers the
long-lived stream's round on a bare TCP connection served by its event loop's own thread (length-prefixed frames,
no gRPC, no HTTP/2, no TLS): what a transport without gRPC's poller thread would cost at least.

    python tools/bench/bench_grpc_floor.py                       # 4.5k-parameter payload, 4 client processes
    python tools/bench/bench_grpc_floor.py --params 940362 --calls 400
    python tools/bench/bench_grpc_floor.py --concurrency 25     # calls in flight per client process
    python tools/bench/bench_grpc_floor.py --event-loop asyncio # the server on the standard loop (default: uvloop)
    python tools/bench/bench_grpc_floor.py --wakes 20000 --calls 0   # only what waking a thread costs here

Last, it measures what waking a thread costs on this machine, the step gRPC's asyncio server takes for nearly every
message: its event loop hands work to gRPC's core, whose completion-queue poller thread sleeps in ``epoll_wait`` and
is woken through an eventfd (``eventfd_write``), and the poller wakes the loop back. Here two Python threads make the
same round trip: one writes an eventfd, the other, asleep on it in ``epoll``, wakes, reads it and wakes the writer
back (a semaphore; the GIL changes hands each way), against the same write with no thread waiting. Run it under
``taskset -c 0`` for two threads on one core (a ``--pin-server`` server's case).

The server runs in a child process started with ``spawn`` (gRPC's core does not survive ``fork`` after it started).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import select
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from tools import procstat  # noqa: E402

SERVICE = "fedguard.floor.v1.Floor"
HEADER_BYTES = 200  # a task or update header: ids, round, tensor manifest of a small MLP


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (raises once it is gone: a reading must not be missing)."""
    seconds = procstat.cpu_seconds(pid)
    if seconds is None:
        raise RuntimeError(f"process {pid} is gone: no CPU reading")
    return seconds


def per_call_us(cpu_before: float, cpu_after: float, calls: int) -> float:
    """Microseconds of CPU per call between two readings."""
    if calls <= 0:
        raise ValueError("calls must be > 0")
    return 1e6 * (cpu_after - cpu_before) / calls


FRAME_LEN = 4  # the bare TCP shape's frames: a little-endian length, then the bytes


def frame(data: bytes) -> bytes:
    return len(data).to_bytes(FRAME_LEN, "little") + data


class _BareSession(asyncio.Protocol):
    """The ``session`` shape on a bare TCP connection, served on the loop's own thread: each update (a header frame
    and a data frame) answered with the next task (the same two frames)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= FRAME_LEN:
            n = int.from_bytes(self.buf[:FRAME_LEN], "little")
            if len(self.buf) < FRAME_LEN + n:
                return
            del self.buf[:FRAME_LEN + n]
            if n != HEADER_BYTES:  # the update's data: answer with the next task
                self.transport.writelines([frame(b"h" * HEADER_BYTES), frame(bytes(n))])


def _serve(port: int, ready: Any, stop: Any, loop: str = "auto", bare_port: int = 0) -> None:
    import grpc

    from fedserver import event_loop

    async def unary(request: bytes, context: Any) -> bytes:
        return b""

    async def pull(request: bytes, context: Any) -> AsyncIterator[bytes]:
        size = int.from_bytes(request[:8], "little")
        yield b"h" * HEADER_BYTES
        yield bytes(size)

    async def push(requests: AsyncIterator[bytes], context: Any) -> bytes:
        n = 0
        async for part in requests:
            n += len(part)
        return n.to_bytes(8, "little")

    async def session(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        # One long-lived stream per device: each round, the update's 2 messages in and the next task's 2 out.
        async for part in requests:
            if len(part) != HEADER_BYTES:  # the update's data: answer with the next task
                yield b"h" * HEADER_BYTES
                yield bytes(len(part))

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Pull": grpc.unary_stream_rpc_method_handler(pull),
            "Push": grpc.stream_unary_rpc_method_handler(push),
            "Session": grpc.stream_stream_rpc_method_handler(session),
        }),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        bare = await asyncio.get_running_loop().create_server(_BareSession, "127.0.0.1", bare_port) \
            if bare_port else None
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        if bare is not None:
            bare.close()
        await server.stop(0)

    event_loop.run(main, loop)


async def _bare_rounds(port: int, n: int, body: bytes) -> None:
    """``n`` rounds of the ``session`` shape on one bare TCP connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    update = [frame(b"h" * HEADER_BYTES), frame(body)]
    for _ in range(n):
        writer.writelines(update)
        await writer.drain()
        for _ in range(2):
            size = int.from_bytes(await reader.readexactly(FRAME_LEN), "little")
            await reader.readexactly(size)
    writer.close()
    await writer.wait_closed()


def _drive(port: int, shape: str, calls: int, concurrency: int, payload: int) -> None:
    import grpc

    if shape == "bare":
        async def bare() -> None:
            share = [calls // concurrency + (i < calls % concurrency) for i in range(concurrency)]
            await asyncio.gather(*(_bare_rounds(port, n, bytes(payload)) for n in share if n))

        asyncio.run(bare())
        return

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary = channel.unary_unary(f"/{SERVICE}/Unary")
            pull = channel.unary_stream(f"/{SERVICE}/Pull")
            push = channel.stream_unary(f"/{SERVICE}/Push")
            session = channel.stream_stream(f"/{SERVICE}/Session")
            body = bytes(payload)

            async def parts() -> AsyncIterator[bytes]:
                yield b"h" * HEADER_BYTES
                yield body

            async def one() -> None:
                if shape == "unary":
                    await unary(b"")
                elif shape == "pull":
                    async for _ in pull(payload.to_bytes(8, "little")):
                        pass
                else:
                    await push(parts())

            async def worker(n: int) -> None:
                if shape == "session":  # n rounds on one stream: update in, task out
                    call = session()
                    for _ in range(n):
                        await call.write(b"h" * HEADER_BYTES)
                        await call.write(body)
                        await call.read()
                        await call.read()
                    await call.done_writing()
                    return
                for _ in range(n):
                    await one()

            share = [calls // concurrency + (i < calls % concurrency) for i in range(concurrency)]
            await asyncio.gather(*(worker(n) for n in share if n))

    asyncio.run(main())


def measure(shape: str, calls: int, procs: int, concurrency: int, payload: int, port: int, server_pid: int,
            ctx: Any) -> tuple[float, float]:
    """(server CPU µs per call, wall µs per call) of ``calls`` calls of ``shape`` spread over ``procs`` client
    processes with ``concurrency`` calls in flight each (``session``: streams open, ``calls`` rounds over them)."""
    warm = ctx.Process(target=_drive, args=(port, shape, 50, 1, payload))
    warm.start()
    warm.join()
    share = [calls // procs + (i < calls % procs) for i in range(procs)]
    clients = [ctx.Process(target=_drive, args=(port, shape, n, concurrency, payload)) for n in share]
    before, t0 = cpu_seconds(server_pid), time.perf_counter()
    for c in clients:
        c.start()
    for c in clients:
        c.join()
        if c.exitcode != 0:
            raise RuntimeError(f"a client process of the {shape} run failed (exit {c.exitcode})")
    wall, after = time.perf_counter() - t0, cpu_seconds(server_pid)
    # The client processes' start-up (imports) overlaps the timed window; the server is idle meanwhile, and an
    # idle grpc.aio server costs ~nothing, so its CPU reading is unaffected; wall time is an upper bound.
    return per_call_us(before, after, calls), 1e6 * wall / calls


def wake_cost(n: int) -> tuple[float, float]:
    """(µs of this process's CPU per eventfd write with no thread waiting, µs per wake-up round trip: a write that
    wakes a thread asleep on it in epoll, which wakes the writer back): ``n`` of each. Every write finds the other
    thread asleep."""
    if n < 1:
        raise ValueError("n must be >= 1")
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    ep = select.epoll()
    try:
        t = time.process_time()
        for _ in range(n):
            os.eventfd_write(fd, 1)
        alone = 1e6 * (time.process_time() - t) / n
        os.eventfd_read(fd)
        ep.register(fd, select.EPOLLIN)
        woken = threading.Semaphore(0)
        done = threading.Event()

        def sleeper() -> None:
            while not done.is_set():
                if ep.poll(1.0):
                    os.eventfd_read(fd)
                    woken.release()

        th = threading.Thread(target=sleeper, name="floor-wake", daemon=True)
        th.start()
        os.eventfd_write(fd, 1)  # the thread is up and parked before the count starts
        woken.acquire()
        t = time.process_time()
        for _ in range(n):
            os.eventfd_write(fd, 1)
            woken.acquire()
        waking = 1e6 * (time.process_time() - t) / n
        done.set()
        os.eventfd_write(fd, 1)
        th.join(5)
        return alone, waking
    finally:
        ep.close()
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=4554, help="float32 parameters in each task and update payload")
    ap.add_argument("--calls", type=int, default=3000, help="calls per shape and repeat (0: only --wakes)")
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--concurrency", type=int, default=25, help="calls in flight per client process")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (the median is reported)")
    ap.add_argument("--event-loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                    help="the server's event loop, as fedserver's server.event_loop (auto: uvloop where installed)")
    ap.add_argument("--wakes", type=int, default=10000, help="eventfd writes per wake-up measurement (0: none)")
    args = ap.parse_args(argv)
    if args.calls < 0 or args.wakes < 0 or args.calls == args.wakes == 0:
        ap.error("--calls and --wakes are >= 0, and not both 0")
    if args.calls:
        _calls(args)
    if args.wakes:
        alone, waking = wake_cost(args.wakes)
        print(f"a wake-up round trip between two threads (an eventfd write wakes a thread asleep on it in epoll, "
              f"which wakes the writer back): {waking:.1f} µs of CPU; the same write with no thread waiting: "
              f"{alone:.2f} µs ({args.wakes:,} each)")
    return 0


def _calls(args: argparse.Namespace) -> None:
    """The four call shapes against the bare server, printed."""
    ctx = mp.get_context("spawn")
    port = procstat.free_port()
    ready, stop = ctx.Event(), ctx.Event()
    bare_port = procstat.free_port()
    while bare_port == port:
        bare_port = procstat.free_port()
    server = ctx.Process(target=_serve, args=(port, ready, stop, args.event_loop, bare_port), daemon=True)
    server.start()
    if not ready.wait(60) or server.pid is None:
        raise SystemExit("the floor server did not start within 60 s")
    payload = 4 * args.params
    results: dict[str, list[tuple[float, float]]] = {"unary": [], "pull": [], "push": [], "session": [], "bare": []}
    try:
        for _ in range(args.repeats):
            for shape in results:
                results[shape].append(measure(shape, args.calls, args.procs, args.concurrency, payload,
                                              bare_port if shape == "bare" else port, server.pid, ctx))
    finally:
        stop.set()
        server.join(10)
    import grpc

    from fedserver.event_loop import loop_factory

    loop = "asyncio" if loop_factory(args.event_loop) is None else "uvloop"
    print(f"bare grpc.aio server (grpcio {grpc.__version__}, {loop} event loop), handlers that do nothing; "
          f"{args.params:,}-parameter "
          f"payload ({payload:,} bytes), {args.procs} client processes x {args.concurrency} calls in flight, "
          f"{args.calls} calls per shape, median of {args.repeats} interleaved repeats; cores: {os.cpu_count()}")
    med: dict[str, float] = {}
    label: dict[str, str] = {"unary": "unary (a Heartbeat's shape)",
                             "pull": "request -> stream of 2 (PullTask's shape)",
                             "push": "stream of 2 -> reply (PushUpdate's shape)",
                             "session": "a round on one open stream (2 in, 2 out)",
                             "bare": "the same on a bare TCP connection (no gRPC)"}

    def pick(rows: list[tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] for r in rows)

    for shape, rows in results.items():
        med[shape] = pick(rows, 0)
        print(f"  {label[shape]:<44} server CPU {med[shape]:7.1f} µs per call (runs: "
              f"{', '.join(f'{r[0]:.0f}' for r in rows)}), wall {pick(rows, 1):7.1f} µs per call")
    floor = med["pull"] + med["push"]
    print(f"floor per client-round (PullTask + PushUpdate shapes): {floor / 1000:.3f} ms of server CPU; "
          f"the same messages on one long-lived stream per device: {med['session'] / 1000:.3f} ms; on a bare TCP "
          f"connection served on the event loop's own thread (no gRPC, no TLS): {med['bare'] / 1000:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
