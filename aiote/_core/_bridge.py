"""Wakes the event loop when the C poller has pushed completion records.

asyncio (and uvloop): a persistent ``add_reader`` on the engine's eventfd, so a burst of
completions costs one callback. trio: one system task blocked in
``trio.lowlevel.wait_readable``. Either way ``on_ready`` runs in the loop thread and must
not raise.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any

import sniffio

from ._log import get_logger
from ._util import LoopEvent, TrioEvent

_log = get_logger(component="bridge")


class LoopBridge:
    """Calls ``on_ready`` in the event-loop thread whenever ``fd`` becomes readable."""

    def __init__(self, fd: int, on_ready: Callable[[], None]) -> None:
        self._fd = fd
        self._on_ready = on_ready
        self._backend = sniffio.current_async_library()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scope: Any = None
        self._stopped: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def event_class(self) -> Any:
        """The event class of the engine's waits (:class:`LoopEvent` under asyncio, with a
        cheap timed wait; :class:`TrioEvent`): created on every operation, so the backend lookup
        of ``anyio.Event()`` is paid once per engine."""
        if self._backend == "trio":
            return TrioEvent
        return LoopEvent

    @property
    def backend(self) -> str:
        """``"asyncio"`` or ``"trio"``."""
        return self._backend

    def _safe(self) -> None:
        try:
            self._on_ready()
        except Exception:  # pragma: no cover - a bug; never let it kill the loop
            _log.exception("completion dispatch failed")

    def start(self) -> None:
        """Starts watching; costs one reader registration (asyncio) or one task (trio)."""
        if self._backend == "asyncio":
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._fd, self._safe)
        elif self._backend == "trio":
            import trio

            self._scope = trio.CancelScope()
            self._stopped = trio.Event()
            trio.lowlevel.spawn_system_task(self._trio_watch, name="aiote-completions")
        else:  # pragma: no cover
            raise RuntimeError(f"aiote runs under asyncio or trio, not {self._backend}")
        self._safe()

    def spawn(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs ``fn()`` in a background task of the event loop (the engine's work that goes
        on whoever awaits it), in a copy of the caller's context. ``fn`` must not raise
        (cancellation aside: a loop or run that ends cancels it). asyncio: a task the bridge
        holds until it ends; trio: a system task."""
        if self._backend == "asyncio":
            loop = self._loop or asyncio.get_running_loop()
            task = loop.create_task(fn())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            import trio

            trio.lowlevel.spawn_system_task(fn, name="aiote-transfer", context=contextvars.copy_context())

    async def _trio_watch(self) -> None:
        import trio

        try:
            with self._scope:
                while True:
                    await trio.lowlevel.wait_readable(self._fd)
                    self._safe()
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stops watching; after it returns the fd may be closed."""
        if self._backend == "asyncio":
            if self._loop is not None:
                self._loop.remove_reader(self._fd)
                self._loop = None
        elif self._scope is not None:
            import trio

            self._scope.cancel()
            with trio.CancelScope(shield=True):
                await self._stopped.wait()
            trio.lowlevel.notify_closing(self._fd)
            self._scope = None
