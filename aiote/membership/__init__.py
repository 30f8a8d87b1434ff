"""Membership across hosts on etcd (``aiote.membership``): engines register in groups with
their address, named descriptors and small metadata, under a lease a background task keeps
alive; others watch a group's joins and leaves or read it once. Runs under asyncio and trio.

    from aiote import membership

    async with membership.connect("http://10.0.0.1:2379") as members:
        # a decode worker
        async with members.register("kv/decode", engine.address,
                                    descriptors={"kv.pool": mr.descriptor}, ttl=5):
            ...                                     # a member until the block ends
        # whoever routes to them
        async with members.watch("kv/decode") as watch:
            async for event in watch:               # the current members first, then changes
                print(event.kind, event.member.name, event.member.address.hex())

A process that dies without leaving disappears when its lease expires (``ttl`` seconds after
its last renewal); while etcd cannot be reached registrations and watches keep trying and
nothing else changes. etcd is reached through its v3 JSON gateway with httpx (the ``etcd``
extra: ``pip install 'aiote[etcd]'``); aiote imports and runs without it, and building a
client then raises :class:`~aiote.membership.MembershipError`. Keys, values, leases and failures:
docs/membership.md.
"""

from ._etcd import EtcdClient, EtcdError, EtcdUnavailable, MembershipError
from ._membership import DEFAULT_TTL, Group, Membership, by_rank, connect
from ._records import DEFAULT_PREFIX, MAX_VALUE, CorruptEntry, GroupView, Member, MemberEvent
from ._registration import MemberExists, Registration
from ._watch import GroupWatch

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_TTL",
    "MAX_VALUE",
    "CorruptEntry",
    "EtcdClient",
    "EtcdError",
    "EtcdUnavailable",
    "Group",
    "GroupView",
    "GroupWatch",
    "Member",
    "MemberEvent",
    "MemberExists",
    "Membership",
    "MembershipError",
    "Registration",
    "by_rank",
    "connect",
]
