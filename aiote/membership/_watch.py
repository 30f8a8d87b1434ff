"""Watching a group: the current members, then every join and leave, across etcd outages
and member failures (the watch resumes where it stopped, or reads the group again)."""

from __future__ import annotations

import math
import random
from types import TracebackType

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from aiote._core._log import get_logger

from ._etcd import EtcdClient, MembershipError
from ._records import GroupView, Member, MemberEvent, WatchCancelled, as_int

__all__ = ["GroupWatch"]

_log = get_logger(component="membership")


def _log_corrupt(key: str, why: str) -> None:
    _log.warning("skipped a corrupt member entry", key=key, reason=why)


class GroupWatch:
    """The members of a group and its changes, kept current by a background task; obtained
    from :meth:`~aiote.membership.Membership.watch` and used as an async context manager and an async iterator
    of :class:`~aiote.membership.MemberEvent`::

        async with members.watch("kv/decode") as watch:
            async for event in watch:       # a join per current member first, then changes
                ...

    Entering reads the group once (raises :class:`~aiote.membership.EtcdUnavailable` naming the endpoints when
    etcd does not answer within the client's timeout); :attr:`members` is then current and
    the iterator starts with a join for each member. Afterwards the task follows etcd's watch
    stream: when the stream breaks (etcd restarted, the member it talked to died or lost its
    leader) or the endpoint stops answering a health probe every ``probe_interval`` seconds,
    it tries the endpoints in turn, backing off up to 2 s, and resumes from the last revision
    it saw, so no change is lost (if that revision was compacted, it reads the group again
    and reports the difference). While etcd is out of reach the view stays as it was: nobody
    leaves because etcd is gone. Corrupt entries are skipped and logged.

    Iterating waits for the next event with no time limit (``anext`` within a cancel scope,
    or :meth:`next` with a timeout, bounds it); it ends when the block ends. Events wait in
    an unbounded buffer until read. ``reconnects`` counts the streams opened after the first;
    ``connected`` tells whether a stream is open now. Every ``probe_interval`` the stream's
    member must answer with a leader, and the stream must deliver the changes of the group
    that member holds: one found behind at two probes in a row, having delivered nothing in
    between (a NAT or firewall dropped the idle connection silently), is reopened from where
    it stopped. Costs one HTTP stream, a status request per ``probe_interval``, and a
    keys-only read of the group when the member's store has moved past the watch."""

    def __init__(self, client: EtcdClient, prefix: str, group: str, *, probe_interval: float = 5.0) -> None:
        self._etcd = client
        self.view = GroupView(prefix, group, _log_corrupt)
        self.group = group
        self.probe_interval = probe_interval
        self.connected = False
        self.reconnects = 0
        self._send: MemoryObjectSendStream[MemberEvent]
        self._recv: MemoryObjectReceiveStream[MemberEvent]
        self._send, self._recv = anyio.create_memory_object_stream[MemberEvent](math.inf)
        self._tg: anyio.abc.TaskGroup | None = None
        self._scope: anyio.CancelScope | None = None  # the open stream's
        self._url = client.endpoint
        self._opened = False
        self._stalled = False  # the open stream was dropped for falling behind

    @property
    def members(self) -> dict[str, Member]:
        """The current members by name (a new dict). O(members), raises nothing."""
        return dict(self.view.members)

    async def __aenter__(self) -> GroupWatch:
        await self._resync()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run)
        self._tg.start_soon(self._probe)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            self._tg = None
            self._send.close()

    def __aiter__(self) -> GroupWatch:
        return self

    async def __anext__(self) -> MemberEvent:
        try:
            return await self._recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def next(self, *, timeout: float | None = None) -> MemberEvent:
        """The next event. Raises TimeoutError after ``timeout`` seconds, StopAsyncIteration
        once the watch is closed. No I/O: it waits on the event buffer."""
        with anyio.fail_after(timeout):
            return await self.__anext__()

    def _emit(self, events: list[MemberEvent]) -> None:
        for ev in events:
            _log.info("member " + ev.kind, group=self.group, member=ev.member.name,
                      **({} if ev.joined else {"clean": ev.clean}))
            self._send.send_nowait(ev)

    async def _resync(self) -> None:
        answer = await self._etcd.call("/v3/kv/range", self.view.range_request())
        self._emit(self.view.apply_range(answer))

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                await self._etcd.status()  # an endpoint that answers becomes the client's first
                url = self._etcd.endpoint
                if self._opened:
                    self.reconnects += 1
                self._opened = True
                self._stalled = False
                with anyio.CancelScope() as self._scope:
                    self._url = url
                    await self._follow()
                if not self._scope.cancelled_caught:
                    why = "closed the stream"
                elif self._stalled:
                    why = "stopped delivering: the stream fell behind its member's store"
                else:
                    why = "failed its health probe"
            except WatchCancelled as exc:
                why = f"cancelled the watch: {exc}"
                if exc.compact_revision:
                    await self._retry_resync()
            except MembershipError as exc:  # unreachable, or a refusal or garbage from the gateway
                why = str(exc)
            finally:
                self._scope = None
                if self.connected:
                    backoff = 0.05
                self.connected = False
            # once per outage as a warning; the retries that follow at debug level
            log = _log.warning if backoff == 0.05 else _log.debug
            log("watch stream lost; reconnecting", group=self.group, endpoint=self._url, why=why)
            self._etcd.rotate()
            await anyio.sleep(backoff * (0.5 + random.random()))
            backoff = min(2.0, backoff * 2)

    async def _retry_resync(self) -> None:
        while True:
            try:
                await self._resync()
                return
            except MembershipError as exc:
                _log.debug("cannot read the group again yet", group=self.group, error=str(exc))
                await anyio.sleep(0.5)

    async def _follow(self) -> None:
        """One watch stream on :attr:`_url`, from the view's revision on, until it breaks."""
        async with self._etcd.stream("/v3/watch", self.view.watch_request(), endpoint=self._url) as lines:
            async for result in lines:
                if result.get("created"):
                    self.connected = True
                    _log.info("watching", group=self.group, endpoint=self._url, revision=self.view.revision)
                self._emit(self.view.apply_watch(result))

    async def _probe(self) -> None:
        """Every ``probe_interval``: the stream's endpoint must answer a status request and
        have a leader (a quiet stream shows no partition), and the stream must keep up with
        that member's store: when two probes in a row find a change of the group there that
        the stream has not delivered (:meth:`GroupView.behind`), with no event nor progress
        notification between them, the stream has stopped delivering (a NAT or firewall
        dropped the idle connection without a word). Either way the stream is dropped; the
        watch reopens one from the view's revision + 1, so nothing is lost. Costs a status
        request per interval, and a keys-only range of the group when the member's revision
        is past the view's."""
        behind: tuple[anyio.CancelScope, int] | None = None  # (stream, view revision) last found behind
        while True:
            await anyio.sleep(self.probe_interval)
            scope, url = self._scope, self._url
            if scope is None or not self.connected:
                behind = None
                continue
            timeout = min(self._etcd.timeout, self.probe_interval)
            stalled = False
            try:
                status = await self._etcd.call("/v3/maintenance/status", {}, endpoint=url, timeout=timeout)
                healthy = as_int(status.get("leader")) != 0
                header = status.get("header")
                store = as_int(header.get("revision")) if isinstance(header, dict) else 0
                rev = self.view.revision
                if healthy and store > rev:
                    keys = await self._etcd.call("/v3/kv/range", self.view.keys_request(), endpoint=url,
                                                 timeout=timeout)
                    if not self.view.behind(keys):
                        behind = None
                    elif behind == (scope, rev) and self.view.revision == rev:
                        stalled = True
                    else:
                        behind = (scope, rev)
                else:
                    behind = None
            except (MembershipError, ValueError):
                healthy = False
            if (stalled or not healthy) and scope is self._scope:
                self._stalled = stalled
                behind = None
                scope.cancel()
