"""fedserver.idle_limit: one timer for all of a task's waits, each limited; a cancel from elsewhere is not taken for
the limit's."""

from __future__ import annotations

import asyncio
import time

import pytest

from fedserver.idle_limit import IdleLimit


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
        assert 0.04 <= time.monotonic() - t0 < 1.0
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
        assert time.monotonic() - t0 < 1.0 and len(armed) == 2
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
