"""A prefill process for the membership tests: its decoders come from an etcd watch; it runs
requests (``--lanes`` at a time) until a line "stop" on stdin, and reports on stdout, one
JSON object a line: ``member`` (a join or leave it saw, with ``clean``), ``route`` (a
decoder chosen for an admission), ``done`` (a request's end: ``ok``, its decoder), then
``summary``; it exits after a line "exit". Every time is ``time.monotonic()``, the same
clock as the test's. A peer that does not answer is unreachable after 1 s (5 s by default):
requests in flight to a killed decoder fail sooner."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio

import aiote
from aiote import kv, membership
from aiote.cli import kvdemo


def say(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class LoggedRoundRobin(kv.RoundRobin):
    def __call__(self, live: Sequence[kv.DecoderInfo]) -> kv.DecoderInfo:
        d = super().__call__(live)
        say(route=d.address.hex(), t=time.monotonic())
        return d


async def logged(watch: membership.GroupWatch) -> AsyncIterator[membership.MemberEvent]:
    async for ev in watch:
        say(member=ev.kind, addr=ev.member.address.hex(), clean=ev.clean, t=time.monotonic())
        yield ev


async def main(args: argparse.Namespace) -> None:
    layout = kvdemo._layout(args)
    block = kvdemo._block(layout)
    stop = anyio.Event()
    n = {"ok": 0, "failed": 0}
    async with (
        aiote.open_engine("tcp", args.nics.split(","), same_host=None,
                          retry=aiote.RetryPolicy(connect_timeout=1.0)) as engine,
        membership.connect(args.etcd, timeout=2) as members,
        members.watch(args.group, probe_interval=1) as watch,
        kv.PrefillServer(engine, layout, policy=LoggedRoundRobin(), decoders=logged(watch),
                         admit_timeout=5, write_timeout=20) as prefill,
    ):
        say(ready=engine.address.hex())

        async def one(tokens: int) -> None:
            req = None
            try:
                req = await prefill.start(tokens, timeout=30)
                for layer in range(layout.layers):
                    kvdemo.compute_layer(req, layer, block)
                    await req.send_layer(layer)
                await req.finish(timeout=20)
                await req.wait_kv_complete(timeout=20)
                n["ok"] += 1
                say(done=req.rid, ok=True, decoder=req.decoder.address.hex(), t=time.monotonic())
            except (kv.RequestFailed, aiote.TransferTimeout) as exc:
                n["failed"] += 1
                if req is not None:
                    await req.cancel()
                say(done=getattr(req, "rid", None), ok=False, error=str(exc),
                    decoder=req.decoder.address.hex() if req is not None else None, t=time.monotonic())

        async def lane(i: int) -> None:
            k = 0
            while not stop.is_set():
                k += 1
                await one(16 + (i * 37 + k * 53) % 240)
                await anyio.sleep(args.pause)

        async def stdin() -> None:
            async for line in anyio.wrap_file(sys.stdin):
                if line.strip() == "stop":
                    break
            stop.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stdin)
            for i in range(args.lanes):
                tg.start_soon(lane, i)
            await stop.wait()
        say(summary=n)
        # the decoders leave while this server still answers them; then it exits
        async for line in anyio.wrap_file(sys.stdin):
            if line.strip() == "exit":
                break


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    kvdemo.add_arguments(ap)
    ap.add_argument("--lanes", type=int, default=3)
    ap.add_argument("--pause", type=float, default=0.02)
    a = ap.parse_args()
    anyio.run(main, a, backend=a.backend)
