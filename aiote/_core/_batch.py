"""TransferBatch: many writes/reads built once, posted together."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np

from .._native import ffi, lib
from ._descriptor import MemoryDescriptor
from ._errors import InvalidArgument, PeerUnreachable, RemoteAccessError
from ._memory import MemoryRegion
from ._observe import Tries
from ._posted import Transfer
from ._records import _check_retry, _end
from ._retries import _retryable
from ._retry import RetryPolicy
from ._transfers import Transfers
from ._wire import _OP_DTYPE, _Credits


class TransferBatch:
    """Writes and reads collected without awaiting, posted by one native call and awaited as
    one (``engine.batch()``). Each ``write``/``read`` validates its arguments at once and raises
    :class:`InvalidArgument` there, so a submitted batch never fails on bad input halfway.
    Costs about a microsecond of Python per request, plus one event-loop round trip per batch.

    To a peer reached over several streams of one NIC, whether a large transfer is split over
    them is settled when the batch is submitted or posted, from how many transfers it holds
    then (as many as streams or more: each goes whole); transfers added while the peer's
    connections were still opening are dealt over all of them from the first submission after
    they opened. A submission in flight keeps its rows and credits whatever is added later.
    """

    def __init__(self, engine: Transfers) -> None:
        self._engine = engine
        engine._batches.add(self)  # the peers its rows name are not forgotten while it lives
        self._table = np.zeros(16, _OP_DTYPE)
        self._n = 0
        self._credits: _Credits = {}  # multi-NIC peers: sent after the data
        self._refs: set[MemoryRegion] = set()
        self._entries = 0  # transfers added (a striped one is several rows)
        # transfers to peers of several routes whose rows depend on the batch's final size or
        # on connections still opening: [first row, rows, arguments, credits], see _place
        self._moving: list[list[Any]] = []
        self._placed = (0, 0)  # (self._entries, connections open) when _place last ran
        # the rows as last submitted, ready to post: (table, n, rows, items, post, what)
        self._ready: tuple[Any, ...] | None = None

    def __len__(self) -> int:
        return self._n

    def _add(self, rows: list[tuple[int, ...]]) -> None:
        need = self._n + len(rows)
        if need > len(self._table):
            self._table = np.resize(self._table, max(need, 2 * len(self._table)))
        t = self._table
        for r in rows:
            t[self._n] = r
            self._n += 1

    def _append(self, mr: MemoryRegion, args: tuple[Any, ...]) -> None:
        """Validates and adds one transfer (``args``: :meth:`Engine._rows`' from ``remote``
        to ``op``), remembering it when its rows may change by :meth:`_place`."""
        credits: _Credits = {}
        rows, settled = self._rows_of((mr, *args), credits, self._n)
        first = self._n
        self._add(rows)
        self._refs.add(mr)
        for key, k in credits.items():
            self._credits[key] = self._credits.get(key, 0) + k
        if not settled:
            self._moving.append([first, len(rows), (mr, *args), credits])
        self._entries += 1

    def _rows_of(
        self, spec: tuple[Any, ...], credits: _Credits, load: int
    ) -> tuple[list[tuple[int, ...]], bool]:
        """The rows of one transfer (``spec``: :meth:`Engine._rows`' arguments from ``mr`` to
        ``op``), and whether they are settled (see :meth:`_place`)."""
        mr, remote, length, src_offset, dst_offset, imm, op = spec
        note: list[bool] = []
        rows = self._engine._rows(
            mr, remote, length, src_offset, dst_offset, imm, op, credits, load=load, note=note, alone=False
        )[0]
        return rows, not note or note[0]

    def _place(self) -> None:
        """Settles the rows of transfers to peers of several routes before a submission.

        When a transfer is added, the batch does not know how many will follow: over the
        streams of one NIC a large one is split only while the batch (plus what is in flight)
        holds fewer transfers than streams, and a transfer added while a peer's connections
        were still opening goes over the open ones only. Before each submission, those
        transfers are built again if transfers were added since, or while connections were
        opening: a batch of many transfers deals whole ones over every stream (as the C core
        does), a batch of one large transfer splits it. The rows of submissions in flight are
        never rewritten (a new table replaces the old one). Costs nothing once settled;
        otherwise about a microsecond of Python per such transfer."""
        eng = self._engine
        if not self._moving or self._placed == (self._entries, len(eng._routes_open)):
            return
        pieces: list[np.ndarray] = []
        keep: list[list[Any]] = []
        total = self._credits.copy()
        pos = shift = 0
        for first, count, args, old in self._moving:  # built aside: nothing changes if one raises
            credits: _Credits = {}
            rows, settled = self._rows_of(args, credits, self._entries)
            pieces.append(self._table[pos:first])
            pieces.append(eng._table(rows))
            pos = first + count
            for key, k in old.items():
                total[key] -= k
                if not total[key]:
                    del total[key]
            for key, k in credits.items():
                total[key] = total.get(key, 0) + k
            if not settled:
                keep.append([first + shift, len(rows), args, credits])
            shift += len(rows) - count
        pieces.append(self._table[pos : self._n])
        table = np.concatenate(pieces)
        self._table, self._n, self._credits, self._moving = table, len(table), total, keep
        self._placed = (self._entries, len(eng._routes_open))

    def write(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
    ) -> TransferBatch:
        """Adds a write (same arguments as :meth:`Engine.write`, host regions only); returns
        the batch.

        Checks everything at once: the region is registered with this engine, both ranges fit,
        the peer's region allows remote write, ``imm`` is 32-bit (a zero-length write needs
        one), a provider reaches the peer. Raises :class:`InvalidArgument` when one fails
        or a region is GPU memory, :class:`DescriptorError` (corrupt descriptor bytes), :class:`EngineClosed`;
        nothing is added then. Costs only validating and appending one request (one per NIC
        when striped) to the batch: nothing is posted until :meth:`submit` or :meth:`post`;
        the first request to a new peer resolves its address once (cached)."""
        self._append(mr, (remote, length, src_offset, dst_offset, imm, lib.AIO_OP_WRITE))
        return self

    def read(
        self,
        mr: MemoryRegion,
        remote: MemoryDescriptor | bytes,
        *,
        length: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
    ) -> TransferBatch:
        """Adds a READ (same arguments as :meth:`Engine.read`, host regions only); returns
        the batch.

        Checks everything at once: the local region is registered with this engine and
        writable, both ranges fit, at least one byte moves, the peer's region allows remote
        read, a provider reaches the peer. Raises :class:`InvalidArgument` when one fails
        or a region is GPU memory, :class:`DescriptorError` (corrupt descriptor bytes), :class:`EngineClosed`;
        nothing is added then. Costs only validating and appending one request (one per NIC
        when striped) to the batch: nothing is posted until :meth:`submit` or :meth:`post`;
        the first request to a new peer resolves its address once (cached)."""
        self._append(mr, (remote, length, src_offset, dst_offset, None, lib.AIO_OP_READ))
        return self

    async def submit(self, *, timeout: float | None = None, retry: RetryPolicy | None = None) -> None:
        """Posts every request and waits until all completed. Raises the first error
        (after every posted request finished); see :meth:`Engine.write` for cancellation.

        A batch may be submitted again (a static schedule built once); each submission
        re-checks that its regions are still registered (:class:`InvalidArgument` if not).

        Also raises :class:`EngineClosed`, :class:`TransferTimeout` after ``timeout``, and
        :class:`TransferError` subclasses from the transport. Costs one native posting call for
        all rows (a few when the send queue fills), one completion record and one event-loop
        wake-up for the whole batch, plus the deferred credit writes of multi-NIC peers."""
        self._engine._check_open()
        if self._n == 0:
            await anyio.lowlevel.checkpoint()
            return
        self._check_regions()
        self._place()
        if self._credits:  # multi-NIC peers: credits follow the data
            await self._submit(self._table[: self._n], self._credits.copy(), timeout, retry)
            return
        # one group, posted by aio_submit from the rows as they stand (kept between
        # submissions of an unchanged batch: a static schedule re-submitted in a loop)
        eng = self._engine
        ready = self._ready
        if ready is None or ready[0] is not self._table or ready[1] != self._n:
            rows = self._table[: self._n]
            items = ffi.from_buffer("aio_op_desc[]", rows)
            ready = self._ready = (self._table, self._n, rows, items, eng._poster(items, self._n),
                                   f"batch of {self._n}")
        _, n, rows, items, post, what = ready
        refs = (self._refs, rows)  # (_refs only ever grows: keeps this submission's regions)

        async def attempt(t: float | None) -> None:
            eng._opening += 1  # as _run counts it (see _rows)
            try:
                await eng._run_group(post, n, refs, t, what, None, None, items)
            finally:
                eng._opening -= 1

        if retry is not None:
            await eng._attempts(attempt, timeout, retry, what)
            return
        # the first attempt inline: what _attempts(attempt) does without a policy, minus its
        # coroutine layers (_attempts, attempt, _run_group), which the event loop would step
        # through once per completion of a batch re-submitted in a loop; observed in place
        end = _end(timeout)
        obs = eng._obs
        rec = token = tries = None
        t0 = 0
        if obs is not None:  # observed as its one group (no record) where nothing else asks for one
            if obs._plain():
                t0 = obs._kept_start()
            else:
                rec, token = obs._enter(what)
        try:
            try:
                eng._opening += 1
                try:
                    await eng._finish(eng._begin(n, refs, None, None, items), post, n, end, timeout, what)
                finally:
                    eng._opening -= 1
            except (PeerUnreachable, RemoteAccessError) as exc:
                if not _retryable(exc):
                    raise
                if obs is not None and rec is None:
                    attempt = tries = Tries(attempt)
                await eng._retry_after(exc, attempt, end, eng._retry, what)
        except BaseException as exc:
            if rec is not None:
                rec.obs._leave(rec, token, exc)
            elif obs is not None:
                obs._kept_end(rows, what, t0, tries, exc)
            raise
        if rec is not None:
            rec.obs._leave(rec, token, None)
        elif obs is not None:
            obs._kept_end(rows, what, t0, tries, None)

    async def _submit(
        self,
        table: np.ndarray,
        credits: _Credits,
        timeout: float | None,
        retry: RetryPolicy | None,
    ) -> None:
        """One submission of ``table`` (the batch's rows when it was made: rows are never
        rewritten, growth and :meth:`_place` reallocate) and its ``credits``, so a batch
        that grows meanwhile changes only its later submissions."""
        what = f"batch of {len(table)}"
        end = _end(timeout)
        eng = self._engine
        refs = self._refs  # only ever grows: keeps this submission's regions too

        async def attempt(t: float | None) -> None:
            await eng._then_credit(eng._run(table, refs, t, what), credits, end, what, len(table))

        await eng._attempts(attempt, timeout, retry, what)

    def _check_regions(self) -> None:
        """Raises InvalidArgument if a region of this batch was unregistered since it was added."""
        for mr in self._refs:  # (a loop: cheaper than any() over a generator, on every submission)
            if mr._handle is None:
                raise InvalidArgument(
                    "a region of this batch was unregistered since it was added: build the batch again "
                    "with registered regions"
                )

    def post(self, *, retry: RetryPolicy | None = None) -> Transfer:
        """:meth:`submit`, posted now and awaited later (see :meth:`Engine.post_write`): every
        request is handed to the transport before this returns when it takes them at once
        (otherwise a background task of the engine posts the rest, as :meth:`submit`
        would); the returned :class:`Transfer` completes when all of them did. Raises
        :class:`InvalidArgument` at once if a region of the batch was unregistered,
        :class:`EngineClosed`. Cost: as :meth:`submit` minus its awaits; when posted in this
        call, its completion is quiet (read at the loop's next wake-up)."""
        eng = self._engine
        eng._check_open()
        _check_retry(retry)
        self._check_regions()
        self._place()
        what = f"batch of {self._n}"
        if self._n == 0:
            return Transfer(eng, what)
        table = self._table[: self._n]
        if self._credits:  # multi-NIC peers: credits follow the data
            credits = self._credits.copy()
            return eng._background(lambda: self._submit(table, credits, None, retry), what)
        return eng._post_now(table, self._refs, what, retry)
