"""Keys, values and the watch's event logic, sans I/O: plain functions and a plain object fed
etcd's JSON answers (as the v3 gateway returns them: keys and values base64, 64-bit numbers
as strings), returning joins and leaves. Nothing here talks to etcd or takes a lock.

Keys: ``{prefix}members/{group}/{name}``. A group is one or more segments of
``[A-Za-z0-9_.-]`` joined by ``/`` (``kv/decode``, ``moe/ep0``); a name is one such segment.
A key is a member of the group whose path is everything before its last ``/``: the members
of ``kv/decode`` are not members of ``kv``.

Values: one JSON object, at most :data:`MAX_VALUE` bytes::

    {"aiote": 1, "address": "<hex>", "descriptors": {"kv.pool": "<hex>"}, "meta": {...},
     "state": "up" | "leaving", "host": "...", "pid": 123}
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiote import DescriptorError, EngineAddress, InvalidArgument, MemoryDescriptor

__all__ = [
    "DEFAULT_PREFIX",
    "MAX_VALUE",
    "CorruptEntry",
    "GroupView",
    "Member",
    "MemberEvent",
    "WatchCancelled",
    "decode_member",
    "encode_value",
    "group_range",
    "member_key",
    "validate_group",
    "validate_name",
]

DEFAULT_PREFIX = "/aiote/"
MAX_VALUE = 64 << 10  # bytes of one member's value: an address and a few descriptors fit in 4 KiB
SCHEMA = 1
_SEGMENT = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


class CorruptEntry(ValueError):
    """A key or value under a group's prefix that is not a valid member record."""


class WatchCancelled(Exception):
    """etcd cancelled the watch. ``compact_revision`` > 0: the revision it was to resume from was
    compacted away, and the view must be read again (a range) before watching on."""

    def __init__(self, reason: str, compact_revision: int = 0) -> None:
        super().__init__(reason)
        self.compact_revision = compact_revision


def validate_group(group: str) -> str:
    """``group`` if it is a valid group path (segments of ``[A-Za-z0-9_.-]`` joined by ``/``);
    raises :class:`~aiote.InvalidArgument` otherwise. O(len(group)), no I/O."""
    if not isinstance(group, str) or not group or not all(_SEGMENT.fullmatch(s) for s in group.split("/")):
        raise InvalidArgument(f"group must be segments of [A-Za-z0-9_.-] joined by '/', not {group!r}")
    return group


def validate_name(name: str) -> str:
    """``name`` if it is a valid member name (one segment of ``[A-Za-z0-9_.-]``, 1 to 128
    characters); raises :class:`~aiote.InvalidArgument` otherwise. O(len(name)), no I/O."""
    if not isinstance(name, str) or not _SEGMENT.fullmatch(name):
        raise InvalidArgument(f"member name must be 1 to 128 of [A-Za-z0-9_.-], not {name!r}")
    return name


def _prefix_of(prefix: str, group: str) -> str:
    return f"{prefix}members/{validate_group(group)}/"


def member_key(prefix: str, group: str, name: str) -> bytes:
    """The etcd key of member ``name`` of ``group``. Raises :class:`~aiote.InvalidArgument` for
    an invalid group or name; O(key), no I/O."""
    return (_prefix_of(prefix, group) + validate_name(name)).encode()


def group_range(prefix: str, group: str) -> tuple[bytes, bytes]:
    """``(key, range_end)`` covering every key under ``group``'s prefix (its subgroups' too:
    :func:`decode_member` tells them apart). Raises :class:`~aiote.InvalidArgument` for an
    invalid group; O(key), no I/O."""
    start = _prefix_of(prefix, group).encode()
    return start, start[:-1] + bytes([start[-1] + 1])


def b64(data: bytes) -> str:
    """``data`` as the gateway wants bytes fields: standard base64."""
    return base64.b64encode(data).decode()


