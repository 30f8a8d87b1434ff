"""The entry point: a connection to etcd, and groups to register in, watch and read."""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio

from aiote import InvalidArgument, MemoryDescriptor

from ._etcd import EtcdClient, MembershipError
from ._records import DEFAULT_PREFIX, GroupView, Member, validate_group, validate_name
from ._registration import Registration
from ._watch import GroupWatch, _log_corrupt

__all__ = ["DEFAULT_TTL", "Group", "Membership", "by_rank", "connect"]

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

    async def ranks(self, world: int, *, timeout: float | None = 60.0) -> list[Member]:
        """Waits until ranks ``0 .. world-1`` are in the group, one live member each (its
        ``meta["rank"]``), and returns them in rank order: how the weight-update and MoE flows
        form their groups (``aiote.moe.Group([m.address for m in ms], rank)``; each inference
        rank's descriptors for the plan). Members leaving, or with no rank in range, are not
        counted; while two live members claim one rank (a restarted rank whose old lease has
        not expired yet) it waits. Raises :class:`~aiote.InvalidArgument` for a bad ``world``,
        :class:`~aiote.membership.MembershipError` when the ranks are not all there within
        ``timeout`` seconds (naming those missing, and those claimed twice with the members
        claiming them), and the watch's errors. Costs a watch of
        the group while it waits (one read, then its events)."""
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise InvalidArgument(f"world must be an int >= 1, not {world!r}")
        async with self.watch() as watch:
            try:
                with anyio.fail_after(timeout):
                    while (got := by_rank(watch.members.values(), world)) is None:
                        await watch.next()
            except TimeoutError:
                raise MembershipError(
                    f"group {self.name!r}: {_rank_problems(watch.members.values(), world)} within {timeout} s"
                ) from None
        return got


def _rank_problems(members: Iterable[Member], world: int) -> str:
    """What keeps ``members`` from forming ranks ``0 .. world-1``: the ranks missing, and those
    claimed by more than one live member (with their names)."""
    claims: dict[int, list[str]] = {}
    for m in members:
        r = m.meta.get("rank") if isinstance(m.meta, Mapping) else None
        if not m.leaving and not isinstance(r, bool) and isinstance(r, int) and 0 <= r < world:
            claims.setdefault(r, []).append(m.name)
    missing = [r for r in range(world) if r not in claims]
    parts = [f"ranks {missing} of {world} not there"] if missing else []
    parts += [f"rank {r} claimed by {len(ns)} live members ({', '.join(sorted(ns))})"
              for r, ns in sorted(claims.items()) if len(ns) > 1]
    return "; ".join(parts) or f"ranks 0..{world - 1} not all there"


def by_rank(members: Iterable[Member], world: int) -> list[Member] | None:
    """``members`` in rank order when ranks ``0 .. world-1`` each have exactly one live member
    (``meta["rank"]``, an int; members leaving are not counted), else None. O(members); pure."""
    slots: list[list[Member]] = [[] for _ in range(world)]
    for m in members:
        r = m.meta.get("rank") if isinstance(m.meta, Mapping) else None
        if m.leaving or isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
            continue
        slots[r].append(m)
    if any(len(s) != 1 for s in slots):
        return None
    return [s[0] for s in slots]


def connect(
    endpoints: str | Sequence[str], *, timeout: float = 5.0, prefix: str = DEFAULT_PREFIX
) -> Membership:
    """A :class:`~aiote.membership.Membership` on the etcd cluster at ``endpoints`` (client URLs, a list or
    comma-separated: ``"http://10.0.0.1:2379,http://10.0.0.2:2379"``); use it as ``async with
    membership.connect(url) as members:``. Raises :class:`~aiote.InvalidArgument` for an empty
    list, a URL that is not http(s) or a bad prefix, :class:`~aiote.membership.MembershipError` when httpx is
    not installed (``pip install 'aiote[etcd]'``); no I/O until entered."""
    return Membership(endpoints, timeout=timeout, prefix=prefix)
