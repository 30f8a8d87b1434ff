"""structlog logger bound to the stdlib ``aiote`` logger: silent until the application
configures logging (a NullHandler is installed, as libraries should).

An event the ``aiote`` logger is not enabled for costs one ``isEnabledFor`` call and is
dropped there, as structlog's ``filter_by_level`` would drop it; structlog itself is imported
and the logger built only for the first event that shows. So a process that never enables
aiote's logs never imports structlog (about 0.1 s where ``rich`` is installed, which
structlog then imports for its tracebacks)."""

from __future__ import annotations

import logging
from typing import Any

_std = logging.getLogger("aiote")
_std.addHandler(logging.NullHandler())

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _structlog_logger(initial: dict[str, Any]) -> Any:
    import structlog

    return structlog.wrap_logger(
        _std,
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.processors.KeyValueRenderer(key_order=["event"]),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
    ).bind(**initial)


class _Logger:
    """What :func:`get_logger` returns: ``debug``, ``info``, ``warning``, ``error``,
    ``exception``, ``critical`` and ``bind`` as on a structlog ``BoundLogger``, which it
    builds at the first event that shows (see the module)."""

    __slots__ = ("_initial", "_real")

    def __init__(self, initial: dict[str, Any]) -> None:
        self._initial = initial
        self._real: Any = None

    def bind(self, **kw: Any) -> _Logger:
        return _Logger({**self._initial, **kw})

    def _emit(self, method: str, event: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        if not _std.isEnabledFor(_LEVELS[method]):
            return None
        real = self._real
        if real is None:
            real = self._real = _structlog_logger(self._initial)
        return getattr(real, method)(event, *args, **kw)

    def debug(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit("debug", event, args, kw)

    def info(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit("info", event, args, kw)

    def warning(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit("warning", event, args, kw)

    warn = warning

    def error(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit("error", event, args, kw)

    def exception(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit("exception", event, args, kw)

    def critical(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit("critical", event, args, kw)


def get_logger(**initial: Any) -> Any:
    """A structlog logger writing through ``logging.getLogger("aiote")`` (built when its first
    enabled event comes; a disabled one costs an ``isEnabledFor`` call)."""
    return _Logger(initial)
