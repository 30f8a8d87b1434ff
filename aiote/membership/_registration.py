"""An engine registered in a group: its record under a lease that a background task keeps
alive, re-created if etcd let the lease go while the process lived."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from aiote import EngineAddress, InvalidArgument, MemoryDescriptor
from aiote._core._log import get_logger

from ._etcd import EtcdClient, EtcdUnavailable, MembershipError
from ._records import encode_value, member_key

__all__ = ["MemberExists", "Registration"]

_log = get_logger(component="membership")


class MemberExists(MembershipError):
    """Another live registration holds the name in this group."""


class Registration:
    """The registration of one engine in a group; obtained from
    :meth:`~aiote.membership.Membership.register` and used as an async context manager.

    Entering grants a lease of ``ttl`` seconds and creates the member's key under it
    (:class:`~aiote.membership.MemberExists` if another registration holds the name;
    :class:`~aiote.membership.EtcdUnavailable` naming the endpoints if etcd does not answer within the
    client's timeout); a background task then renews the lease every ``ttl / 3`` seconds. While
    etcd cannot be reached the task keeps trying (``alive`` turns False) and nothing else
    changes; if etcd let the lease expire meanwhile (the member was dropped from its group),
    the task registers the member again under a new lease once etcd answers
    (``reregistered`` counts it). Leaving the block announces the member is leaving (as
    :meth:`leave`, unless done already: watchers see a clean leave) and revokes the lease,
    which deletes the key (two requests, each bounded by the client's timeout; errors are
    logged, not raised). A process that dies without leaving disappears when its lease
    expires, ``ttl`` seconds (at most) after its last renewal: watchers see a leave without
    notice.

    Costs: one lease and one key in etcd, one renewal request every ``ttl / 3`` seconds."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        group: str,
        name: str,
        address: bytes,
        descriptors: Mapping[str, MemoryDescriptor | bytes],
        meta: Mapping[str, Any],
        ttl: float,
    ) -> None:
        if not ttl > 0:
            raise InvalidArgument(f"ttl must be > 0, not {ttl!r}")
        EngineAddress.from_bytes(bytes(address))  # DescriptorError early
        for v in descriptors.values():
            MemoryDescriptor.from_bytes(bytes(v))
        self._etcd = client
        self.group = group
        self.name = name
        self.key = member_key(prefix, group, name)
        self.ttl = float(ttl)
        self._fields: dict[str, Any] = {
            "address": bytes(address), "descriptors": dict(descriptors), "meta": dict(meta),
            "host": socket.gethostname(), "pid": os.getpid(),
        }
        encode_value(**self._fields)  # InvalidArgument early (meta not JSON-ready, too large)
        self.leaving = False
        self.lease = 0
        self.alive = False
        self.renewals = 0
        self.reregistered = 0
        self._tg: anyio.abc.TaskGroup | None = None

    def _value(self) -> bytes:
        return encode_value(leaving=self.leaving, **self._fields)

    async def _register(self) -> None:
        lease, granted = await self._etcd.grant(self.ttl)
        try:
            if not await self._etcd.create(self.key, self._value(), lease=lease):
                raise MemberExists(f"{self.key.decode()} is registered by another engine")
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._etcd.timeout):
                await self._etcd.revoke(lease)
            raise
        self.lease = lease
        self.ttl = float(granted or self.ttl)
        self.alive = True
        _log.info("registered", key=self.key.decode(), lease=lease, ttl=self.ttl)

    async def __aenter__(self) -> Registration:
        await self._register()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._keep_alive)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        self._tg = None
        with anyio.CancelScope(shield=True):
            try:
                await self.leave()  # watchers see a clean leave, then the key goes
                await self._etcd.revoke(self.lease)
                _log.info("deregistered", key=self.key.decode())
            except MembershipError as exc:
                _log.warning("could not deregister; the key goes when its lease expires",
                             key=self.key.decode(), error=str(exc))
        self.alive = False

    async def leave(self) -> None:
        """Announces that the member is leaving: its record says so (watchers see a clean
        leave at once; the key stays until the block ends). Idempotent once it succeeded.
        Raises :class:`~aiote.membership.EtcdUnavailable` when etcd does not answer within the
        client's timeout, :class:`~aiote.membership.EtcdError` when etcd refused (the lease was
        lost: a renewal registers the member again); then nothing was announced and it may be
        called again (the renewals go on; leaving the block still deletes the key); costs one
        request."""
        if self.leaving:
            return
        self.leaving = True  # a re-registration meanwhile announces it too
        try:
            await self._etcd.put(self.key, self._value(), lease=self.lease)
        except BaseException:
            self.leaving = False
            raise

    async def _renew(self) -> None:
        left = await self._etcd.keepalive(self.lease, timeout=self.ttl / 3)
        if left > 0:
            self.renewals += 1
            return
        _log.warning("lease expired while etcd was out of reach; registering again", key=self.key.decode())
        self.alive = False
        await self._register()
        self.reregistered += 1

    async def _keep_alive(self) -> None:
        interval = self.ttl / 3
        while True:
            await anyio.sleep(interval)
            try:
                await self._renew()
            except (EtcdUnavailable, MembershipError) as exc:
                if self.alive:
                    _log.warning("cannot renew the lease; retrying", key=self.key.decode(), error=str(exc))
                self.alive = False
                continue
            if not self.alive:
                _log.info("lease renewed again", key=self.key.decode())
            self.alive = True
