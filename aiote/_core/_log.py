"""structlog logger bound to the stdlib ``aiote`` logger: silent until the application
configures logging (a NullHandler is installed, as libraries should)."""

from __future__ import annotations

import logging
from typing import Any

import structlog

_std = logging.getLogger("aiote")
_std.addHandler(logging.NullHandler())


def get_logger(**initial: Any) -> Any:
    """A structlog logger writing through ``logging.getLogger("aiote")``."""
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
