"""Run the API emulator (and optionally the test kubelet) in their own thread and event loop.

A separate loop keeps the operator's loop and the API's apart, as in a real cluster (sharing one loop also
costs kopf a 5 s shutdown stall). Tests talk to the emulator through `call`, which runs a function on its
loop, so a test never reads the store while a request is modifying it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import kmock
import yaml

from .emulator import Emulator

T = TypeVar("T")


class OnLoop:
    """Runs work on `self._loop`, an event loop in a thread of its own (the API emulator's, or the test kubelet's)."""

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


class ApiServer(OnLoop):
    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.emulator: Emulator | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._run, name="api-emulator", daemon=True)

    def __enter__(self) -> ApiServer:
        self._thread.start()
        self._started.wait(10)
        if self._error or not self.url:
            raise RuntimeError(f"the API emulator did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 (reported to the starting thread)
            self._error = exc
            self._started.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self.emulator = Emulator()
        async with self.emulator, kmock.Server(self.emulator) as server:
            self.url = str(server.url).rstrip("/")
            self._started.set()
            await self._stop.wait()
            self.emulator.drop_watches()
            await asyncio.sleep(0.05)  # let the dropped watch streams end before the server closes

    def close(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    # Conveniences for tests (each runs on the loop).
    def objects(self, resource: str, namespace: str | None = None, labels: str | None = None) -> list[dict[str, Any]]:
        return self.call(lambda: self.emulator.select(kmock.resource(resource), namespace, labels))

    def object(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.call(lambda: self.emulator.fetch(kmock.resource(resource), namespace, name))

    def create(self, resource: str, body: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        return self.call(lambda: self.emulator.create_object(kmock.resource(resource), namespace, body))

    def patch(self, resource: str, namespace: str | None, name: str, body: Any, subresource: str | None = None
              ) -> dict[str, Any]:
        return self.call(lambda: self.emulator.patch_object(kmock.resource(resource), namespace, name, body,
                                                            subresource=subresource))

    def delete(self, resource: str, namespace: str | None, name: str, **options: Any) -> dict[str, Any]:
        return self.call(lambda: self.emulator.delete_object(kmock.resource(resource), namespace, name, options))

    def create_namespace(self, name: str) -> None:
        self.create("v1/namespaces", {"metadata": {"name": name}})

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "test"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                           "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path


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
