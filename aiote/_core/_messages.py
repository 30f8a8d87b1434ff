"""Messages: send/recv, the message slots, and the engine's internal messages (credits of
deferred immediates)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any

import anyio

from .._native import ffi, lib
from ._coalesce import Window, spans
from ._combined import CombinedSends, _opener
from ._counter import ImmCounter
from ._credits import GroupView, SendAfterTimeout, SendWhenLanded, after_data, all_landed
from ._descriptor import EngineAddress
from ._errors import EngineClosed, InvalidArgument, TransferTimeout
from ._optable import _Op
from ._records import _GROUPS, _check_retry, _end, _Group, _groups_list, _Held, _left, _RecvWaiter
from ._retry import RetryPolicy
from ._util import as_index, check_timeout, now, timeout_error, wait_until
from ._wire import (
    _ADDR_LEN,
    _CREDIT,
    _CREDIT_MSG,
    _INTERNAL,
    _K_CREDIT,
    _K_CREDIT_BYTE,
    _MSG_HEADER,
    _PACKED,
    _SPILL_BYTES,
    _U32,
    _Credits,
    _strerror,
)


class Messages(CombinedSends):
    """Messages: send/recv, message slots, and the engine's internal credit messages."""

    def _on_message(self, rail: int, slot: int, length: int, status: int) -> None:
        """A message arrived in ``slot``. Handed to a waiting receiver (copied out now), or
        queued in its slot (copied out when :meth:`recv` takes it) while the rail holds fewer
        than ``_hold_max`` or the queued copies already reach ``_SPILL_BYTES``, or else copied
        out and queued. Internal messages are consumed here."""
        n = _MSG_HEADER.size
        end = internal = packed = 0
        raw: Any = None
        if status == 0 and length >= n:
            raw = ffi.buffer(lib.aio_recv_slot(self._h, rail, slot), length)
            (alen,) = _MSG_HEADER.unpack_from(raw)
            internal = alen & _INTERNAL
            packed = alen & _PACKED
            end = n + (alen & _ADDR_LEN)
        if packed and raw is not None and end <= length:
            self._on_packed(rail, slot, raw, end, length)
            return
        if raw is None or end > length:
            lib.aio_recv_repost(self._h, rail, slot)
            if status != 0:
                self._log.warning("message dropped", rail=rail, error=_strerror(-status))
            else:
                self._log.warning("malformed message dropped", rail=rail, length=length)
            return
        if not internal and not self._recv_waiters and self._may_hold(rail, length - end):
            self._held[rail] += 1
            self._inbox.append(_Held(rail, slot, raw[n:end], end, length))
            return
        item = (raw[n:end], raw[end:length])  # sender and payload copied out, once each
        lib.aio_recv_repost(self._h, rail, slot)
        if internal:
            if item[1][:1] == _K_CREDIT_BYTE:
                self._on_credit(*item)
            elif self._gpu is None:
                self._log.warning("GPU staging message for an engine without GPU regions dropped")
            else:
                self._gpu.on_part(*item)
            return
        self._deliver(item)

    def _may_hold(self, rail: int, nbytes: int) -> bool:
        """May a message of ``nbytes`` (or a combined message's rest) stay in its slot of
        ``rail``? Yes while the rail holds fewer than ``_hold_max`` slots, and once the queued
        copies would pass ``_SPILL_BYTES`` (see :meth:`_on_message`)."""
        return self._held[rail] < self._hold_max or self._spilled + nbytes > _SPILL_BYTES

    def _on_packed(self, rail: int, slot: int, raw: Any, end: int, length: int) -> None:
        """A combined message (see :mod:`._coalesce`) arrived in ``slot``: its messages are
        queued in order, holding their shared slot as one message would (see
        :meth:`_on_message`), or copied out, each to a waiting receiver or the inbox."""
        parts = spans(raw, end, length)
        sender = raw[_MSG_HEADER.size : end]
        if parts is None:
            lib.aio_recv_repost(self._h, rail, slot)
            self._log.warning("malformed combined message dropped", rail=rail, length=length)
            return
        self._combined[2] += 1
        # waiting receivers get theirs now (copied out); the rest stay in the slot, taken one
        # at a time (a burst of large copies would make the allocator return and fault in
        # pages on every combined message), or are copied out while the slots are short
        waiters = self._recv_waiters
        first = min(len(waiters), len(parts))
        items = [(sender, raw[a:b]) for a, b in parts[:first]]
        rest = parts[first:]
        if rest and self._may_hold(rail, length - end):
            self._held[rail] += 1
            share = [len(rest)]
            self._inbox.extend(_Held(rail, slot, sender, a, b, share) for a, b in rest)
        else:
            items += [(sender, raw[a:b]) for a, b in rest]
            lib.aio_recv_repost(self._h, rail, slot)
        for item in items:
            self._deliver(item)

    def _deliver(self, item: tuple[bytes, bytes], first: bool = False) -> None:
        """A copied-out message to the longest-waiting receiver, or else into the inbox (at its
        end, or ``first``: at its front), counted in ``_spilled``."""
        if self._recv_waiters:
            w = self._recv_waiters.popleft()
            w.item = item
            w.event.set()
            return
        self._spilled += len(item[1])
        if first:
            self._inbox.appendleft(item)
        else:
            self._inbox.append(item)

    def _take(self, item: tuple[bytes, bytes] | _Held) -> tuple[bytes, bytes]:
        """``item`` as ``(sender, payload)``; a held one is copied out of its slot, which goes
        back to the transport."""
        if not isinstance(item, _Held):
            self._spilled -= len(item[1])
            return item
        if self._closed:  # after the teardown the slots are gone (closing: still there)
            raise EngineClosed("the engine closed while receiving")
        h = self._h
        payload = ffi.buffer(lib.aio_recv_slot(h, item.rail, item.slot), item.end)[item.start :]
        share = item.share
        if share is not None:  # one of a combined message's: the last one gives the slot back
            share[0] -= 1
            if share[0]:
                return item.sender, payload
        lib.aio_recv_repost(h, item.rail, item.slot)
        self._held[item.rail] -= 1
        return item.sender, payload

    async def _then_credit(
        self, data: Awaitable[None], credits: _Credits, end: float | None, what: str,
        rows: int,
    ) -> None:
        """Awaits ``data`` (the ``rows`` requests of an operation over several routes), then
        sends its deferred ``credits`` (see :meth:`_rows`). When ``data`` times out after
        posting, a background task sends the credits once every posted request has landed, and
        the :class:`TransferTimeout`'s ``settled()`` waits for that too: a timed-out operation
        is counted once its data is in place, as over a single route (never when a request
        failed or was never posted). A cancelled one likewise, once all ``rows`` requests were
        posted before the cancellation (see :meth:`_credit_after_cancel`)."""
        if not credits:
            await data
            return
        groups: list[_Op] = _groups_list()
        token = _GROUPS.set(groups)
        try:
            await data
        except BaseException as exc:
            _GROUPS.reset(token)  # (before a background task copies this context)
            # cancelled: after the groups did what they could (a request that failed raises
            # an error instead: its data is not all in place, never counted)
            if isinstance(exc, TransferTimeout):
                outcome, posted_any = "timeout", exc._waiter is not None
            elif isinstance(exc, anyio.get_cancelled_exc_class()):
                outcome, posted_any = "cancelled", True
            else:
                outcome, posted_any = "failed", True
            decision = after_data(outcome, groups, rows, closed=self._closed, posted_any=posted_any)
            if isinstance(decision, SendAfterTimeout):
                assert isinstance(exc, TransferTimeout)
                self._credit_later(exc, dict(credits), what)
            elif isinstance(decision, SendWhenLanded):
                self._credit_after_cancel(decision.groups, dict(credits), what)
            raise
        _GROUPS.reset(token)
        await self._send_credits(credits, end, what)

    def _credit_after_cancel(self, live: Sequence[GroupView], credits: _Credits, what: str) -> None:
        """After a cancellation that left every request of the operation posted on ``live``
        (the groups not moved by a failover: see :func:`after_data`), a background task sends
        its ``credits`` once every one of them completed without error, so the cancelled
        operation is counted once, as over a single route where the immediate travels with the
        data."""

        async def landed() -> bool:
            for op in live:
                await self._settle(op)  # type: ignore[arg-type]  # the engine's groups are _Op
            return all_landed(live)

        self._credits_later(credits, what, "cancellation", landed)

    def _credit_later(self, exc: TransferTimeout, credits: _Credits, what: str) -> None:
        """Sends ``credits`` from a background task once the timed-out operation of ``exc``
        has settled and every request of it landed; ``exc.settled()`` then waits for that task."""
        settle, landed = exc._waiter, exc._landed

        async def all_landed() -> bool:
            await settle()
            return landed is not None and landed()

        exc._waiter = self._credits_later(credits, what, "timeout", all_landed).wait

    async def _send_credits(
        self, credits: _Credits, end: float | None, what: str, seqs: dict[Any, int] | None = None
    ) -> None:
        """Sends deferred credits (see :meth:`_rows`): one internal message per (peer, imm)
        carrying the credits and a sequence number that the peer's engine counts once
        (:meth:`_on_credit`). A message, not a zero-byte write: a write stranded on a NIC that
        lost its link can still land when the link comes back, after its copy was re-posted on
        another NIC, and be counted twice; a message posted twice is still counted once.
        ``seqs`` (credit key -> number) keeps the numbers drawn for these credits: cancelled
        meanwhile, the credits not sent yet go from a background task with the same numbers (a
        message already out counts once), so the operation is still counted once."""
        seqs = {} if seqs is None else seqs
        left = dict(credits)
        try:
            for key, n in credits.items():
                _, imm, owner = key
                seq = seqs.setdefault(key, next(self._credit_seq))
                payload = _CREDIT_MSG.pack(_K_CREDIT, seq, imm, n * _CREDIT)
                await self._send_msg(owner, payload, _left(end), None, internal=True)
                del left[key]
        except BaseException as exc:
            if left and isinstance(exc, anyio.get_cancelled_exc_class()) and not self._closed:
                self._credits_later(left, what, "cancellation", seqs=seqs)
            raise

    def _on_credit(self, sender: bytes, payload: bytes) -> None:
        """An internal credit message (see :meth:`_send_credits`): adds its credits to the
        counter once per (sender, sequence number); a copy of one already counted is dropped."""
        if len(payload) != _CREDIT_MSG.size:
            self._log.warning("malformed credit message dropped", length=len(payload))
            return
        _, seq, imm, units = _CREDIT_MSG.unpack(payload)
        if not self._credits_seen.first(sender, seq):
            self._log.info("a credit posted twice was counted once", imm=imm)
            return
        lib.aio_counter_add(self._h, imm, units)
        if self._obs is not None:
            self._obs._credit(units)

    def _credits_later(
        self,
        credits: _Credits,
        what: str,
        after: str,
        landed: Callable[[], Awaitable[bool]] | None = None,
        seqs: dict[Any, int] | None = None,
    ) -> Any:
        """Sends the credits of an operation that timed out or was cancelled (``after``) from a
        background task: once ``landed()`` says its data is all in place (None: it is), unless
        the engine closed meanwhile. Returns the event set when that task is done."""
        done = self._event()

        async def later() -> None:
            try:
                if (landed is None or await landed()) and not self._closed:
                    await self._send_credits(credits, None, f"{what} (credit after its {after})", seqs)
            except Exception as err:  # the peer is gone or the engine closed: never counted
                self._log.info("a transfer's credit was not sent", what=what, after=after, error=str(err))
            finally:
                done.set()

        assert self._bridge is not None
        self._bridge.spawn(later)
        return done

    def imm_counter(self, imm: int) -> ImmCounter:
        """The counter of immediate ``imm`` (same object for the same imm). Credits accumulate
        from the engine's start, whether or not anybody waits.

        Raises :class:`InvalidArgument` unless ``imm`` is an integer in [0, 2**32); on a closed
        engine the counter's own calls raise :class:`EngineClosed`, not this one. Costs a dict
        lookup, no native call (the first call for an ``imm`` creates the object)."""
        imm = as_index(imm, "imm", hi=_U32)
        c = self._counters.get(imm)
        if c is None:
            c = self._counters[imm] = ImmCounter(self, imm)
        return c

    def _forget_counter(self, imm: int) -> bool:
        """Forgets counter ``imm`` in C and here, whether or not an ImmCounter object exists;
        False (nothing done) while a task waits on it."""
        c = self._counters.get(imm)
        if c is not None and c._waiters:
            return False
        h = self._handle()
        lib.aio_counter_watch(h, imm, 0)  # clears a watch that a cancelled waiter left armed
        lib.aio_counter_release(h, imm)
        self._counters.pop(imm, None)
        return True

    # ------------------------------------------------------------------ messages

    async def send(
        self,
        peer: bytes | EngineAddress,
        payload: Any,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """Sends ``payload`` (bytes-like, up to ``max_message_size``) to the engine at
        ``peer`` (its ``address``). Returns once the payload has been handed to the transport
        (it is copied; the caller may reuse its buffer at once). Messages between two engines
        are delivered in order on tcp and shm.

        A peer that does not answer yet is tried until ``timeout`` or the retry policy's
        ``connect_timeout``; after a broken connection the message is sent again as the policy
        says, so a peer whose connection was reset (not restarted) may receive it twice.

        A receiver that does not keep up holds its senders back: its messages wait in its
        receive slots, so once they are all taken, a send waits (up to ``timeout``) until the
        receiver takes one with :meth:`recv` (see there). Sends to one peer take at most three
        quarters of this engine's send slots per NIC; further ones wait here, so messages to
        other engines still go.

        Raises :class:`InvalidArgument` (bad address, payload too large),
        :class:`TransferTimeout`, :class:`PeerUnreachable`, :class:`EngineClosed`. A posted
        message cannot be taken back: a send cancelled once it posted (even in a scope
        cancelled before the call, to a peer already reached) is delivered, then raises the
        cancellation.

        Sends that other tasks make to the same peer while this one sits at its schedule point
        right after posting travel together as one message (``combine_messages``, on by
        default): each is still delivered once, in order, as a message of its own. Joined,
        a send is not sent at all when cancelled or timed out before that message went out;
        cancelled after, it waits (up to ``cancel_grace``) for that message to complete
        before the cancellation propagates; a timeout after raises at once, and its
        ``settled()`` waits for it (a message over the transport's eager size, 16 KiB on
        tcp, can be overtaken by a later one).

        Costs one copy of the payload (into a registered send slot, behind the sender's
        address, made without the NIC's lock held) and one send work request, awaited to
        completion; with no send slot free it waits (back-off) instead of failing. A joined
        send costs the same one copy (the core frames it into the combined message's slot) and
        no work request of its own.
        A message that the provider completes as it takes it ends in the posting call: the
        send returns after one schedule point, without waking a poller or the event loop.
        That is, with its header (the sender's address, about 120 bytes), up to 4 KiB on shm
        (always) and up to 16 KiB on tcp (when its socket takes it at once)."""
        check_timeout(timeout)
        self._check_open()
        await self._send_msg(peer, payload, timeout, retry)

    async def _send_msg(
        self,
        peer: Any,
        payload: Any,
        timeout: float | None,
        retry: RetryPolicy | None,
        *,
        internal: bool = False,
    ) -> None:
        """Sends a message; ``internal`` ones (the engine's own protocol, e.g. GPU staging)
        are consumed by the peer's engine and never reach its :meth:`recv`. An application
        message to a connection whose send is at the schedule point after its posting joins
        it (see :mod:`._coalesce`), unobserved and outside a batch."""
        addr = self._engine_address(peer)
        data = self._message_bytes(payload, addr.max_message)
        # (send() checked its timeout; the engine's own messages are checked here)
        end = _end(timeout) if internal or timeout is None else now() + timeout
        join = self._combine and not internal and self._obs is None and _GROUPS.get() is None
        placed = await self._send_slot(addr, data, end, timeout, retry, internal, join)
        if placed is not None:  # (None: it went in a combined message)
            await self._post_msg(placed, addr, data, end, retry, internal)

    async def _post_msg(
        self,
        placed: tuple[tuple[int, int], int, bool],
        addr: EngineAddress,
        data: memoryview,
        end: float | None,
        retry: RetryPolicy | None,
        internal: bool,
    ) -> None:
        """Posts a message by itself on the connection :meth:`_send_slot` placed it on (apart
        from :meth:`_send_msg`: its closures' cells would cost every joined send too)."""
        key, n, join = placed
        rail, fa = key
        head = self._msg_head[internal]
        budget = self._budget_ns

        def post(h: Any, g: int, posted: int) -> int:
            body = ffi.from_buffer(data)  # copied once, by the core, straight into a send slot
            return int(lib.aio_post_sendv(h, g, rail, fa, head, len(head), body, data.nbytes, budget))

        self._sends[key] = n + 1
        names = frozenset((key,))
        begun: list[_Group] = []
        counted = True
        mine: Window | None = None  # the window this send opened
        try:
            if self._obs is not None:
                self._obs.unit = data.nbytes
            elif _GROUPS.get() is None:
                # unobserved and in no batch: posted here, before the attempts' layers, so that a
                # message that ends in the posting call costs one schedule point and no more
                _check_retry(retry)
                st = self._begin(
                    1, None, None, None, None, names=names, opener=_opener(key, head, data, budget)
                )
                if st.first == 1 and join and key not in self._windows:
                    # posted: at its schedule point, sends to the connection join a window
                    mine = Window(min(self._max_message, addr.max_message), self._event())
                    self._windows[key] = mine
                if st.first == 1 and st.op.done and not st.op.status:
                    self._sent(key)
                    counted = False
                    if self._book.due:
                        self._maybe_sweep()
                    ahead = self._in_flight.get(key) if mine is not None else None
                    await self._checkpoint()
                    if ahead is not None and ahead.done and mine is not None and mine.open:
                        # that combined message completed meanwhile: its senders run next,
                        # and may join this window before it goes
                        await self._checkpoint()
                    return
                if mine is not None:
                    # what joined goes before this send awaits its completion (which may wait
                    # for the receiver to take messages: it must not hold theirs back)
                    w, mine = mine, None
                    await self._yield_posted(st.op, key, w)
                begun.append(st)

            def attempt(t: float | None) -> Awaitable[bool]:
                if begun:  # the first attempt finishes the group posted above
                    return self._finish(begun.pop(), post, 1, _end(t), t, "send")
                opener = _opener(key, head, data, budget)
                return self._run_group(post, 1, None, t, "send", names=names, opener=opener)

            await self._attempts(attempt, _left(end), retry, "send")
        finally:
            if counted:
                self._sent(key)
            if mine is not None:  # what joined goes now, cancelled or not
                self._flush(key, mine)

    async def _send_slot(
        self,
        addr: EngineAddress,
        data: memoryview,
        end: float | None,
        timeout: float | None,
        retry: RetryPolicy | None,
        internal: bool,
        join: bool,
    ) -> tuple[tuple[int, int], int, bool] | None:
        """Where a send goes: ``(connection, its sends in flight, whether it may still open a
        window for others to join)`` once the connection has room for it, or None once it
        went joined to another send's combined message (it landed). Raises TransferTimeout at
        ``end`` waiting for room or for that message."""
        while True:
            # messages keep to the first live route: they are delivered in order on it
            path = self._router.live(self._router.addr_path(addr))
            key = (path[0][0], path[0][1])
            w = self._windows.get(key) if join else None
            if w is not None:
                _check_retry(retry)  # (before joining: a refused send posts nothing)
                m = w.join(data)
                if m is not None:
                    if await self._joined(key, w, m, end, timeout):
                        return None
                    join = False  # nothing was posted for it: it goes by itself
                    continue
            n = self._sends.get(key, 0)
            if internal or n < self._send_cap:
                return key, n, join
            # A receiver holds back its senders (see recv): a send stays in flight, in one of
            # the rail's send slots, until it takes the message. So one peer gets at most
            # _send_cap of them; the rest stay free for other peers and the engine's notices.
            room = self._send_room.get(key)
            if room is None:
                room = self._send_room[key] = self._event()
            if not await wait_until(room, end):
                assert timeout is not None
                raise timeout_error("send", timeout)

    def _message_bytes(self, payload: Any, theirs: int) -> memoryview:
        """``payload`` as bytes, checked against this engine's and the receiver's
        (``theirs``, 0: not known) max_message_size; InvalidArgument otherwise."""
        try:
            data = memoryview(payload).cast("B")
        except TypeError:
            raise InvalidArgument(f"payload must be bytes-like, not {type(payload).__name__}") from None
        if data.nbytes > self._max_message:
            raise InvalidArgument(
                f"payload of {data.nbytes} B exceeds max_message_size={self._max_message} B; "
                "use a one-sided write for bulk data"
            )
        if theirs and data.nbytes > theirs:
            raise InvalidArgument(
                f"payload of {data.nbytes} B exceeds the receiving engine's max_message_size="
                f"{theirs} B: it could not be delivered; use a one-sided write for bulk data"
            )
        return data

    async def recv(self, *, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Receives the next message: ``(sender_address, payload)``. Messages are kept from
        the engine's start, in order, so nothing is lost while nobody waits. Cancel-safe: a
        cancelled receive takes no message.

        Flow control: a message that arrives while nobody waits stays in its receive slot
        (``message_slots`` per NIC) until it is taken; only then is it copied out and the slot
        given back. A quarter of the slots is kept for the engine's own messages (the notices
        of staged GPU writes): messages that would take those are copied out and queued
        instead, up to 1 MiB of them; past that they hold the last slots too, and the sender's
        transport waits. So a backlog costs the receiver its slots and at most 1 MiB more,
        and senders to an engine that never receives stall (their sends time out); staged GPU
        writes into it stall too once large messages hold every slot.

        Raises :class:`TransferTimeout`, :class:`EngineClosed`, :class:`InvalidArgument` (bad
        ``timeout``). Costs one copy of the payload (out of its slot, here or when it arrived
        for a waiting receiver) and no I/O: a queued message returns after one checkpoint,
        otherwise the task sleeps until the next message wakes it."""
        check_timeout(timeout)
        self._handle()
        if self._inbox:
            # taken before yielding: no other receiver can race for it; cancelled at the
            # schedule point (or before the call), the receive gives it back (first in
            # line): it takes nothing
            item = self._take(self._inbox.popleft())
            try:
                await self._checkpoint()  # (a shielded one costs a cancel scope)
            except BaseException:
                if not self._closed:
                    self._deliver(item, first=True)
                raise
            return item
        await self._checkpoint_if_cancelled()
        if self._inbox:  # one arrived meanwhile (a poller's completions may run there)
            return await self.recv(timeout=timeout)
        w = _RecvWaiter(self._event())
        self._recv_waiters.append(w)
        # the poller of the rail the last message came in on is kicked (its spin restarts: a
        # stream of messages is read without a sleep per message), only that one (every poller
        # spinning took the CPUs two ping-ponging processes' loops needed on 2 vCPUs), and an shm
        # rail, which has no wait object, is polled more often while a task waits
        lib.aio_waiters_add(self._h, 1)
        try:
            try:
                if not await wait_until(w.event, _end(timeout)):
                    assert timeout is not None
                    raise timeout_error("recv", timeout)
            finally:
                if not self._closed:
                    lib.aio_waiters_add(self._h, -1)
        except BaseException:
            if w.item is not None:  # delivered, but the receive was cancelled: give it back
                self._deliver(w.item, first=True)
            else:
                with suppress(ValueError):
                    self._recv_waiters.remove(w)
            raise
        if w.item is None:
            raise EngineClosed("the engine closed while receiving")
        return w.item
