"""Decoders on three "hosts" (network namespaces on one switched network, subnet 10.218/16)
join and leave, and one is killed with SIGKILL, while a prefill server on a fourth host takes
its decoders from an etcd watch (etcd on the switch) and serves requests. Needs root,
iproute2 and etcd; skipped otherwise."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from _etcd import EtcdCluster, etcd_cluster, etcd_unavailable
from _netns import Lan, lan, netns_unavailable

from aiote._spawn import child_env, python_module
from aiote.testing import stop_process

pytestmark = [pytest.mark.anyio, pytest.mark.netns]

_why = netns_unavailable() or etcd_unavailable()
if _why:
    pytest.skip(_why, allow_module_level=True)

TTL = 2.0
GROUP = "kv/decode"
SHAPE = ["--layers", "4", "--page-tokens", "16", "--token-bytes", "256", "--pool-pages", "128"]
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def net() -> Iterator[tuple[Lan, EtcdCluster]]:
    with lan(4, 218) as n, etcd_cluster(1, host=n.switch_addr, prefix=n.prefix(n.switch)) as etcd:
        yield n, etcd


class Proc:
    """A child process and what it printed (JSON lines parsed), read by a task as it comes."""

    def __init__(self, proc: anyio.abc.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.text: list[str] = []
        self.lines: list[dict[str, Any]] = []
        self.address = ""
        self.changed = anyio.Event()

    async def read(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        async for chunk in self.proc.stdout:
            buf += chunk
            *done, buf = buf.split(b"\n")
            for raw in done:
                self.text.append(raw.decode(errors="replace"))
                if raw.startswith(b"{"):
                    self.lines.append(json.loads(raw))
            self.changed.set()
            self.changed = anyio.Event()
        self.changed.set()

    async def wait_for(self, pred: Any, what: str, timeout: float = 20, text: bool = False) -> Any:
        with anyio.fail_after(timeout):
            while True:
                for ln in self.text if text else self.lines:
                    if pred(ln):
                        return ln
                if self.proc.returncode is not None:
                    raise AssertionError(f"{self.name} exited before {what}")
                await self.changed.wait()

    async def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send(line.encode() + b"\n")


async def starting(
    tg: anyio.abc.TaskGroup, procs: list[Proc], cmds: list[tuple[list[str], str, str]]
) -> list[Proc]:
    """Starts each ``(cmd, name, marker)`` at once (added to ``procs`` as it starts); returns
    them once each printed a line starting with its marker (its address last)."""
    new = []
    for cmd, name, _ in cmds:
        p = Proc(await anyio.open_process(cmd, stdin=-1, stdout=-1, stderr=None, env=child_env()), name)
        procs.append(p)
        tg.start_soon(p.read)
        new.append(p)
    for p, (_, name, marker) in zip(new, cmds, strict=True):
        line = await p.wait_for(lambda t, m=marker: t.startswith(m), f"{name} up", 60, text=True)
        p.address = line.split()[-1].strip('"}')
    return new


async def test_decoders_on_three_hosts_join_leave_and_die_while_a_fourth_serves(
    anyio_backend: str, net: tuple[Lan, EtcdCluster]
) -> None:
    n, etcd = net
    common = ["--etcd", etcd.url, "--nics", "eth0", "--same-host", "none", "--backend", anyio_backend, *SHAPE]
    procs: list[Proc] = []

    def decoder(i: int) -> list[str]:
        return [*n.prefix(n.hosts[i]), *python_module("aiote", "demo", "--role", "decode", "--ttl", str(TTL),
                                                      "--kv-timeout", "20", "--report", *common)]

    try:
        async with anyio.create_task_group() as tg:
            # the prefill host and two decoder hosts start together
            prefill, d0, d1 = await starting(tg, procs, [
                ([*n.prefix(n.hosts[3]), sys.executable, str(HERE / "_kv_prefill.py"), *common], "prefill",
                 '{"ready"'),
                (decoder(0), "d0", "AIOTE_KV_DECODER"),
                (decoder(1), "d1", "AIOTE_KV_DECODER"),
            ])

            def routed(d: Proc, after: float = 0.0, k: int = 1) -> Any:
                return lambda ln: sum(1 for x in prefill.lines if x.get("route") == d.address
                                      and x["t"] > after) >= k

            await prefill.wait_for(routed(d0, k=3), "requests routed to d0")
            await prefill.wait_for(routed(d1, k=3), "requests routed to d1")
            # a decoder joins on a third host: it starts receiving requests
            (d2,) = await starting(tg, procs, [(decoder(2), "d2", "AIOTE_KV_DECODER")])
            await prefill.wait_for(routed(d2, k=3), "requests routed to the decoder that joined")
            # d0 leaves cleanly: announced in etcd, no request after, its requests finish
            await d0.say("leave")
            left = await prefill.wait_for(lambda ln: ln.get("member") == "leave" and ln["addr"] == d0.address,
                                          "d0's leave")
            assert left["clean"] is True
            # d1 is killed: dropped within its TTL plus one second
            t_kill = time.monotonic()
            os.kill(d1.proc.pid, signal.SIGKILL)
            dropped = await prefill.wait_for(
                lambda ln: ln.get("member") == "leave" and ln["addr"] == d1.address, "d1 dropped", TTL + 5)
            assert dropped["clean"] is False
            assert dropped["t"] - t_kill <= TTL + 1, dropped["t"] - t_kill
            # requests go on, to d2 only
            await prefill.wait_for(routed(d2, dropped["t"], k=5), "requests after the drop")
            await prefill.say("stop")
            await prefill.wait_for(lambda ln: "summary" in ln, "the prefill side to stop")
            await d2.say("leave")
            with anyio.fail_after(30):
                await d0.proc.wait()
                await d2.proc.wait()
            await prefill.say("exit")
            with anyio.fail_after(30):
                await prefill.proc.wait()
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            for p in procs:
                await stop_process(p.proc, grace=0)

    assert prefill.proc.returncode == d0.proc.returncode == d2.proc.returncode == 0
    summary = next(x["summary"] for x in prefill.lines if "summary" in x)
    done = [x for x in prefill.lines if "done" in x]
    routes = [x for x in prefill.lines if "route" in x]
    # no admission to d1 after it was dropped, none to d0 after its leave
    assert not [x for x in routes if x["route"] == d1.address and x["t"] >= dropped["t"]]
    assert not [x for x in routes if x["route"] == d0.address and x["t"] >= left["t"]]
    # failures: only requests the killed decoder held
    failed = [x for x in done if not x["ok"]]
    assert all(x["decoder"] == d1.address for x in failed), failed
    assert summary["failed"] == len(failed) and summary["ok"] >= 20
    # every page of every finished request verified by its decoder; the killed one's reports up
    # to its death (a request it finished may have died with it before its report)
    verified = {(d.address, x["rid"]): x["verified"] for d in (d0, d1, d2) for x in d.lines if "rid" in x}
    assert all(v is True for v in verified.values()), [k for k, v in verified.items() if v is not True]
    ok = [(x["decoder"], x["done"]) for x in done if x["ok"]]
    assert {a for a, _ in ok} == {d0.address, d1.address, d2.address}
    assert all(k in verified for k in ok if k[0] != d1.address), [k for k in ok if k not in verified]
    assert sum(1 for k in verified if k[0] == d1.address) >= 3
