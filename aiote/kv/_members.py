"""What the KV flow needs from a membership service (``aiote.membership`` provides it; the
flow imports nothing of it): a source of decoder joins and leaves for the prefill side, and a
registry a decode worker registers itself in. Both are structural protocols."""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping
from typing import Any, Protocol

from .._core._descriptor import MemoryDescriptor

__all__ = [
    "LAYOUT_META",
    "POOL_DESCRIPTOR",
    "DecoderEvent",
    "DecoderRecord",
    "DecoderRegistration",
    "DecoderRegistry",
    "DecoderSource",
]

POOL_DESCRIPTOR = "kv.pool"
"""The name under which a decode worker registers its pool's descriptor."""
LAYOUT_META = "kv.layout"
"""The metadata key under which a decode worker registers its layout (``KVLayout.to_dict()``)."""


class DecoderRecord(Protocol):
    """A registered decode worker: its engine address, named descriptors and metadata."""

    @property
    def address(self) -> bytes: ...
    @property
    def descriptors(self) -> Mapping[str, MemoryDescriptor]: ...
    @property
    def meta(self) -> Mapping[str, Any]: ...


class DecoderEvent(Protocol):
    """A decode worker joined (``joined``) or left; ``clean`` (a leave): it announced it
    (its requests in flight finish) rather than vanished (they fail)."""

    @property
    def joined(self) -> bool: ...
    @property
    def clean(self) -> bool: ...
    @property
    def member(self) -> DecoderRecord: ...


DecoderSource = AsyncIterable[DecoderEvent]
"""Decoder joins and leaves, the current decoders first (an ``aiote.membership`` watch)."""


class DecoderRegistration(Protocol):
    """A decode worker's registration: an async context manager (registered inside it) that
    can announce the worker is leaving."""

    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, et: Any, e: Any, tb: Any) -> Any: ...
    async def leave(self) -> None: ...


class DecoderRegistry(Protocol):
    """Where decode workers register (an ``aiote.membership`` group)."""

    def register(
        self, address: bytes, descriptors: Mapping[str, MemoryDescriptor], meta: Mapping[str, Any]
    ) -> DecoderRegistration: ...

