"""A slow link, in userspace: a TCP proxy that adds latency and caps bandwidth, each way (the kernel here has no netem).

``python tests/system/netproxy.py LISTEN_HOST:PORT UPSTREAM_HOST:PORT --latency-ms 200 --mbit 10`` forwards every
connection it accepts to the upstream address. Each direction is a queue: a chunk read at time t is written no
earlier than t + latency, and no faster than the cap allows (a token bucket of one chunk's size), in order. It
prints ``proxy.listening`` when it is ready and, when it ends (SIGTERM), one JSON line with the bytes it forwarded
each way. Bytes are forwarded as they are (TLS passes through); nothing is read into anything but a buffer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence

CHUNK = 16 * 1024


class Stats:
    def __init__(self) -> None:
        self.up = 0
        self.down = 0
        self.connections = 0

    def add_up(self, n: int) -> None:
        self.up += n

    def add_down(self, n: int) -> None:
        self.down += n


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, latency_s: float, bytes_per_s: float,
                count: Callable[[int], None]) -> None:
    """Forward ``reader`` to ``writer``: each chunk after ``latency_s``, at most ``bytes_per_s``."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while True:
            data = await reader.read(CHUNK)
            await queue.put((time.monotonic() + latency_s, data))
            if not data:
                return

    async def write() -> None:
        next_free = time.monotonic()
        while True:
            due, data = await queue.get()
            if not data:
                writer.close()
                return
            now = time.monotonic()
            start = max(due, next_free)
            if start > now:
                await asyncio.sleep(start - now)
            writer.write(data)
            await writer.drain()
            count(len(data))
            next_free = max(start, time.monotonic()) + len(data) / bytes_per_s

    await asyncio.gather(read(), write(), return_exceptions=True)


async def serve(listen: tuple[str, int], upstream: tuple[str, int], latency_s: float, bytes_per_s: float,
                stats: Stats, stop: asyncio.Event, reset: bool = True) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        stats.connections += 1
        try:
            server_r, server_w = await asyncio.open_connection(*upstream)
        except OSError:  # upstream not there (yet): reset the connection, as the server's host would, or close it
            if reset:       # as an L4 load balancer does
                sock = client_w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client_w.transport.abort()
            else:
                client_w.close()
            return
        await asyncio.gather(_pipe(client_r, server_w, latency_s, bytes_per_s, stats.add_up),
                             _pipe(server_r, client_w, latency_s, bytes_per_s, stats.add_down), return_exceptions=True)

    server = await asyncio.start_server(handle, *listen)
    print("proxy.listening", flush=True)
    async with server:
        await stop.wait()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("listen")
    ap.add_argument("upstream")
    ap.add_argument("--latency-ms", type=float, default=200.0, help="added each way (default 200)")
    ap.add_argument("--mbit", type=float, default=10.0, help="bandwidth cap each way, Mbit/s (default 10)")
    ap.add_argument("--no-upstream", choices=("reset", "close"), default="reset",
                    help="what a connection gets when the upstream cannot be reached (default reset)")
    args = ap.parse_args(argv)
    stats = Stats()

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(_address(args.listen), _address(args.upstream), args.latency_ms / 1000.0,
                    args.mbit * 1e6 / 8.0, stats, stop, reset=args.no_upstream == "reset")

    asyncio.run(run())
    print(json.dumps({"connections": stats.connections, "bytes_up": stats.up, "bytes_down": stats.down}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
