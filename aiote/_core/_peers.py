"""Which peers an engine remembers, and when it forgets them (sans I/O).

Each peer NIC address an engine reaches is resolved once into its rail's address vector (a
libfabric ``fi_addr``); a same-host peer's region table is attached once. Peers come and go
over an engine's life (decoders joining and leaving, short-lived jobs), so what is kept per
peer must not grow without bound. :class:`PeerBook` keeps the resolved addresses and decides
which to forget; the engine carries its decisions out (``fi_av_remove``, detaching a table,
dropping its caches).

Forgetting is safe only while no request names the address: a row built for a transfer holds
the ``fi_addr``, and libfabric hands a removed address's number to the next peer inserted. So
the engine sweeps only at a quiet moment (nothing being built, posted, retried or in flight,
see ``Engine._maybe_sweep``), and never forgets an address a kept batch still names. What is
forgotten:

- addresses marked gone: a same-host peer whose process exited or closed its engine (its pidfd
  or its table says so), or a peer the application named in ``Engine.forget_peer``;
- past ``cap`` addresses, the ones not resolved since the previous sweep (the engine clears
  its route caches at each sweep, so a peer in use is resolved again when next used): a
  second-chance (clock) order, least recently swept first, down to three quarters of ``cap``.

A live peer forgotten this way costs its next transfer a new connection (and a new attach
for a same-host peer): nothing else. A sweep is due when a new address would pass the
threshold (``cap`` at first, then a quarter of ``cap`` above what the last sweep left), so
sweeps cost O(addresses) amortized over a quarter of ``cap`` insertions.
"""

from __future__ import annotations

from collections.abc import Iterable

Key = tuple[int, bytes]  # (local rail, the peer's NIC address)


class PeerBook:
    """The resolved peer addresses of one engine and the sweeps that forget them."""

    __slots__ = ("_attach", "_by_fa", "_marked", "_next", "_seen", "_sweeps", "cap", "due", "fa", "forgotten")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.fa: dict[Key, int] = {}
        self._by_fa: dict[tuple[int, int], bytes] = {}  # (rail, fi_addr) -> the peer's NIC address
        self._seen: dict[Key, int] = {}  # the sweep number when last resolved
        self._sweeps = 0
        self._next = cap
        self._marked: set[bytes] = set()  # peer NIC addresses to forget at the next sweep
        self._attach: dict[int, frozenset[bytes]] = {}  # attached table -> its owner's addresses
        self.due = False
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self.fa)

    def get(self, key: Key) -> int | None:
        """The address's ``fi_addr`` if resolved (and marks it used since the last sweep)."""
        fa = self.fa.get(key)
        if fa is not None:
            self._seen[key] = self._sweeps
        return fa

    def add(self, key: Key, fa: int) -> None:
        """Records a new resolution; makes a sweep due past the threshold."""
        self.fa[key] = fa
        self._by_fa[(key[0], fa)] = key[1]
        self._seen[key] = self._sweeps
        if len(self.fa) > self._next:
            self.due = True

    def address(self, rail: int, fa: int) -> bytes | None:
        """The peer NIC address resolved as ``fa`` on ``rail``, if kept."""
        return self._by_fa.get((rail, fa))

    def attached(self, index: int, addresses: Iterable[bytes]) -> None:
        """Table ``index`` belongs to the peer whose NICs are ``addresses``."""
        self._attach[index] = frozenset(addresses)

    def attachments(self) -> list[int]:
        return list(self._attach)

    def mark(self, addresses: Iterable[bytes]) -> None:
        """Forget these peer NIC addresses at the next sweep."""
        self._marked.update(addresses)
        self.due = True

    def mark_attached(self, index: int) -> None:
        """The peer of table ``index`` is gone: forget its addresses at the next sweep."""
        self.mark(self._attach.get(index, ()))

    def sweep(self, busy: set[tuple[int, int]]) -> tuple[list[tuple[Key, int]], list[int]]:
        """Decides what to forget now: (addresses with their ``fi_addr``, tables to detach).
        ``busy``: the (rail, fi_addr) pairs something still names; they are kept."""
        out: list[tuple[Key, int]] = []
        for key, fa in self.fa.items():
            if key[1] in self._marked and (key[0], fa) not in busy:
                out.append((key, fa))
        gone = {k for k, _ in out}
        excess = len(self.fa) - len(gone) - (self.cap * 3) // 4
        if len(self.fa) - len(gone) > self.cap and excess > 0:
            old = sorted(
                (s, k) for k, s in self._seen.items() if s < self._sweeps and k not in gone
            )
            for _, key in old:
                if excess <= 0:
                    break
                fa = self.fa[key]
                if (key[0], fa) not in busy:
                    out.append((key, fa))
                    excess -= 1
        for key, fa in out:
            del self.fa[key]
            del self._seen[key]
            self._by_fa.pop((key[0], fa), None)
        left = {k[1] for k in self.fa}
        self._marked &= left  # marks of addresses still kept (busy) wait for the next sweep
        detach = [i for i, addrs in self._attach.items() if not addrs & left]
        for i in detach:
            del self._attach[i]
        self._sweeps += 1
        self._next = max(self.cap, len(self.fa) + self.cap // 4)
        self.due = False  # marks still kept (busy) are taken at the next sweep
        self.forgotten += len(out)
        return out, detach