def unb64(text: Any) -> bytes:
    """The bytes of a base64 field; raises :class:`~aiote.membership.CorruptEntry` when it is not base64."""
    if not isinstance(text, str):
        raise CorruptEntry("a bytes field is not a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise CorruptEntry("a bytes field is not valid base64") from None


def as_int(v: Any, default: int = 0) -> int:
    """An int64 field of the gateway's JSON (a string, or absent for 0)."""
    if v is None:
        return default
    try:
        return int(v)
    except (TypeError, ValueError):
        raise CorruptEntry(f"{v!r} is not an integer") from None


@dataclass(frozen=True, eq=False)
class Member:
    """One registered engine as a watcher sees it: its ``address`` (the engine's
    ``engine.address`` bytes, parsed and checked), its named ``descriptors``, its ``meta``
    (small JSON-ready data), whether it announced that it is ``leaving``, and what etcd
    keeps about it (``lease``, ``create_revision``, ``mod_revision``). ``host`` and ``pid``
    are what the registering process reported. A plain record: building one checks nothing;
    :meth:`same_as` costs O(descriptors + meta)."""

    group: str
    name: str
    address: bytes
    descriptors: Mapping[str, MemoryDescriptor]
    meta: Mapping[str, Any]
    leaving: bool = False
    host: str = ""
    pid: int = 0
    lease: int = 0
    create_revision: int = 0
    mod_revision: int = 0

    def same_as(self, other: Member) -> bool:
        """Whether ``other`` describes the same engine (address, descriptors, meta and the
        process), whatever its lease, revisions or leaving state. Raises nothing."""
        return (self.address, dict(self.descriptors), dict(self.meta), self.host, self.pid) == (
            other.address, dict(other.descriptors), dict(other.meta), other.host, other.pid
        )


@dataclass(frozen=True)
class MemberEvent:
    """A change of a group: ``kind`` "join" (a member appeared) or "leave" (it announced it
    is leaving, its key was deleted, or its lease expired). ``clean`` (leaves): True when the
    member announced it (it finishes what it holds), False when it vanished without notice (a
    crash, an expired lease, its key overwritten by another engine). A plain record."""

    kind: Literal["join", "leave"]
    member: Member
    clean: bool = True

    @property
    def joined(self) -> bool:
        """True for a join, False for a leave. O(1), raises nothing."""
        return self.kind == "join"


def encode_value(
    address: bytes,
    descriptors: Mapping[str, MemoryDescriptor | bytes],
    meta: Mapping[str, Any],
    *,
    leaving: bool = False,
    host: str = "",
    pid: int = 0,
) -> bytes:
    """The JSON value of a member record. Raises :class:`~aiote.InvalidArgument` when ``meta``
    is not JSON-ready, a descriptor name is not a string, or the value exceeds
    :data:`MAX_VALUE`. O(value), no I/O."""
    if not all(isinstance(k, str) and k for k in descriptors):
        raise InvalidArgument("descriptor names must be non-empty strings")
    try:
        text = json.dumps(
            {
                "aiote": SCHEMA,
                "address": bytes(address).hex(),
                "descriptors": {k: bytes(v).hex() for k, v in descriptors.items()},
                "meta": dict(meta),
                "state": "leaving" if leaving else "up",
                "host": host,
                "pid": pid,
            },
            separators=(",", ":"),
            sort_keys=True,
            allow_nan=False,
        )
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"member metadata is not JSON-ready: {exc}") from None
    if len(text) > MAX_VALUE:
        raise InvalidArgument(f"member record of {len(text)} B exceeds {MAX_VALUE} B")
    return text.encode()


def _hex(v: Any, what: str) -> bytes:
    if not isinstance(v, str):
        raise CorruptEntry(f"{what} is not a hex string")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise CorruptEntry(f"{what} is not valid hex") from None


