"""Registered memory regions."""

from __future__ import annotations

from typing import Any, Protocol

from ._descriptor import DEVICE_HOST, MemoryDescriptor
from ._errors import InvalidArgument

__all__ = ["MemoryRegion", "RegionOwner"]


class RegionOwner(Protocol):
    """What a region needs of its engine (the engine satisfies it; this module never imports
    the engine, which sits above it)."""

    _closed: bool


def host_buffer(obj: Any, *, writable: bool) -> tuple[Any, int]:
    """(exporting object, nbytes) of a C-contiguous host buffer; InvalidArgument otherwise.

    NumPy arrays and anything with the buffer protocol are accepted. ``writable`` demands a
    writable buffer (needed when peers may write into it, or when it is a READ target).
    """
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgument(
            f"cannot register a {type(obj).__name__}: pass a NumPy array or a buffer-protocol object"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument(
            "the buffer is not C-contiguous; register a contiguous array (numpy.ascontiguousarray)"
        )
    if writable and view.readonly:
        raise InvalidArgument(
            "the buffer is read-only but was registered for remote write; "
            "pass remote_write=False or register a writable array"
        )
    if view.nbytes == 0:
        raise InvalidArgument("cannot register an empty buffer")
    return obj, view.nbytes


class MemoryRegion:
    """A buffer registered with every NIC of an engine (``await engine.register(array)``).

    Holds a reference to the buffer so it outlives every transfer that uses it. ``descriptor``
    is what peers need to access it. Valid until ``await engine.unregister(mr)`` or until the
    engine closes. What registering raises and costs is in :meth:`Engine.register`; its
    attributes and properties cost O(1) and raise nothing.
    """

    __slots__ = (
        "_cbuf",
        "_dev",
        "_dev_pending",
        "_engine",
        "_handle",
        "_memos",
        "_obj",
        "_ptr",
        "_shadow",
        "descriptor",
        "nbytes",
        "remote_read",
        "remote_write",
        "writable",
    )

    def __init__(
        self,
        engine: RegionOwner,
        obj: Any,
        cbuf: Any,
        handle: Any,
        nbytes: int,
        descriptor: MemoryDescriptor,
        remote_write: bool,
        remote_read: bool,
    ) -> None:
        self._engine = engine
        self._obj = obj
        self._cbuf = cbuf
        self._handle = handle
        self._ptr = 0  # the native region's address, as posted in work-request descriptors
        self._dev: Any = None  # GPU regions: the device buffer (the native region is its shadow)
        self._shadow: Any = None  # GPU regions: the pinned host shadow registered with the NICs
        self._dev_pending = 0  # GPU regions: device copies in flight on it
        self._memos: dict[Any, Any] = {}  # the engine's single-route host writes from it (Engine.write)
        self.nbytes = nbytes
        self.descriptor = descriptor
        self.remote_write = remote_write
        self.remote_read = remote_read
        self.writable = remote_write  # whether the buffer may be written locally (READ target)

    @property
    def buffer(self) -> Any:
        """The registered object (the NumPy or CuPy array passed to ``register``). O(1), raises
        nothing."""
        return self._obj

    @property
    def registered(self) -> bool:
        """False once unregistered or once its engine closed. O(1), raises nothing."""
        return self._handle is not None and not self._engine._closed

    @property
    def on_gpu(self) -> bool:
        """Whether the region is GPU memory. O(1), raises nothing."""
        return self.descriptor.device_kind != DEVICE_HOST

    @property
    def device(self) -> int | None:
        """The GPU ordinal of a GPU region; None for host memory. O(1), raises nothing."""
        return None if self._dev is None else int(self._dev.device)

    def __repr__(self) -> str:
        state = "registered" if self.registered else "unregistered"
        return f"<aiote.MemoryRegion {self.nbytes} B {state}>"
