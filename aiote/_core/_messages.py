"""Messages, the sending side: send, its send slots and combined messages, and the engine's
internal messages (credits of deferred immediates). The receiving side is :mod:`._inbox`."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from .._native import ffi, lib
from ._coalesce import Window, opens_window
from ._combined import _opener
from ._counter import ImmCounter
from ._credits import GroupView, SendAfterTimeout, SendWhenLanded, after_data, all_landed
from ._descriptor import EngineAddress
from ._errors import InvalidArgument, TransferTimeout
from ._inbox import Inbox
from ._optable import _Op
from ._records import _GROUPS, _check_retry, _end, _Group, _groups_list, _left
from ._retry import RetryPolicy
from ._util import as_index, check_timeout, now, timeout_error, wait_until
from ._wire import (
    _CREDIT,
    _CREDIT_MSG,
    _K_CREDIT,
    _U32,
    _Credits,
)

_IN_PLACE_MIN = int(lib.AIO_IN_PLACE_MIN)  # a bytes payload over this is sent in place (tcp's eager size)


class Messages(Inbox):
    """Messages: send (the receiving side is :class:`._inbox.Inbox`), and the engine's internal
    credit messages."""

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
        (the caller may reuse its buffer at once). Messages between two engines are delivered
        in order on tcp and shm.

        A peer that does not answer yet is tried until ``timeout`` or the retry policy's
        ``connect_timeout``; after a broken connection the message is sent again as the policy
        says, so a peer whose connection was reset (not restarted) may receive it twice.

        A receiver that does not keep up holds its senders back: its messages wait in its
        receive slots, so once they are all taken, a send waits (up to ``timeout``) until the
        receiver takes one with :meth:`recv` (see there). Sends to one peer take at most three
        quarters of this engine's send slots per NIC; further ones wait here, in line (each
        slot that frees goes to the longest-waiting send), so messages to other engines
        still go.

        Raises :class:`InvalidArgument` (bad address, payload too large),
        :class:`TransferTimeout`, :class:`PeerUnreachable`, :class:`EngineClosed`. A posted
        message cannot be taken back: a send cancelled once it posted (even in a scope
        cancelled before the call, to a peer already reached) is delivered, then raises the
        cancellation.

        Sends that other tasks make to the same peer while this one sits at its schedule point
        right after posting travel together as one message (``combine_messages``, on by
        default): each is still delivered once, in order, as a message of its own. A send
        of about half the smaller ``max_message_size`` or more has no such point (no two
        sends of its size could join). Joined,
        a send is not sent at all when cancelled or timed out before that message went out;
        cancelled after, it waits (up to ``cancel_grace``) for that message to complete
        before the cancellation propagates; a timeout after raises at once, and its
        ``settled()`` waits for it (a message over the transport's eager size, 16 KiB on
        tcp, can be overtaken by a later one).

        Costs one copy of the payload (into a registered send slot, behind the sender's
        address, made without the NIC's lock held) and one send work request, awaited to
        completion; with no send slot free it waits (back-off) instead of failing. A payload
        of type ``bytes`` over 16 KiB is not copied: immutable, it is sent from where it lies
        (on tcp and shm; a NIC whose provider needs registered local memory, verbs or efa,
        copies it), and the engine holds a reference to it until the transport lets go of it,
        also after a timeout or a cancellation (``stats()["sends_in_place"]`` counts such
        posts). A joined send costs the same one copy (the core frames it into the combined
        message's slot) and no work request of its own.
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
        # a bytes object cannot change: a large one is sent from where it lies, kept alive by
        # its group until the transport lets go of it (see send)
        keep = payload if type(payload) is bytes and data.nbytes > _IN_PLACE_MIN else None
        # (send() checked its timeout; the engine's own messages are checked here)
        end = _end(timeout) if internal or timeout is None else now() + timeout
        join = self._combine and not internal and self._obs is None and _GROUPS.get() is None
        placed = await self._send_slot(addr, data, end, timeout, retry, internal, join)
        if placed is not None:  # (None: it went in a combined message)
            await self._post_msg(placed, addr, data, end, retry, internal, keep)

    async def _post_msg(
        self,
        placed: tuple[tuple[int, int], int, bool],
        addr: EngineAddress,
        data: memoryview,
        end: float | None,
        retry: RetryPolicy | None,
        internal: bool,
        keep: bytes | None = None,
    ) -> None:
        """Posts a message by itself on the connection :meth:`_send_slot` placed it on (apart
        from :meth:`_send_msg`: its closures' cells would cost every joined send too).
        ``keep``: the payload, sent from where it lies and owned by each group that posts it
        until that group's completion; None: copied into the send slot."""
        key, n, join = placed
        rail, fa = key
        head = self._msg_head[internal]
        budget = self._budget_ns
        in_place = keep is not None
        send = lib.aio_post_sendv_ref if in_place else lib.aio_post_sendv

        def post(h: Any, g: int, posted: int) -> int:
            body = ffi.from_buffer(data)  # copied by the core straight into a send slot, or in place
            return int(send(h, g, rail, fa, head, len(head), body, data.nbytes, budget))

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
                    1, keep, None, None, None, names=names, opener=_opener(key, head, data, budget, in_place)
                )
                if st.first == 1 and join and key not in self._windows:
                    limit = min(self._max_message, addr.max_message)
                    if opens_window(data.nbytes, limit):
                        # posted: at its schedule point, sends to the connection join a window
                        mine = Window(limit, self._event())
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
                opener = _opener(key, head, data, budget, in_place)
                return self._run_group(post, 1, keep, t, "send", names=names, opener=opener)

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
        owned: tuple[int, int] | None = None  # a send slot handed to this send (see _sent)
        try:
            while True:
                # messages keep to the first live route: they are delivered in order on it
                path = self._router.live(self._router.addr_path(addr))
                key = (path[0][0], path[0][1])
                if owned is not None:
                    mine, owned = owned, None
                    if mine == key:  # its slot, in the count already: _post_msg sets it again
                        return key, self._sends[key] - 1, join
                    self._sent(mine)  # the route moved on: that slot goes to the next in line
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
                # A receiver holds back its senders (see recv): a send stays in flight, in one
                # of the rail's send slots, until it takes the message. So one peer gets at most
                # _send_cap of them; the rest stay free for other peers and the engine's
                # notices. They wait in line: a slot that frees goes to the longest-waiting
                # send (see _sent), which wakes alone, and no later send takes it first.
                room = self._event()
                line = self._send_room.get(key)
                if line is None:
                    line = self._send_room[key] = deque()
                line.append(room)
                try:
                    ok = await wait_until(room, end)
                finally:
                    if room.is_set():
                        owned = key  # (cancelled as it got it: the finally below gives it on)
                    else:
                        self._leave_room(key, room)
                if not ok:
                    assert timeout is not None
                    raise timeout_error("send", timeout)
        finally:
            if owned is not None:  # it leaves without posting: the slot goes on
                self._sent(owned)

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

