"""Helpers the live tests share: `OnLoop` (work run on an event loop in a thread of its own, as the test kubelet
runs) and `wait_for` (poll until a condition holds)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class OnLoop:
    """Runs work on `self._loop`, an event loop in a thread of its own (the test kubelet's)."""

    _loop: asyncio.AbstractEventLoop

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` (sync or async) on the loop and return its result."""
        async def run() -> Any:
            result = fn(*args, **kwargs)
            return await result if asyncio.iscoroutine(result) else result
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def start(self, coro_fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Start a long-running coroutine (e.g. the kubelet) on the loop."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._loop)


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll until `predicate()` is truthy; fail with `what` (and the last value) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(interval)
        value = predicate()
    return value
