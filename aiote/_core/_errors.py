"""The exception hierarchy. Every error aiote raises is an :class:`AioteError`."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AioteError",
    "InvalidArgument",
    "DescriptorError",
    "ProviderError",
    "RegistrationError",
    "RegionBusy",
    "TransferError",
    "RemoteAccessError",
    "PeerUnreachable",
    "TransferTimeout",
    "EngineClosed",
]


class AioteError(Exception):
    """Base class of every aiote error."""


class InvalidArgument(AioteError, ValueError):
    """An argument is wrong; raised before anything is posted, so nothing happened."""


class DescriptorError(InvalidArgument):
    """Descriptor or address bytes are corrupt, truncated or of an unknown version."""


class ProviderError(AioteError):
    """The libfabric provider or NIC asked for cannot be opened on this machine."""


class RegistrationError(AioteError):
    """Memory could not be registered (or unregistered) with the provider."""


class RegionBusy(RegistrationError):
    """A region cannot be unregistered: work requests that touch it are in flight."""


class TransferError(AioteError):
    """A posted operation completed with an error.

    ``code`` is the libfabric error number (positive), ``prov_errno`` the provider's own.
    """

    def __init__(self, message: str, code: int = 0, prov_errno: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.prov_errno = prov_errno


class RemoteAccessError(TransferError):
    """The peer refused the access: wrong key, region too small or not remotely accessible."""


class PeerUnreachable(TransferError):
    """The peer cannot be reached (not listening, gone, or the connection broke)."""


class TransferTimeout(AioteError, TimeoutError):
    """An operation did not finish before its deadline.

    A write that timed out may or may not have landed at the peer; its source buffer stays
    owned by the engine until the transport lets go of it. ``await exc.settled()`` waits for
    that moment (after it, nothing the operation posted can still land).
    """

    _waiter: Any = None
    _landed: Any = None  # after settling: whether every request was posted and succeeded

    async def settled(self) -> None:
        """Returns once every request the timed-out operation had posted has completed (or
        at once when nothing was posted), and, for an operation split over several NICs or
        streams, once the engine has sent its deferred credit (after every piece landed; none
        when one failed). Cancellable; no deadline of its own."""
        if self._waiter is not None:
            await self._waiter()


class TransferStalled(TransferTimeout):
    """An operation made no progress (none of its requests completed) for its retry policy's
    ``stall_timeout`` (:class:`~aiote.RetryPolicy`; 30 s by default): the peer is stopped,
    wedged, or slower than that bound allows. A :class:`TransferTimeout`: what was posted may
    still land, and ``await exc.settled()`` waits until the transport let go of it. The
    message names the NICs the operation's requests left through and how many were pending."""


class EngineClosed(AioteError):
    """The engine is closed (or closing); nothing more can be posted."""
