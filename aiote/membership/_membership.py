"""The entry point: a connection to etcd, and groups to register in, watch and read."""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from aiote import InvalidArgument, MemoryDescriptor

from ._etcd import EtcdClient
from ._records import DEFAULT_PREFIX, GroupView, Member, validate_group, validate_name
from ._registration import Registration
from ._watch import GroupWatch, _log_corrupt

__all__ = ["DEFAULT_TTL", "Group", "Membership", "connect"]

DEFAULT_TTL = 5.0


def _default_name() -> str:
    host = re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class Membership:
    """A connection to an etcd cluster holding aiote's groups (under ``prefix``, default
    ``/aiote/``); build it with :func:`~aiote.membership.connect` and use it as an async context manager.

    Entering checks that an endpoint answers: :class:`~aiote.membership.EtcdUnavailable` naming the endpoints
    (and the last error) when none does within ``timeout`` seconds. Every call that talks to
    etcd is bounded by ``timeout`` and fails over between endpoints. Leaving closes the
    connections (registrations and watches must have ended first). Costs an HTTP connection
    pool; nothing runs in the background by itself."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout: float = 5.0,
                 prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise InvalidArgument(f"prefix must start and end with '/', not {prefix!r}")
        self.etcd = EtcdClient(endpoints, timeout=timeout)
        self.prefix = prefix

    @property
    def endpoints(self) -> list[str]:
        """The etcd client URLs, as given. O(endpoints), raises nothing."""
        return list(self.etcd.endpoints)

    async def __aenter__(self) -> Membership:
        await self.etcd.__aenter__()
        try:
            await self.etcd.status()
        except BaseException:
            await self.etcd.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.etcd.__aexit__(et, e, tb)

    def group(self, group: str, *, ttl: float = DEFAULT_TTL) -> Group:
        """``group`` of this cluster (``"kv/decode"``), its registrations taking leases of
        ``ttl`` seconds. Raises :class:`~aiote.InvalidArgument` for an invalid group path; no
        I/O."""
        return Group(self, validate_group(group), ttl)

    def register(
        self,
        group: str,
        address: bytes,
        *,
        descriptors: Mapping[str, MemoryDescriptor | bytes] | None = None,
        meta: Mapping[str, Any] | None = None,
        name: str | None = None,
        ttl: float = DEFAULT_TTL,
    ) -> Registration:
        """A registration of the engine at ``address`` (``engine.address``) in ``group``, with
        its named ``descriptors`` and ``meta`` (JSON-ready, small), under the member ``name``
        (default: host, process id and a random suffix). Enter it to register
        (:class:`~aiote.membership.Registration` says what that guarantees and raises). Raises now
        :class:`~aiote.InvalidArgument` for an invalid group or name, a ``ttl`` <= 0, or a
        ``meta`` that is not JSON-ready or too large, and :class:`~aiote.DescriptorError` for
        an address or descriptor that does not parse; no I/O."""
        return Registration(
            self.etcd, self.prefix, validate_group(group), validate_name(name or _default_name()),
            address, descriptors or {}, meta or {}, ttl,
        )

    def watch(self, group: str, *, probe_interval: float = 5.0) -> GroupWatch:
        """A watch of ``group``: enter it, then iterate its joins and leaves
        (:class:`~aiote.membership.GroupWatch` says what that guarantees and raises). Raises
        :class:`~aiote.InvalidArgument` for an invalid group path; no I/O until entered."""
        return GroupWatch(self.etcd, self.prefix, validate_group(group), probe_interval=probe_interval)

    async def snapshot(self, group: str, *, timeout: float | None = None) -> list[Member]:
        """The members of ``group`` now (those that announced they are leaving excluded), by
        name; corrupt entries are skipped and logged. Raises
        :class:`~aiote.membership.EtcdUnavailable` when no endpoint answers within ``timeout``
        (default: the connection's),
        :class:`~aiote.InvalidArgument` for an invalid group path. Costs one linearizable range
        request, O(members) parsing."""
        view = GroupView(self.prefix, validate_group(group), _log_corrupt)
        view.apply_range(await self.etcd.call("/v3/kv/range", view.range_request(), timeout=timeout))
        return [view.members[n] for n in sorted(view.members)]


class Group:
    """One group of a :class:`~aiote.membership.Membership` with a lease TTL for its registrations: what
    :class:`aiote.kv.DecodeWorker` takes as its ``registry``. Its methods are
    :class:`~aiote.membership.Membership`'s with the group filled in (same guarantees, errors and costs)."""

    def __init__(self, membership: Membership, group: str, ttl: float) -> None:
        self.membership = membership
        self.name = group
        self.ttl = ttl

    def register(
        self, address: bytes, descriptors: Mapping[str, MemoryDescriptor | bytes] | None = None,
        meta: Mapping[str, Any] | None = None, *, name: str | None = None,
    ) -> Registration:
        """:meth:`~aiote.membership.Membership.register` in this group with its TTL."""
        return self.membership.register(self.name, address, descriptors=descriptors, meta=meta, name=name,
                                        ttl=self.ttl)

    def watch(self, *, probe_interval: float = 5.0) -> GroupWatch:
        """:meth:`~aiote.membership.Membership.watch` of this group."""
        return self.membership.watch(self.name, probe_interval=probe_interval)

    async def snapshot(self, *, timeout: float | None = None) -> list[Member]:
        """:meth:`~aiote.membership.Membership.snapshot` of this group."""
        return await self.membership.snapshot(self.name, timeout=timeout)


def connect(
    endpoints: str | Sequence[str], *, timeout: float = 5.0, prefix: str = DEFAULT_PREFIX
) -> Membership:
    """A :class:`~aiote.membership.Membership` on the etcd cluster at ``endpoints`` (client URLs, a list or
    comma-separated: ``"http://10.0.0.1:2379,http://10.0.0.2:2379"``); use it as ``async with
    membership.connect(url) as members:``. Raises :class:`~aiote.InvalidArgument` for an empty
    list, a URL that is not http(s) or a bad prefix, :class:`~aiote.membership.MembershipError` when httpx is
    not installed (``pip install 'aiote[etcd]'``); no I/O until entered."""
    return Membership(endpoints, timeout=timeout, prefix=prefix)
