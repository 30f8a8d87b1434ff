"""Combined sends, the engine's side: the window a posted send opens at its schedule point,
the sends that join it, and the combined message they go in (the window's life itself is the
sans-I/O :mod:`._coalesce`; :meth:`Messages._send_msg` drives both)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from functools import partial
from typing import Any

from .._native import ffi, lib
from ._coalesce import ALONE, WAITING, Member, Window
from ._errors import AioteError, EngineClosed, TransferTimeout
from ._observed import Observed
from ._optable import _Op
from ._records import _POLICY
from ._rules import LINK_POLL
from ._util import now, timeout_error


class CombinedSends(Observed):
    """Sends joined to another send's window, and the in-flight count of a connection's sends."""

    async def _yield_posted(self, op: _Op, key: tuple[int, int], w: Window) -> None:
        """The schedule point of a send that posted ``op`` and opened window ``w``, whose
        message did not end in the posting call: what joined goes when it resumes. Cancelled
        here, it waits for its posted message first, as a cancelled send does (up to
        ``cancel_grace``), so that the task's next send cannot overtake it."""
        try:
            await self._checkpoint()
        except BaseException:
            self._flush(key, w)
            if op.must_settle():
                await self._settle_cancelled(op)
            raise
        self._flush(key, w)

    async def _joined(
        self, key: tuple[int, int], w: Window, m: Member, end: float | None, timeout: float | None
    ) -> bool:
        """The send of ``m``, joined to window ``w`` of connection ``key``: True once its
        message went with the window's combined message and landed; False when it must go by
        itself (nothing was posted for it, or the combined message failed or moved to another
        NIC: sent again, as a retry would). Raises TransferTimeout and the cancellation:
        before the window posted, the message is not sent at all; after, as for any posted
        send."""
        try:
            await self._wait_joined(w, m, end, timeout)
        except BaseException as exc:
            if w.leave(m) or m.state == ALONE:
                raise  # nothing posted for it
            # posted: it is delivered (a posted message cannot be taken back)
            try:
                if isinstance(exc, TransferTimeout):
                    exc._waiter, exc._landed = partial(self._settle, w.op), w.op.landed
                elif w.op.must_settle():
                    await self._settle_cancelled(w.op)
            finally:
                self._left_window(key, w, m)
            raise
        if m.state == ALONE:
            return False
        op = w.op
        try:
            if op.landed():  # the common case: no await more
                return True
            return not await self._await_group(op, end, timeout, "send", since=w.posted_at)
        except (TransferTimeout, EngineClosed):
            raise
        except AioteError as err:
            self._log.info("a combined message failed; its messages go one by one", error=str(err))
            return False
        finally:
            self._left_window(key, w, m)

    def _left_window(self, key: tuple[int, int], w: Window, m: Member) -> None:
        """``m``, of the posted combined message of ``w``, is done with it: the last one gives
        the connection's in-flight count back, and forgets the message as ``key``'s in flight."""
        if w.done(m):
            self._sent(key)
            if self._in_flight.get(key) is w.op:
                del self._in_flight[key]

    async def _wait_joined(self, w: Window, m: Member, end: float | None, timeout: float | None) -> None:
        """Waits until window ``w`` says what became of ``m`` and, if its combined message
        was posted, until that completed, or until the engine's watch must look at it (a
        stall bound, a lost link, a same-host peer's death: then :meth:`_await_group` takes
        over). Raises TransferTimeout at ``end``."""
        if self._router.down or self._shm_rails:
            look: float | None = LINK_POLL
        else:
            p = _POLICY.get()
            look = (p if p is not None else self._retry).stall_timeout
        ev = w.event
        while True:
            when = end
            if look is not None:
                t = now() + look
                if when is None or t < when:
                    when = t
            if when is None:
                await ev.wait()
                return
            # (the event's own timed wait: no coroutine of wait_until's between, on every
            # joined send's path)
            if await ev.wait_until(when) or m.state != WAITING:
                return
            if end is not None and now() >= end:
                assert timeout is not None
                raise timeout_error("send", timeout)

    def _flush(self, key: tuple[int, int], w: Window) -> None:
        """The send that opened window ``w`` resumed after its schedule point (or was
        cancelled there): what joined goes as one message (a single message as it is),
        posted now when the transport takes all of it at once, else every member goes by
        itself (see :mod:`._coalesce`)."""
        del self._windows[key]
        members = w.close()
        if not members:
            return
        try:
            if self._closed or self._sends.get(key, 0) >= self._send_cap:
                w.alone()
                return
            if len(members) == 1:
                opener = _opener(key, self._msg_head[0], members[0].data, self._budget_ns)
            else:
                opener = _parts_opener(key, self._msg_head[2], [x.data for x in members], self._budget_ns)
            st = self._begin(1, None, None, None, None, names=frozenset((key,)), opener=opener)
        except Exception as err:  # each member meets it again, by itself
            self._log.info("a combined message was not posted", error=str(err))
            w.alone()
            return
        if st.first != 1:  # no group slot, the transport pushed back, or an error
            if st.g >= 0:
                self._seal(st.g)
            w.alone()
            return
        self._sends[key] = self._sends.get(key, 0) + 1
        self._combined[0] += len(members)
        if len(members) > 1:
            self._combined[1] += 1
        op = st.op
        if not op.done:  # its completion wakes the members: one wait each, not two
            op.event = w.event
            self._in_flight[key] = op
        w.posted(op, op.done, now())

    def _sent(self, key: tuple[int, int]) -> None:
        """A send to ``key`` (rail, peer) is over: its send slot goes to the send that waited
        longest for room there (woken alone; the count stays), or else no longer counts
        against the peer's cap."""
        n = self._sends[key]
        waiting = self._send_room.get(key)
        if waiting and n <= self._send_cap:
            waiting.popleft().set()
            if not waiting:
                del self._send_room[key]
        elif n > 1:
            self._sends[key] = n - 1
        else:
            del self._sends[key]

    def _leave_room(self, key: tuple[int, int], room: Any) -> None:
        """A send stops waiting for room on ``key`` before it got a slot (cancelled, timed
        out): its place in line goes."""
        waiting = self._send_room.get(key)
        if waiting is not None:
            with suppress(ValueError):
                waiting.remove(room)
            if not waiting:
                del self._send_room[key]


