"""The sans-I/O part of aiote.membership: keys, values, and the watch's event logic, fed
etcd answers shaped as the v3 JSON gateway returns them (no etcd, no event loop)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from aiote import EngineAddress, InvalidArgument, MemoryDescriptor, RailAddress
from aiote._core._descriptor import _RemoteKey
from aiote.membership import CorruptEntry, GroupView, MemberEvent
from aiote.membership._records import (
    MAX_VALUE,
    WatchCancelled,
    decode_member,
    encode_value,
    group_range,
    member_key,
    validate_group,
)

P = "/aiote/"
G = "kv/decode"


def address(n: int) -> bytes:
    return bytes(EngineAddress((RailAddress("tcp;ofi_rxm", bytes([n]) * 16),), bytes(16)))


def desc(n: int) -> MemoryDescriptor:
    return MemoryDescriptor(4096, 3, 0, 0, bytes(16), (_RemoteKey("tcp;ofi_rxm", bytes([n]) * 16, 0, n),))


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def kv(name: str, value: bytes, rev: int, *, group: str = G, lease: int = 7) -> dict[str, Any]:
    return {"key": b64(f"{P}members/{group}/{name}".encode()), "value": b64(value), "lease": str(lease),
            "create_revision": str(rev), "mod_revision": str(rev), "version": "1"}


def value(n: int, *, leaving: bool = False, meta: dict[str, Any] | None = None) -> bytes:
    return encode_value(address(n), {"kv.pool": desc(n)}, meta or {"n": n}, leaving=leaving, host="h", pid=n)


def put(name: str, val: bytes, rev: int) -> dict[str, Any]:
    return {"header": {"revision": str(rev)}, "events": [{"kv": kv(name, val, rev)}]}


def delete(name: str, rev: int) -> dict[str, Any]:
    key = b64(f"{P}members/{G}/{name}".encode())
    ev = {"type": "DELETE", "kv": {"key": key, "mod_revision": str(rev)}}
    return {"header": {"revision": str(rev)}, "events": [ev]}


def kinds(events: list[MemberEvent]) -> list[tuple[str, str, bool]]:
    return [(e.kind, e.member.name, e.clean) for e in events]


def view() -> tuple[GroupView, list[tuple[str, str]]]:
    bad: list[tuple[str, str]] = []
    return GroupView(P, G, lambda k, why: bad.append((k, why))), bad


def test_keys_and_the_group_range() -> None:
    assert member_key(P, G, "d-1") == b"/aiote/members/kv/decode/d-1"
    start, end = group_range(P, G)
    assert (start, end) == (b"/aiote/members/kv/decode/", b"/aiote/members/kv/decode0")
    for bad in ("", "kv//decode", "/kv", "kv/", "kv decode", "kv/dé", "x" * 129):
        with pytest.raises(InvalidArgument):
            validate_group(bad)
    for bad_name in ("", "a/b", "a b", "é", "n" * 129):
        with pytest.raises(InvalidArgument):
            member_key(P, G, bad_name)


def test_a_value_round_trips_and_its_checks() -> None:
    m = decode_member(P, G, kv("d1", value(1, meta={"kv.layout": {"layers": 4}}), 5))
    assert m is not None and m.name == "d1" and m.group == G
    assert m.address == address(1) and m.descriptors == {"kv.pool": desc(1)}
    assert m.meta == {"kv.layout": {"layers": 4}} and not m.leaving
    assert (m.lease, m.create_revision, m.mod_revision, m.host, m.pid) == (7, 5, 5, "h", 1)
    assert decode_member(P, G, kv("x", value(1), 5, group="kv/decode/sub")) is None  # a subgroup's
    with pytest.raises(InvalidArgument, match="JSON-ready"):
        encode_value(address(1), {}, {"x": object()})
    with pytest.raises(InvalidArgument, match="exceeds"):
        encode_value(address(1), {}, {"x": "y" * MAX_VALUE})


@pytest.mark.parametrize(
    "raw,why",
    [
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not an aiote member record"),
        (json.dumps({"aiote": 2}).encode(), "not an aiote member record"),
        (json.dumps({"aiote": 1, "address": "zz"}).encode(), "not valid hex"),
        (json.dumps({"aiote": 1, "address": 5}).encode(), "not a hex string"),
        (json.dumps({"aiote": 1, "address": "00" * 40}).encode(), "engine address"),
        (json.dumps({"aiote": 1, "address": address(1).hex(), "descriptors": {"p": "00"}}).encode(),
         "descriptor"),
        (json.dumps({"aiote": 1, "address": address(1).hex(), "meta": []}).encode(), "wrong type"),
        (json.dumps({"aiote": 1, "address": address(1).hex(), "state": "gone"}).encode(), "wrong type"),
        (json.dumps({"aiote": 1, "address": address(1).hex(), "pid": "1"}).encode(), "wrong type"),
        (b" " * (MAX_VALUE + 1), "exceeds"),
    ],
)
def test_corrupt_values_are_refused_with_the_reason(raw: bytes, why: str) -> None:
    with pytest.raises(CorruptEntry, match=why):
        decode_member(P, G, kv("d1", raw, 3))


def test_corrupt_keys_are_refused() -> None:
    with pytest.raises(CorruptEntry, match="base64"):
        decode_member(P, G, {"key": "!!!", "value": ""})
    with pytest.raises(CorruptEntry, match="member name"):
        decode_member(P, G, kv("bad name", value(1), 3))


def test_a_range_gives_every_member_as_a_join_and_skips_corrupt_entries() -> None:
    v, bad = view()
    answer = {"header": {"revision": "9"},
              "kvs": [kv("a", value(1), 2), kv("b", b"garbage", 3), kv("c", value(3), 4),
                      kv("s", value(4), 5, group="kv/decode/sub")]}
    assert kinds(v.apply_range(answer)) == [("join", "a", True), ("join", "c", True)]
    assert sorted(v.members) == ["a", "c"] and v.revision == 9
    assert len(bad) == 1 and "b" in bad[0][0] and "not JSON" in bad[0][1]
    assert v.watch_request()["create_request"]["start_revision"] == "10"
    assert v.watch_request()["create_request"]["prev_kv"] is True


def test_watch_events_join_leave_and_the_clean_leave() -> None:
    v, bad = view()
    v.apply_range({"header": {"revision": "1"}})
    assert kinds(v.apply_watch({"header": {"revision": "1"}, "created": True})) == []
    assert kinds(v.apply_watch(put("a", value(1), 2))) == [("join", "a", True)]
    # the same engine put again (a new lease after its lease was lost): nothing to report
    assert kinds(v.apply_watch(put("a", value(1), 3))) == []
    # it announces it is leaving: a clean leave at once, and nothing when its key goes
    assert kinds(v.apply_watch(put("a", value(1, leaving=True), 4))) == [("leave", "a", True)]
    assert v.members == {}
    assert kinds(v.apply_watch(delete("a", 5))) == []
    # another vanishes (its lease expired): a leave without notice
    v.apply_watch(put("b", value(2), 6))
    assert kinds(v.apply_watch(delete("b", 7))) == [("leave", "b", False)]
    # a key taken over by another engine: the old one left without notice, the new one joins
    v.apply_watch(put("c", value(3), 8))
    assert kinds(v.apply_watch(put("c", value(4), 9))) == [("leave", "c", False), ("join", "c", True)]
    assert v.members["c"].address == address(4)
    # a member first seen already leaving never joins
    assert kinds(v.apply_watch(put("d", value(5, leaving=True), 10))) == []
    assert kinds(v.apply_watch(delete("d", 11))) == []
    assert v.revision == 11 and bad == []


def test_corrupt_values_in_a_watch_are_skipped_and_an_overwritten_member_leaves() -> None:
    v, bad = view()
    v.apply_range({"header": {"revision": "1"}})
    assert kinds(v.apply_watch(put("x", b"{", 2))) == []
    assert kinds(v.apply_watch(put("a", value(1), 3))) == [("join", "a", True)]
    assert kinds(v.apply_watch(put("a", b"garbage", 4))) == [("leave", "a", False)]
    assert kinds(v.apply_watch(delete("a", 5))) == []
    bogus = {"header": {"revision": "6"}, "events": [{"kv": {"key": "%%%", "mod_revision": "6"}}]}
    assert kinds(v.apply_watch(bogus)) == []
    assert [k for k, _ in bad] == [repr(b64(b"/aiote/members/kv/decode/x")),
                                  repr(b64(b"/aiote/members/kv/decode/a")), "'%%%'"]
    # malformed events (no key-value, a revision that is not a number) are skipped too
    malformed = {"events": [{"type": "PUT"}, {"kv": {**kv("b", value(2), 7), "mod_revision": "x"}}, 5]}
    assert kinds(v.apply_watch(malformed)) == [] and len(bad) == 6
    assert kinds(v.apply_watch(put("b", value(2), 8))) == [("join", "b", True)]
    assert v.revision == 8


def test_a_resync_reports_what_changed_while_the_watch_was_down() -> None:
    v, _ = view()
    v.apply_range({"header": {"revision": "5"}, "kvs": [kv("a", value(1), 2), kv("b", value(2), 3),
                                                          kv("c", value(3), 4)]})
    v.apply_watch(put("c", value(3, leaving=True), 6))
    # meanwhile: a vanished, c's key went, d joined, b is unchanged
    answer = {"header": {"revision": "20"}, "kvs": [kv("b", value(2), 3), kv("d", value(4), 19)]}
    assert kinds(v.apply_range(answer)) == [("leave", "a", False), ("join", "d", True)]
    assert sorted(v.members) == ["b", "d"] and v.revision == 20


def test_cancellation_compaction_and_progress() -> None:
    v, _ = view()
    v.apply_range({"header": {"revision": "3"}})
    with pytest.raises(WatchCancelled) as exc:
        v.apply_watch({"header": {"revision": "50"}, "canceled": True, "compact_revision": "40"})
    assert exc.value.compact_revision == 40
    with pytest.raises(WatchCancelled) as exc:
        v.apply_watch({"canceled": True, "cancel_reason": "permission denied"})
    assert exc.value.compact_revision == 0 and "permission" in str(exc.value)
    v.apply_watch({"header": {"revision": "30"}})  # a progress notification
    assert v.revision == 30
    with pytest.raises(CorruptEntry):
        v.apply_range({"kvs": []})


def test_behind_a_change_the_stream_has_not_delivered() -> None:
    """What the watch's probe reads (the group's keys from the stream's member) against what
    the stream delivered: a key changed past the view's revision, or a member's key gone."""
    view = GroupView(P, G)
    view.apply_range({"header": {"revision": "10"}, "kvs": [kv("a", value(1), 5), kv("b", value(2), 9)]})

    def keys(*kvs: dict[str, Any], rev: int = 12) -> dict[str, Any]:
        bare = [{k: v for k, v in x.items() if k != "value"} for x in kvs]  # keys_only
        return {"header": {"revision": str(rev)}, "kvs": bare}

    assert not view.behind(keys(kv("a", value(1), 5), kv("b", value(2), 9)))  # other groups moved on
    assert view.behind(keys(kv("a", value(1), 5), kv("b", value(2), 9), kv("c", value(3), 11)))  # a join
    assert view.behind(keys(kv("a", value(1), 5)))  # b's key deleted
    assert view.behind(keys(kv("a", value(1), 5), kv("b", value(2), 12)))  # b set again
    view.apply_watch(put("c", value(3), 11))  # the stream delivers: caught up
    assert not view.behind(keys(kv("a", value(1), 5), kv("b", value(2), 9), kv("c", value(3), 11)))
    assert view.watch_request()["create_request"]["progress_notify"] is True
