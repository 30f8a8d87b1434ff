"""Messages, the receiving side: a message arrives in a receive slot (the poller's record),
waits there or in the inbox, and :meth:`Inbox.recv` hands it out, copied once; the engine's own
messages (credits, GPU staging parts) are consumed on arrival. The sending side is
:mod:`._messages`."""

from __future__ import annotations

from contextlib import suppress
from typing import Any

from .._native import ffi, lib
from ._coalesce import spans
from ._combined import CombinedSends
from ._errors import EngineClosed
from ._records import _end, _Held, _RecvWaiter
from ._util import check_timeout, timeout_error, wait_until
from ._wire import (
    _ADDR_LEN,
    _CREDIT_MSG,
    _INTERNAL,
    _K_CREDIT_BYTE,
    _MSG_HEADER,
    _PACKED,
    _SPILL_BYTES,
    _strerror,
)


class Inbox(CombinedSends):
    """Received messages: the slots they wait in, the inbox, the receivers waiting."""

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
        if not self._inbox:  # (a queued message: its own schedule point checks, below)
            await self._checkpoint_if_cancelled()
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