def decode_member(prefix: str, group: str, kv: Mapping[str, Any]) -> Member | None:
    """The member an etcd key-value (a gateway ``kv`` object) records, or None when the key
    is not a direct member of ``group`` (a subgroup's). Raises :class:`~aiote.membership.CorruptEntry` naming
    what is wrong: a key or value that is not base64, a bad name, a value that is too large,
    not JSON, of another schema, or whose address or a descriptor does not parse. O(value), no
    I/O."""
    key = unb64(kv.get("key"))
    start = _prefix_of(prefix, group).encode()
    if not key.startswith(start):
        return None
    rest = key[len(start) :]
    if b"/" in rest:
        return None  # a subgroup's member
    try:
        name = validate_name(rest.decode())
    except (UnicodeDecodeError, InvalidArgument):
        raise CorruptEntry(f"key {key!r}: not a valid member name") from None
    raw = unb64(kv.get("value", ""))
    if len(raw) > MAX_VALUE:
        raise CorruptEntry(f"key {key!r}: value of {len(raw)} B exceeds {MAX_VALUE} B")
    try:
        v = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CorruptEntry(f"key {key!r}: value is not JSON") from None
    if not isinstance(v, dict) or v.get("aiote") != SCHEMA:
        raise CorruptEntry(f"key {key!r}: not an aiote member record (schema {SCHEMA})")
    descs, meta, state = v.get("descriptors", {}), v.get("meta", {}), v.get("state", "up")
    if not isinstance(descs, dict) or not isinstance(meta, dict) or state not in ("up", "leaving"):
        raise CorruptEntry(f"key {key!r}: descriptors, meta or state of the wrong type")
    host, pid = v.get("host", ""), v.get("pid", 0)
    if not isinstance(host, str) or isinstance(pid, bool) or not isinstance(pid, int):
        raise CorruptEntry(f"key {key!r}: host or pid of the wrong type")
    address = _hex(v.get("address"), f"key {key!r}: address")
    try:
        EngineAddress.from_bytes(address)
        parsed = {str(k): MemoryDescriptor.from_bytes(_hex(d, f"key {key!r}: descriptor {k!r}"))
                  for k, d in descs.items()}
    except DescriptorError as exc:
        raise CorruptEntry(f"key {key!r}: {exc}") from None
    return Member(
        group, name, address, parsed, meta, state == "leaving", host, pid,
        as_int(kv.get("lease")), as_int(kv.get("create_revision")), as_int(kv.get("mod_revision")),
    )


