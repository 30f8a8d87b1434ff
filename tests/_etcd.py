"""Real etcd servers for the membership tests: Debian's ``etcd-server`` (3.4) started on
loopback with free ports (or on an address the caller gives, inside a network namespace), one
member or a cluster of three; killed, stopped and restarted on the same ports and data. Every
process started here is killed by ``close()``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import httpx

__all__ = ["EtcdCluster", "StallingProxy", "etcd_cluster", "etcd_unavailable", "free_port"]

# quick elections (the minimum lease TTL follows: 1 s here, 2 s with etcd's defaults)
_TIMING = ["--heartbeat-interval", "50", "--election-timeout", "500"]
_STATUS = """
import sys, httpx
try:
    print(httpx.post({url!r}, json={{}}, timeout=1, trust_env=False).text)
except httpx.HTTPError:
    sys.exit(1)
"""


def etcd_unavailable() -> str | None:
    """Why etcd cannot run here, or None."""
    if shutil.which("etcd") is None:
        return "etcd is not installed (Debian: apt-get install etcd-server; scripts/bootstrap.sh does it)"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class _Member:
    name: str
    client: str  # URL
    peer: str  # URL
    data: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class EtcdCluster:
    members: list[_Member]
    prefix: Sequence[str] = ()  # runs etcd under this command (ip netns exec NS)
    tmp: str = ""
    logs: list[str] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [m.client for m in self.members]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def start(self, i: int) -> None:
        m = self.members[i]
        log = open(os.path.join(self.tmp, f"{m.name}.log"), "ab")  # noqa: SIM115 - the child holds it
        m.proc = subprocess.Popen([*self.prefix, *m.argv], stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def status(self, i: int) -> dict[str, Any] | None:
        """Member ``i``'s ``/v3/maintenance/status`` answer, None when it does not answer
        (asked from the member's namespace when there is a prefix)."""
        url = self.members[i].client + "/v3/maintenance/status"
        if self.prefix:
            code = _STATUS.format(url=url)
            r = subprocess.run([*self.prefix, sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=30)
            return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None
        try:
            out: dict[str, Any] = httpx.post(url, json={}, timeout=1, trust_env=False).json()
            return out
        except (httpx.HTTPError, ValueError):
            return None

    def wait_ready(self, indices: Sequence[int] | None = None, timeout: float = 30.0) -> None:
        """Until each member answers status with a leader (the cluster formed)."""
        end = time.monotonic() + timeout
        for i in range(len(self.members)) if indices is None else indices:
            m = self.members[i]
            while True:
                st = self.status(i)
                if st is not None and int(st.get("leader", 0)):
                    break
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd {m.name} exited: {self.log(i)[-2000:]}")
                if time.monotonic() > end:
                    raise TimeoutError(f"etcd {m.name} not ready: {self.log(i)[-2000:]}")
                time.sleep(0.05)

    def log(self, i: int) -> str:
        with open(os.path.join(self.tmp, f"{self.members[i].name}.log"), errors="replace") as f:
            return f.read()

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.members[i].proc
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            p.wait(timeout=30)

    def restart(self, i: int) -> None:
        """Starts a member again on its ports and data (after kill)."""
        m = self.members[i]
        m.argv = [a if a != "new" else "existing" for a in m.argv]
        self.start(i)

    def leader(self) -> int:
        """The index of the leader."""
        ids = []
        for i in range(len(self.members)):
            r = self.status(i)
            assert r is not None
            ids.append((r["header"]["member_id"], r["leader"]))
        lead = ids[0][1]
        return [mid for mid, _ in ids].index(lead)

    def close(self) -> None:
        for i in range(len(self.members)):
            self.kill(i)
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextmanager
def etcd_cluster(n: int = 1, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> Iterator[EtcdCluster]:
    """``n`` etcd members on ``host`` (free ports on loopback; in a namespace, any port is free),
    started and ready; all killed and their data removed at the end."""
    tmp = tempfile.mkdtemp(prefix="aiote-etcd-")
    # in a namespace of its own any port is free; on loopback, ports nobody holds now
    ports = [(2379 + 2 * i, 2380 + 2 * i) if prefix else (free_port(host), free_port(host)) for i in range(n)]
    names = [f"m{i}" for i in range(n)]
    initial = ",".join(f"{nm}=http://{host}:{pp}" for nm, (_, pp) in zip(names, ports, strict=True))
    members = []
    for nm, (cp, pp) in zip(names, ports, strict=True):
        client, peer = f"http://{host}:{cp}", f"http://{host}:{pp}"
        argv = ["etcd", "--name", nm, "--data-dir", os.path.join(tmp, nm), "--listen-client-urls", client,
                "--advertise-client-urls", client, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", initial,
                "--initial-cluster-state", "new", "--initial-cluster-token", os.path.basename(tmp),
                "--logger", "zap", "--log-level", "warn", *_TIMING]
        members.append(_Member(nm, client, peer, os.path.join(tmp, nm), argv))
    c = EtcdCluster(members, prefix, tmp)
    try:
        for i in range(n):
            c.start(i)
        c.wait_ready()
        yield c
    finally:
        c.close()


class StallingProxy:
    """A TCP proxy on loopback to one etcd client URL that can stall the watch streams it
    carries, as a NAT or firewall does when it drops an idle connection's state without a
    word: their bytes stop flowing both ways while the connections stay open, and new
    connections (a new watch, status requests) still work. Run :meth:`serve` in a task group
    (``port = await tg.start(proxy.serve)``) and cancel it at the end."""

    def __init__(self, url: str) -> None:
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        self.host, self.port = host, int(port)
        self._conns: list[dict[str, bool]] = []

    def stall_watches(self) -> int:
        """Stalls every watch connection open now; returns how many."""
        n = 0
        for c in self._conns:
            if c["watch"] and not c["stalled"]:
                c["stalled"] = True
                n += 1
        return n

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        task_status.started(int(listener.extra(anyio.abc.SocketAttribute.local_port)))
        await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        conn = {"watch": False, "stalled": False}
        self._conns.append(conn)
        try:
            async with client, await anyio.connect_tcp(self.host, self.port) as upstream, \
                    anyio.create_task_group() as tg:
                tg.start_soon(self._pipe, client, upstream, conn, True)
                tg.start_soon(self._pipe, upstream, client, conn, False)
        except OSError:
            pass
        finally:
            self._conns.remove(conn)

    @staticmethod
    async def _pipe(src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream, conn: dict[str, bool],
                    request: bool) -> None:
        try:
            async for chunk in src:
                if request and chunk.startswith(b"POST "):  # a request (httpx reuses connections)
                    conn["watch"] = chunk.startswith(b"POST /v3/watch")
                if conn["stalled"]:
                    await anyio.sleep_forever()  # what comes now is lost, and nothing says so
                await dst.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        await dst.aclose()
