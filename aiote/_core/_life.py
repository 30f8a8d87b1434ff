"""The life of an operation: groups of rows posted per NIC, their completions, deadlines,
cancellation (settle) and stranded rows after a failover; its retries are in ``_retries``."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import anyio
import numpy as np

from .._native import ffi, lib
from ._errors import EngineClosed, PeerUnreachable, TransferStalled, TransferTimeout
from ._optable import Posting, _Op, merge_nic_failures
from ._records import _GROUPS, _POLICY, _STRANDED, _end, _Group, _left
from ._retries import Retries
from ._rules import LINK_POLL, GroupWatch
from ._util import deadline_at, now, timeout_error, wait_until
from ._wire import _completion_error, _post_error


class OpLife(Retries):
    """The life of an operation: groups, posting, completion, deadline, cancellation (its
    retries: :class:`Retries`)."""

    def _kept_once(
        self, post: Callable[[Any, int, int], int], n: int, refs: Any, items: Any, what: str,
        timeout: float | None,
    ) -> Coroutine[Any, Any, bool]:
        """One attempt of a kept request (see ``_memo_post``): :meth:`_run_group` (no rails,
        route or names to pass on) begun in this call, returning the coroutine that finishes it
        (the group's wait alone when the transport took every request at once), so that it
        adds no coroutine layer under :meth:`_attempts` (each layer is paid when the operation
        suspends and again when it resumes, on the loop thread both sides of a round trip
        wait for). ``timeout`` was checked by :meth:`_attempts`, or is what its deadline left."""
        end = None if timeout is None else now() + timeout
        st = self._begin(n, refs, None, None, items)
        if st.first == n and not self._closed:
            return self._await_group(st.op, end, timeout, what)
        return self._finish(st, post, n, end, timeout, what)

    async def _settle(self, op: _Op) -> None:
        """Waits until the group of ``op`` has completed (its completion record arrived), the
        engine closed, or its same-host peer is gone (see :meth:`_wake_or_gone`)."""
        while not op.done and not self._closed:
            ev = op.event
            if ev.is_set():  # set by a failover wake-up, not by the completion
                ev = op.event = self._event()
            if not await self._wake_or_gone(op, ev):
                return

    async def _wake_or_gone(self, op: _Op, ev: Any, seen: dict[bytes, bool] | None = None) -> bool:
        """Waits for ``ev`` (``op``'s wake-up): True once set; False when every request of
        ``op`` goes to a same-host peer that is gone (:meth:`_gone_peer`), looked at before
        waiting and every LINK_POLL seconds while it waits, on an engine with shm rails; a
        plain wait otherwise. ``seen``: as for :meth:`_gone_peer`."""
        if not self._shm_rails or (op.rails is not None and not op.rails & self._shm_rails):
            await ev.wait()
            return True
        while not ev.is_set():
            if self._gone_peer(op, seen):
                return False
            if await wait_until(ev, now() + LINK_POLL):
                break
        return True

    async def _settle_all(self, ops: list[Any]) -> None:
        for op in ops:
            await self._settle(op)

    async def wait_stranded(self) -> None:
        """Waits until no request that a failover left on a failed link is still owned by the
        transport (``stats()["stranded"]`` is 0): after it, none of them can land any more.
        Returns at once when there is none (or the engine is closed); waits as long as the link
        stays down. Raises nothing of its own; cancellable. Costs an O(pending) scan per stranded
        group, no native call; the task sleeps until each one's completion wakes it."""
        gone: set[int] = set()  # ops whose same-host peer is gone: nothing to wait for
        while True:
            op = next((o for o in self._ops.stranded() if id(o) not in gone), None)
            if op is None or self._closed:
                return
            await self._settle(op)
            if not op.done:
                gone.add(id(op))

    async def _wait_space(self, fallback: float, end: float | None = None) -> Any:
        """Waits until half of this engine's requests in flight completed (room in the
        queues) or ``fallback`` seconds pass, or the deadline ``end``; returns the handle
        (EngineClosed if closing meanwhile)."""
        t = now()
        when = t + fallback if end is None else min(t + fallback, end)
        inflight = int(lib.aio_ops_in_flight(self._h))
        if inflight == 0:  # nothing will complete (a peer still connecting): the timer only
            return await self._pause(max(0.0, when - t))
        ev = self._space
        lib.aio_want_space(self._h, inflight // 2)
        await wait_until(ev, when)
        return self._check_open()

    # ------------------------------------------------------------------ posting

    async def _run(
        self, table: np.ndarray, refs: Any, timeout: float | None, what: str, path: Any = None
    ) -> None:
        """:meth:`_run_routes`, counted in ``_opening`` from its first step (before its groups
        open, so a transfer another task builds meanwhile sees it: see :meth:`_rows`)."""
        self._opening += 1
        try:
            await self._run_routes(table, refs, timeout, what, path)
        finally:
            self._opening -= 1

    async def _run_routes(
        self, table: np.ndarray, refs: Any, timeout: float | None, what: str, path: Any = None
    ) -> None:
        """Posts the rows of ``table`` and waits for all of them.

        ``path``: the full route set of the one peer region every row addresses (single-peer
        operations). With it, rows on several NICs go as one group per NIC, and when a NIC's
        link goes down the rows of its group are posted again over the remaining NICs (the
        original requests stay owned until the transport lets go of them). Without it (scatter,
        batches), one group; a failed link leaves its rows to the operation's deadline."""
        if path is None or len(path) == 1:  # no failover possible: one group
            await self._run_table(table, refs, timeout, what)
            return
        rails = table["rail"]
        end = _end(timeout)
        if len(table) == 1 or bool((rails == rails[0]).all()):
            if await self._run_table(table, refs, timeout, what, {int(rails[0])}, path):
                await self._run_routes(self._reroute(table, path), refs, _left(end), what, path)
            return
        errors: list[BaseException] = []

        async def one(sub: np.ndarray, rail: int) -> None:
            try:
                if await self._run_table(sub, refs, _left(end), what, {rail}, path):
                    await self._run_routes(self._reroute(sub, path), refs, _left(end), what, path)
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for rail in np.unique(rails).tolist():
                tg.start_soon(one, table[rails == rail], int(rail))
        if errors:
            # a group still posted somewhere: the timeout (so the caller can settle it), with
            # every NIC's waiter; otherwise the first error
            raise merge_nic_failures(errors)

    async def _run_table(
        self,
        table: np.ndarray,
        refs: Any,
        timeout: float | None,
        what: str,
        rails: set[int] | None = None,
        path: Any = None,
        names: frozenset[tuple[int, int]] | None = None,
    ) -> bool:
        ptr = ffi.from_buffer("aio_op_desc[]", table)
        post = self._poster(ptr, len(table))
        return await self._run_group(post, len(table), (refs, table), timeout, what, rails, path, ptr, names)

    def _poster(self, ptr: Any, n: int) -> Callable[[Any, int, int], int]:
        """The ``post`` of :meth:`_run_group` for the ``n`` rows at ``ptr``."""
        budget = self._budget_ns

        def post(h: Any, g: int, posted: int) -> int:
            return int(lib.aio_post(h, g, ptr + posted, n - posted, budget))

        return post

    async def _run_group(
        self,
        post: Callable[[Any, int, int], int],
        n: int,
        refs: Any,
        timeout: float | None,
        what: str,
        rails: set[int] | None = None,
        path: Any = None,
        items: Any = None,
        names: frozenset[tuple[int, int]] | None = None,
        opener: Callable[[Any, int, Any], int] | None = None,
    ) -> bool:
        """The life of one group of ``n`` work requests: open it (waiting while every group
        slot is in flight), post through ``post(handle, group, posted_so_far)`` (returns how
        many it posted, or a negative error) with back-off while the transport pushes back,
        seal, wait for the completion record, and map its status to an exception.
        ``items``: the rows as an ``aio_op_desc`` array, when ``post`` posts them with
        ``aio_post``: opening, the first post and sealing then take one native call.
        ``opener(handle, token, group_out)``: that one call for other requests (a message's
        ``aio_submit_sendv``), returning what it posted, the group it opened in ``group_out``.

        On cancellation what was posted cannot be taken back: ``refs`` (buffers, tables) stay
        owned until the completion, with a bounded shielded wait before the cancellation
        propagates. On timeout it raises at once and the completion releases ``refs`` later.

        ``rails``: the local rails the group posts on. Returns True when one of them lost its
        link before the group finished: the caller re-posts the work elsewhere, and the group
        keeps ``refs`` until the transport lets go of its requests."""
        # the deadline scope (a cancel scope and a timer: several microseconds) is entered only
        # around the awaits this makes, at the absolute deadline `end`
        end = _end(timeout)
        begun = self._begin(n, refs, rails, path, items, names=names, opener=opener)
        return await self._finish(begun, post, n, end, timeout, what)

    def _begin(
        self,
        n: int,
        refs: Any,
        rails: set[int] | None,
        path: Any,
        items: Any,
        quiet: bool = False,
        names: frozenset[tuple[int, int]] | None = None,
        opener: Callable[[Any, int, Any], int] | None = None,
    ) -> _Group:
        """The synchronous start of a group's life (see :meth:`_run_group`): opens the group
        and, with ``items``, posts what the transport takes at once and seals the group if
        that was everything (one native call, ``aio_submit``). The group is in ``_pending``
        (its completion record will find it) unless no group slot was free (``g < 0``).
        ``quiet`` (with ``items``): its completion record wakes nobody (``aio_submit_quiet``);
        who waits for it counts itself in with ``aio_quiet_waiters``."""
        h = self._check_open()
        op = _Op(refs, self._event())
        op.rails = rails
        op.names = names
        op.path = path
        if path is not None:
            op.alts = frozenset(hop[0] for hop in path)
        token = next(self._tokens)
        groups = _GROUPS.get()
        if groups is not None:
            groups.append(op)
        first: int | None = None  # what aio_submit posted (it opened, posted, sealed if all went)
        ended = False  # the group ended in the call (a small shm message): no record comes
        if (items is not None or opener is not None) and not self._router.down:
            gout = self._gout
            if opener is not None:
                k = opener(h, token, gout)
                ended = bool(gout[1])
            else:
                submit = lib.aio_submit_quiet if quiet else lib.aio_submit
                k = int(submit(h, token, items, n, self._budget_ns, gout))
            g = int(gout[0])
            if g >= 0:
                first = k
                op.posted = max(k, 0)
                if ended:
                    op.complete(int(gout[2]), int(gout[3]))
                    op.event.set()
        else:
            g = int(lib.aio_group_open(h, token))
        if g >= 0 and not ended:
            self._ops.add(token, op)
        op.g = g
        return _Group(op, token, g, first)

    async def _finish(
        self,
        st: _Group,
        post: Callable[[Any, int, int], int],
        n: int,
        end: float | None,
        timeout: float | None,
        what: str,
    ) -> bool:
        """The rest of a group's life after :meth:`_begin`: a free group slot, posting what is
        left (as :class:`Posting` says), sealing, the completion and its status (see
        :meth:`_run_group`)."""
        if self._closed:  # begun by post_write, finished by a background task: too late
            raise EngineClosed(f"{what}: the engine closed before the operation was posted")
        op, first = st.op, st.first
        if first == n:  # aio_submit posted every request and sealed the group: only the wait is left
            if op.done:  # it ended in that call (a small shm message): a schedule point, no wait
                await self._checkpoint()
                return self._outcome(op, what)
            return await self._await_group(op, end, timeout, what)
        g = st.g if st.g >= 0 else await self._wait_group_slot(op, st.token, end, timeout, what)
        if op.move_before_posting(self._router.down):
            # a link went down before this group posted anything (while it waited for a slot,
            # or since its rows were built): move it at once instead of posting to that NIC
            self._seal(g)
            return True
        op.posted = 0  # what aio_submit posted is counted by its first step below
        posting = Posting(op, n, self._connect_timeout())
        step = await self._post_all(posting, post, g, first, end, timeout, what)
        if step == "stalled":
            raise self._stalled(what)
        if step == "error":
            raise _post_error(posting.error, what, op.posted)
        return await self._await_group(op, end, timeout, what)

    async def _post_all(
        self,
        posting: Posting,
        post: Callable[[Any, int, int], int],
        g: int,
        first: int | None,
        end: float | None,
        timeout: float | None,
        what: str,
    ) -> str:
        """Posts group ``g``'s requests until :class:`Posting` says to stop (``first``: what
        ``aio_submit`` already posted), then seals the group; returns the last step. Waits
        for room between tries (the next completion, with a back-off timer as the fallback:
        a timer alone would cost a full millisecond under asyncio). A deadline while posting
        raises TransferTimeout (nothing posted: no waiter); a cancellation waits, shielded, for
        what was posted (see :meth:`_run_group`)."""
        op = posting.op
        h = self._h
        sealed = False
        try:
            while True:
                if first is not None:  # aio_submit's post
                    k, first = first, None
                else:
                    k = post(h, g, op.posted)
                step = posting.on_post(k, now() if k == 0 else 0.0)  # the clock only when stuck
                if step != "wait":
                    break
                h = await self._wait_space(posting.pause, end)
                if end is not None and now() >= end:
                    assert timeout is not None
                    raise timeout_error(what, timeout)
            self._seal(g)
            sealed = True
        except TransferTimeout as timed_out:  # while posting: not everything went out
            if not sealed:
                self._seal(g)
            if op.posted == 0:
                raise TransferTimeout(f"{what}: nothing could be posted before the deadline") from None
            timed_out._waiter = partial(self._settle, op)
            timed_out._landed = lambda: False  # a part was never posted
            raise
        except BaseException:
            if not sealed:
                self._seal(g)
            if op.must_settle():
                await self._settle_cancelled(op)
            raise
        return step

    async def _wait_group_slot(
        self, op: _Op, token: int, end: float | None, timeout: float | None, what: str
    ) -> int:
        """Waits for a free native group slot for ``op`` (every slot is in flight), opens it and
        marks ``op`` pending; returns the group. The slow path of :meth:`_finish`."""
        g = -1
        attempt = 0
        try:
            with deadline_at(end, timeout, what):
                while g < 0:
                    attempt += 1
                    h = await self._pause(min(0.0001 * attempt, 0.005))
                    g = op.g = lib.aio_group_open(h, token)
        except BaseException:
            if g >= 0:
                self._seal(g)
            raise
        self._ops.add(token, op)
        return g

    def _stalled(self, what: str) -> PeerUnreachable:
        """Posting made no progress for connect_timeout: the peer is not answering (final: that
        wait was the retry)."""
        stalled = PeerUnreachable(
            f"{what}: the peer did not answer within connect_timeout={self._connect_timeout():g} s "
            "(nothing listening at its address, or it is gone)",
            111,
            0,
        )
        stalled._final = True  # type: ignore[attr-defined]  # that wait was the retry
        return stalled

    async def _await_group(
        self, op: _Op, end: float | None, timeout: float | None, what: str, since: float | None = None
    ) -> bool:
        """The end of a group's life once every request of it was posted and it was sealed:
        waits for its completion record until ``end`` and returns :meth:`_outcome`. On
        timeout raises TransferTimeout at once (the completion releases the buffers later;
        its ``_landed`` says whether everything landed); on cancellation waits, shielded,
        up to ``cancel_grace`` for the completion first (see :meth:`_run_group`)."""
        try:
            if self._loop_spin_ns:
                self._spin_until(op.event.is_set)
            if not op.event.is_set() and not await self._wait_moving(op, end, what, since):
                assert timeout is not None
                raise timeout_error(what, timeout)
        except TransferTimeout as timed_out:
            timed_out._waiter = partial(self._settle, op)
            # every request posted: all land unless one fails
            timed_out._landed = op.landed
            raise
        except BaseException as exc:
            # a posted request cannot be taken back (unless the failure says nothing will
            # come: see _wait_moving)
            if op.must_settle(getattr(exc, "_final", False)):
                await self._settle_cancelled(op)
            raise
        return self._outcome(op, what)

    async def _wait_moving(self, op: _Op, end: float | None, what: str, since: float | None = None) -> bool:
        """Waits for ``op``'s completion until ``end``: True once it came, False at ``end``.
        Raises :class:`TransferStalled` when none of its requests completed for the policy's
        ``stall_timeout`` (a request completing is progress: a slow peer that keeps taking
        bytes never trips it; a peer that takes nothing, stopped or wedged, does), and
        :class:`PeerUnreachable` once every NIC that reaches its peer has been down for
        ``connect_timeout`` (its requests stay owned by the transport, and land if a link
        comes back: it is not posted again). ``since``: the stall bound counts from then (a
        combined message's sends, which waited for it on their own first), not from now."""
        p = _POLICY.get()
        policy = p if p is not None else self._retry
        stall = policy.stall_timeout
        # a same-host peer's death shows only by looking (shm takes nothing from a dead
        # peer): ops that may go to one are watched; the rails alone tell, where known
        shm_rails = self._shm_rails if op.rails is None or op.rails & self._shm_rails else None
        if stall is None and not self._router.down and not shm_rails:
            return await wait_until(op.event, end)
        h = self._h
        last = int(lib.aio_group_pending(h, op.g)) if op.g >= 0 else -1
        moved = now() if since is None else since  # (since: when a waiter that woke early began)
        # the first wait is GroupWatch.wake_at inlined (every awaited operation under a stall
        # bound comes here: no object until it wakes without its completion)
        marks = [x for x in (end, None if stall is None else moved + stall) if x is not None]
        if self._router.down or shm_rails:
            # are all the peer's NICs down, and for how long? has a same-host peer gone?
            marks.append(moved + LINK_POLL)
        if await wait_until(op.event, min(marks) if marks else None):
            return True
        watch = GroupWatch(end, stall, policy.connect_timeout, last, moved)
        shm = bool(shm_rails and self._shm_peers(op))  # does it go to a same-host peer? (O(rows))
        while True:
            t = now()
            pending = int(lib.aio_group_pending(h, op.g)) if op.g >= 0 else -1
            if shm and not op.event.is_set() and pending == watch.last and self._gone_peer(op):
                exc = PeerUnreachable(
                    f"{what}: the same-host peer ({self._peer_names(op)}) is gone (its process "
                    f"exited or its engine closed); {pending} of its requests stay with the transport",
                    101,
                    0,
                )
                exc._final = True  # type: ignore[attr-defined]  # not posted again
                raise exc
            gone = self._all_down_for(op, t)
            verdict = watch.on_wake(t, op.event.is_set(), pending, gone)
            if verdict == "timeout":
                return False
            if verdict == "unreachable":
                exc = PeerUnreachable(
                    f"{what}: every NIC that reaches the peer ({self._peer_names(op)}) has been down for "
                    f"{gone:.1f} s (connect_timeout={policy.connect_timeout:g} s); {pending} of its requests "
                    "stay with the transport and land if a link comes back",
                    101,
                    0,
                )
                exc._final = True  # type: ignore[attr-defined]  # not posted again
                raise exc
            if verdict == "stalled":
                raise TransferStalled(
                    f"{what}: no request of it completed for stall_timeout={stall:g} s "
                    f"({pending} of its requests still in flight to the peer through "
                    f"{self._peer_names(op)}); the peer is stopped, wedged or too slow for the bound",
                )
            if await wait_until(op.event, watch.wake_at(bool(self._router.down or shm), now())):
                return True

    async def _settle_cancelled(self, op: _Op) -> None:
        """A posted request cannot be taken back: keeps its buffers until the NIC is done
        (a failover wake-up is not the completion: :meth:`_settle` waits for that), for at
        most ``cancel_grace``, shielded from the cancellation being raised."""
        with anyio.move_on_after(self._cancel_grace, shield=True):
            await self._settle(op)

    @staticmethod
    def _outcome(op: _Op, what: str) -> bool:
        """What the completed (or failover-woken) group ``op`` means (:meth:`_Op.outcome`):
        True when its work must be re-posted on other NICs (the group stays owned until the
        transport lets go: collected as stranded where a caller asked), False when it landed;
        raises its error."""
        outcome = op.outcome()
        if outcome == "landed":
            return False
        if outcome == "moved":
            stranded = _STRANDED.get()
            if stranded is not None:
                stranded.append(op)
            return True
        if outcome == "closed":
            raise EngineClosed(f"{what}: the engine closed before the operation completed")
        raise _completion_error(op.status, op.prov_errno, what)