@dataclass
class GroupView:
    """The members of one group, kept from etcd's answers: feed it the range answer of the
    group (:meth:`apply_range`), then each watch answer (:meth:`apply_watch`), in order; each
    returns the joins and leaves it implies. A corrupt entry is skipped (``on_corrupt`` is
    called with its key and the reason) and never raises; a key overwritten by a corrupt value
    counts as its member leaving without notice.

    ``revision``: the store revision the view reflects; a watch resumes at ``revision + 1``
    (:meth:`watch_request`). ``members``: the current members by name (those that announced
    they are leaving are not in it). No I/O; each call costs O(entries in the answer), plus
    O(members) for a range."""

    prefix: str
    group: str
    on_corrupt: Callable[[str, str], None] = lambda key, why: None
    revision: int = 0
    members: dict[str, Member] = field(default_factory=dict)
    _leaving: dict[str, Member] = field(default_factory=dict)  # announced, key still there

    def __post_init__(self) -> None:
        validate_group(self.group)

    def range_request(self) -> dict[str, Any]:
        """The body of ``/v3/kv/range`` reading the whole group. O(1)."""
        key, end = group_range(self.prefix, self.group)
        return {"key": b64(key), "range_end": b64(end)}

    def watch_request(self) -> dict[str, Any]:
        """The body of ``/v3/watch`` resuming after :attr:`revision` (with the previous value
        of deleted keys, and etcd's progress notifications, which move :attr:`revision` on
        while the group is quiet). O(1)."""
        key, end = group_range(self.prefix, self.group)
        return {"create_request": {"key": b64(key), "range_end": b64(end),
                                   "start_revision": str(self.revision + 1), "prev_kv": True,
                                   "progress_notify": True}}

    def keys_request(self) -> dict[str, Any]:
        """The body of ``/v3/kv/range`` reading the group's keys without their values from the
        member asked (serializable: what its own store, and so its watches, hold). O(1)."""
        return {**self.range_request(), "keys_only": True, "serializable": True}

    def behind(self, answer: Mapping[str, Any]) -> bool:
        """Whether the range answer of :meth:`keys_request` shows a change the view has not
        seen: a key of the group's range modified after :attr:`revision`, or a member (or one
        that announced it is leaving) whose key is gone. A watch that stays behind while
        nothing arrives has stopped delivering. O(entries in the answer + members); raises
        :class:`~aiote.membership.CorruptEntry` for a revision that is not an integer."""
        names: set[str] = set()
        for kv in answer.get("kvs", []) or []:
            if not isinstance(kv, dict):
                continue
            if as_int(kv.get("mod_revision")) > self.revision:
                return True
            name = self._name_of(kv.get("key"))
            if name is not None:
                names.add(name)
        return any(n not in names for n in (*self.members, *self._leaving))

    def _parse(self, kv: Mapping[str, Any]) -> tuple[str | None, Member | None]:
        """(name, member): name None for a key that is not this group's; member None for a
        corrupt entry (reported)."""
        try:
            m = decode_member(self.prefix, self.group, kv)
        except CorruptEntry as exc:
            key = kv.get("key")
            name = self._name_of(key)
            self.on_corrupt(repr(key), str(exc))
            return name, None
        return (None, None) if m is None else (m.name, m)

    def _name_of(self, key: Any) -> str | None:
        try:
            raw = unb64(key)
        except CorruptEntry:
            return None
        start = _prefix_of(self.prefix, self.group).encode()
        rest = raw[len(start) :] if raw.startswith(start) else b"/"
        return None if b"/" in rest else rest.decode(errors="replace")

    def _put(self, name: str, new: Member | None) -> list[MemberEvent]:
        old = self.members.get(name)
        events: list[MemberEvent] = []
        if old is not None and (new is None or not new.same_as(old) or new.leaving):
            del self.members[name]
            clean = new is not None and new.leaving and new.same_as(old)
            events.append(MemberEvent("leave", old, clean))
        self._leaving.pop(name, None)
        if new is None:
            return events
        if new.leaving:
            self._leaving[name] = new
        elif old is not None and name in self.members:
            self.members[name] = new  # the same engine, put again (a new lease): no event
        else:
            self.members[name] = new
            events.append(MemberEvent("join", new))
        return events

    def _delete(self, name: str) -> list[MemberEvent]:
        self._leaving.pop(name, None)
        old = self.members.pop(name, None)
        return [] if old is None else [MemberEvent("leave", old, False)]

    def apply_range(self, answer: Mapping[str, Any]) -> list[MemberEvent]:
        """Applies a whole-group range answer (``/v3/kv/range`` of :meth:`range_request`): the
        group as it is at the answer's revision. Returns the joins and leaves since the view's
        last state (every member as a join the first time). Raises
        :class:`~aiote.membership.CorruptEntry` only for an answer without a header revision
        (not a range answer)."""
        rev = as_int(answer.get("header", {}).get("revision"), -1)
        if rev < 0:
            raise CorruptEntry("a range answer without a header revision")
        seen: dict[str, Member | None] = {}
        for kv in answer.get("kvs", []) or []:
            name, m = self._parse(kv)
            if name is not None:
                seen[name] = m
        events: list[MemberEvent] = []
        for name in [n for n in (*self.members, *self._leaving) if n not in seen]:
            events += self._delete(name)
        for name, m in seen.items():
            events += self._put(name, m)
        self.revision = rev
        return events

    def apply_watch(self, answer: Mapping[str, Any]) -> list[MemberEvent]:
        """Applies one watch answer (the ``result`` object of a ``/v3/watch`` stream line).
        Returns the joins and leaves its events imply, in order; a malformed event is skipped
        (``on_corrupt``). Raises :class:`WatchCancelled` when etcd cancelled the watch
        (``compact_revision`` set when the view must be read again first)."""
        if answer.get("canceled"):
            raise WatchCancelled(str(answer.get("cancel_reason", "watch cancelled")),
                                 as_int(answer.get("compact_revision")))
        events: list[MemberEvent] = []
        evs = answer.get("events") or []
        for ev in evs:
            kv = ev.get("kv") if isinstance(ev, dict) else None
            try:
                if not isinstance(kv, dict):
                    raise CorruptEntry("a watch event without a key-value")
                self.revision = max(self.revision, as_int(kv.get("mod_revision")))
            except CorruptEntry as exc:
                self.on_corrupt(repr(ev)[:200], str(exc))
                continue
            if ev.get("type", "PUT") == "DELETE":
                name = self._name_of(kv.get("key"))
                if name is not None:
                    events += self._delete(name)
            else:
                name, m = self._parse(kv)
                if name is not None:
                    events += self._put(name, m)
        if not evs and not answer.get("created"):  # a progress notification
            header = answer.get("header")
            rev = header.get("revision") if isinstance(header, dict) else None
            if isinstance(rev, str) and rev.isdigit():
                self.revision = max(self.revision, int(rev))
        return events
