"""fedserver.idle_limit: one timer for all of a task's waits, each limited; a cancel from elsewhere is not taken for
the limit's."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from fedserver.idle_limit import MAX_MOVES, IdleLimit


def _done(value: str) -> asyncio.Future[str]:
    """A future that already holds ``value`` (a wait that ends at once)."""
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


async def _wait(limit: IdleLimit, seconds: float, fut: asyncio.Future[str]) -> str:
    """The pattern of fedserver.servicer._next: the limit's expiry becomes TimeoutError."""
    limit.start(seconds)
    try:
        return await fut
    except asyncio.CancelledError:
        if limit.stop():
            raise TimeoutError from None
        raise
    finally:
        limit.stop()


def test_a_wait_past_its_limit_times_out_and_leaves_the_task_usable() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        limit = IdleLimit()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await _wait(limit, 0.05, loop.create_future())
        # On time, or (a loop held up past LATE_S: a loaded host) moved on by at most MAX_MOVES stalls.
        assert 0.04 <= time.monotonic() - t0 < 1.0 + MAX_MOVES * 1.0
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # the limit's cancel request was withdrawn
        await asyncio.sleep(0)  # and nothing is left to cancel the task later
        fut: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.01, fut.set_result, "next")
        assert await _wait(limit, 0.5, fut) == "next"  # the same limit serves the next wait
        limit.close()

    asyncio.run(main())


def test_many_waits_in_time_share_one_timer_and_a_shorter_one_is_still_kept() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        armed: list[float] = []
        call_at = loop.call_at

        def counted(when: float, callback: object, *args: object) -> asyncio.TimerHandle:
            armed.append(when)
            return call_at(when, callback, *args)  # type: ignore[arg-type]

        loop.call_at = counted  # type: ignore[method-assign,assignment]
        limit = IdleLimit()
        for i in range(200):  # each wait's deadline later than the armed one's: no new timer
            assert await _wait(limit, 5.0, _done(str(i))) == str(i)
        assert len(armed) == 1
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):  # a shorter limit than the armed timer's: re-armed, expires on time
            await _wait(limit, 0.05, loop.create_future())
        assert time.monotonic() - t0 < 1.0 + MAX_MOVES * 1.0 and len(armed) >= 2
        limit.close()
        loop.call_at = call_at  # type: ignore[method-assign]

    asyncio.run(main())


def test_the_timer_armed_for_an_earlier_wait_moves_on_to_the_current_one() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        limit = IdleLimit()
        assert await _wait(limit, 0.05, _done("a")) == "a"  # the timer is armed for t + 0.05 and stays
        fut: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.15, fut.set_result, "b")
        assert await _wait(limit, 0.5, fut) == "b"  # the timer fired at 0.05, found this wait's deadline later
        limit.close()

    asyncio.run(main())


def test_a_cancel_from_elsewhere_is_a_cancel_not_a_timeout() -> None:
    async def waiter(limit_seconds: float, fut: asyncio.Future[str]) -> str:
        return await _wait(IdleLimit(), limit_seconds, fut)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(waiter(5.0, loop.create_future()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Both at once: the limit expires and the task is cancelled in the same loop pass; the cancel wins.
        fut: asyncio.Future[str] = loop.create_future()
        task = asyncio.create_task(waiter(0.05, fut))
        loop.call_later(0.05, task.cancel)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_close_disarms_the_timer() -> None:
    async def main() -> None:
        limit = IdleLimit()
        await _wait(limit, 0.05, _done("x"))
        limit.close()
        await asyncio.sleep(0.1)  # past the deadline the timer was armed for: nothing fires
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0

    asyncio.run(main())


def _loops() -> list[object]:
    """The loops the server runs on: asyncio's, and uvloop's where it is installed (server.event_loop = auto)."""
    out: list[object] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a server dependency on Linux
        return out
    out.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    return out


def _stalled_read(new_loop: Any, send: bool, limit_s: float, stall_s: float) -> tuple[str, float, int]:
    """A wait of ``limit_s`` on a socket read while the loop is held up for ``stall_s`` (a blocking callback); with
    ``send`` the peer's bytes arrive during the stall. (outcome, seconds the wait took, the limit's stalls)."""
    import socket
    import threading

    a, b = socket.socketpair()

    async def main() -> tuple[str, float, int]:
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection(sock=a)
        limit = IdleLimit()
        read = asyncio.ensure_future(reader.read(5))
        if send:  # the peer writes while the loop cannot run: its bytes wait in the socket
            threading.Timer(0.05 + stall_s / 2, b.sendall, (b"hello",)).start()
        loop.call_later(0.05, time.sleep, stall_s)
        t0 = time.monotonic()
        try:
            got = await _wait(limit, limit_s, read)  # type: ignore[arg-type]
            outcome = got.decode()
        except TimeoutError:
            outcome = "timeout"
        took = time.monotonic() - t0
        limit.close()
        writer.close()
        return outcome, took, limit.stalls

    loop = new_loop()
    try:
        return loop.run_until_complete(main())  # type: ignore[no-any-return]
    finally:
        loop.close()
        b.close()


@pytest.mark.parametrize("new_loop", _loops())
def test_bytes_that_arrived_while_the_loop_was_held_up_are_read_not_timed_out(new_loop: Any) -> None:
    # The loop is blocked for 0.8 s, past the 0.3-s limit; the peer's bytes arrive meanwhile. The timer then fires
    # late (uvloop runs due timers before it polls for I/O; asyncio runs them before the read's task resumes): the
    # wait's deadline moves on by the lost time, and the bytes are read.
    outcome, took, stalls = _stalled_read(new_loop, send=True, limit_s=0.3, stall_s=0.8)
    assert outcome == "hello" and stalls >= 1  # more than one where a loaded host holds the loop up again
    assert took < 0.3 + 0.8 + 5.0


@pytest.mark.parametrize("new_loop", _loops())
def test_a_silent_peer_still_times_out_after_a_stall(new_loop: Any) -> None:
    # Nothing arrives: the deadline moves on once for the stall (by at most the limit), then the wait times out. The
    # 0.8-s stall starts 0.05 s in: the timer fires at ~0.85 s, 0.55 s late; the deadline moves LATE_S past it.
    outcome, took, stalls = _stalled_read(new_loop, send=False, limit_s=0.3, stall_s=0.8)
    assert outcome == "timeout" and 1 <= stalls <= MAX_MOVES
    assert 0.85 + 0.25 - 0.1 <= took < 0.85 + (0.3 + 1.0) * MAX_MOVES + 5.0
