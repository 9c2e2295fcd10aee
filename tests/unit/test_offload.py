"""fedserver.offload: a round close's blocking step runs on a worker thread until its last run was short."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from fedserver.offload import INLINE_S, Offload


class _Clock:
    """Advances by the duration the step under test says it took."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(clock: _Clock, seconds: float, threads: list[int]) -> Callable[[int], int]:
    def fn(x: int) -> int:
        threads.append(threading.get_ident())
        clock.now += seconds
        return x * 2
    return fn


def test_a_step_runs_on_a_worker_thread_until_its_last_run_was_short_and_goes_back_when_it_grows() -> None:
    clock, threads = _Clock(), list[int]()
    off = Offload(inline_s=0.002, clock=clock)

    async def main() -> list[int]:
        loop_thread = threading.get_ident()
        results = [await off.run("snapshot", _step(clock, 0.0005, threads), 1)]  # first run: a thread
        assert off.last_seconds("snapshot") == pytest.approx(0.0005)
        results.append(await off.run("snapshot", _step(clock, 0.003, threads), 2))  # short last time: the loop
        results.append(await off.run("snapshot", _step(clock, 0.0001, threads), 3))  # 3 ms last time: a thread
        results.append(await off.run("snapshot", _step(clock, 0.0001, threads), 4))  # short again: the loop
        results.append(await off.run("aggregate", _step(clock, 0.0001, threads), 5))  # each step its own record
        assert [t == loop_thread for t in threads] == [False, True, False, True, False]
        return results

    assert asyncio.run(main()) == [2, 4, 6, 8, 10]


def test_the_line_is_inclusive_and_a_step_that_raises_is_still_timed() -> None:
    clock = _Clock()
    off = Offload(inline_s=0.002, clock=clock)
    assert not off.inline("aggregate") and off.last_seconds("aggregate") is None

    def fails() -> None:
        clock.now += 0.002
        raise ValueError("the rule cannot work with what arrived")

    async def main() -> None:
        with pytest.raises(ValueError, match="cannot work"):
            await off.run("aggregate", fails)

    asyncio.run(main())
    assert off.last_seconds("aggregate") == pytest.approx(0.002) and off.inline("aggregate")
    assert Offload().inline_s == INLINE_S


def test_a_short_close_runs_on_the_loop_and_a_long_one_keeps_the_loop_answering() -> None:
    """With the real clock: a 50 ms step stays on its worker thread, the loop runs other callbacks meanwhile."""
    off = Offload()

    async def main() -> tuple[int, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.get_running_loop().create_task(ticker())
        await asyncio.sleep(0)
        for _ in range(2):
            await off.run("slow", threading.Event().wait, 0.05)
        during_slow = ticks
        assert not off.inline("slow")
        await off.run("fast", int, "7")
        assert off.inline("fast")  # an int() is well under the line
        task.cancel()
        return during_slow, ticks

    during_slow, _ = asyncio.run(main())
    assert during_slow >= 10  # ~100 ms of slow steps off the loop: the ticker ran about every millisecond