def _opener(
    key: tuple[int, int], head: bytes, data: memoryview, budget: int, in_place: bool = False
) -> Callable[[Any, int, Any], int]:
    """The ``opener`` of a message's group (see ``_run_group``): open, post, seal in one native
    call (``aio_submit_sendv``) on connection ``key``; ``in_place``: the body is sent from
    where it lies (``aio_submit_sendv_ref``: the group's refs keep it until the completion).
    The buffer's cdata lives for the call alone: one kept in a frame that a traceback holds in
    a reference cycle can be collected after the memoryview it exports from, which crashes
    CPython 3.11's memoryview dealloc."""
    rail, fa = key
    submit = lib.aio_submit_sendv_ref if in_place else lib.aio_submit_sendv

    def opener(h: Any, token: int, gout: Any) -> int:
        body = ffi.from_buffer(data)  # copied by the core straight into a send slot, or sent in place
        return int(submit(h, token, rail, fa, head, len(head), body, data.nbytes, budget, gout))

    return opener


def _parts_opener(
    key: tuple[int, int], head: bytes, parts: list[memoryview], budget: int
) -> Callable[[Any, int, Any], int]:
    """The ``opener`` of a combined message: ``aio_submit_sendparts`` frames the parts (each
    behind its length, as :func:`._coalesce.spans` reads them) and copies them straight into
    a send slot, so a joined payload is copied once, as a lone one is. The cdata live for the
    call alone (see :func:`_opener`)."""
    rail, fa = key
    n = len(parts)

    def opener(h: Any, token: int, gout: Any) -> int:
        bufs = [ffi.from_buffer(p) for p in parts]
        ptrs = ffi.new("const void *[]", bufs)
        lens = ffi.new("uint64_t[]", [p.nbytes for p in parts])
        return int(lib.aio_submit_sendparts(h, token, rail, fa, head, len(head), ptrs, lens, n, budget, gout))

    return opener
