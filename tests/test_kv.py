"""aiote.kv: prefill and decode across real processes (decode workers are `aiote demo
--role decode` processes that verify every page they receive), and in one process with two
engines where a test needs to steer both sides (cancellation, page reuse, deadlines)."""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import numpy as np
import pytest
from _util import eventually

import aiote
from aiote import kv
from aiote.cli import kvdemo

pytestmark = pytest.mark.anyio

# the route: open_engine()'s defaults (same host: shm with direct copies) and tcp
ROUTES = pytest.mark.parametrize("same_host", ["shm", None], ids=["default", "tcp"])
LAYOUT = kv.KVLayout(layers=6, page_tokens=16, token_bytes=512, pool_pages=256)  # 8 KiB pages
BLOCK = kvdemo._block(LAYOUT)


def demo_args(backend: str, same_host: str | None = "shm") -> argparse.Namespace:
    return argparse.Namespace(
        provider="tcp", backend=backend, same_host=same_host or "none", layers=LAYOUT.layers,
        page_tokens=LAYOUT.page_tokens, token_bytes=LAYOUT.token_bytes, pool_pages=LAYOUT.pool_pages,
        kv_timeout=30.0,
    )


async def run_request(prefill: kv.PrefillServer, tokens: int, layer_delay: float = 0.0) -> kv.PrefillRequest:
    req = await prefill.start(tokens, timeout=30)
    try:
        for layer in range(LAYOUT.layers):
            kvdemo.compute_layer(req, layer, BLOCK)
            if layer_delay:
                await anyio.sleep(layer_delay)
            await req.send_layer(layer)
    except kv.RequestFailed:
        await req.cancel()  # done with it: the prefill pages go back
        raise
    await req.finish(timeout=30)
    return req


def assert_route(prefill: kv.PrefillServer, same_host: str | None) -> None:
    """Every decoder the prefill server knows is reached over the route the test is for."""
    assert prefill.decoders
    for address in prefill.decoders:
        got = prefill.engine.route(address).provider
        assert got.startswith("shm" if same_host else "tcp"), (same_host, got)


@asynccontextmanager
async def prefill_server(  # type: ignore[no-untyped-def]
    same_host: str | None = "shm", **kw
) -> AsyncIterator[kv.PrefillServer]:
    async with aiote.open_engine(same_host=same_host) as e, kv.PrefillServer(e, LAYOUT, **kw) as p:
        yield p


@ROUTES
async def test_across_processes_every_page_verified_and_a_decoder_joining(
    anyio_backend: str, same_host: str | None
) -> None:
    args = demo_args(anyio_backend, same_host)
    async with prefill_server(same_host, policy=kv.LeastLoaded()) as prefill:
        d1 = await kvdemo.spawn_decoder(args, prefill.engine.address, "d1")
        await prefill.wait_for_decoders(1, timeout=30)
        assert_route(prefill, same_host)
        lengths = [17, 1, 16, 250, 1000, 3000, 33, 512] * 4
        done: list[kv.PrefillRequest] = []

        async def one(tokens: int) -> None:
            done.append(await run_request(prefill, tokens, layer_delay=0.002))

        async with anyio.create_task_group() as tg:
            for i, tokens in enumerate(lengths):
                if i == len(lengths) // 2:  # a decoder joins under load
                    d2 = await kvdemo.spawn_decoder(args, prefill.engine.address, "d2")
                    await prefill.wait_for_decoders(2, timeout=30)
                tg.start_soon(one, tokens)
        for r in done:
            await r.wait_kv_complete(timeout=30)
        await d1.leave()
        await d2.leave()
        s1, s2 = await d1.finish(), await d2.finish()
        copies = prefill.engine.stats()["direct_copies"]
        assert copies > 0 if same_host else copies == 0  # the KV bytes went the route's way
    assert len(done) == len(lengths)
    assert s1["bad"] == s2["bad"] == 0
    assert s1["verified"] + s2["verified"] == len(lengths)
    assert s2["verified"] > 0  # the one that joined got work
    assert s1["exit"] == s2["exit"] == 0


@ROUTES
async def test_decoder_killed_mid_request_fails_its_requests_only(
    anyio_backend: str, same_host: str | None
) -> None:
    args = demo_args(anyio_backend, same_host)
    async with prefill_server(same_host, policy=kv.RoundRobin()) as prefill:
        victim = await kvdemo.spawn_decoder(args, prefill.engine.address, "victim")
        await prefill.wait_for_decoders(1, timeout=30)
        other = await kvdemo.spawn_decoder(args, prefill.engine.address, "other")
        await prefill.wait_for_decoders(2, timeout=30)
        assert_route(prefill, same_host)
        outcomes: dict[int, object] = {}

        async def one(i: int) -> None:
            try:
                r = await run_request(prefill, 2000, layer_delay=0.1)
                await r.wait_kv_complete(timeout=30)
                outcomes[i] = "ok"
            except kv.RequestFailed as exc:
                outcomes[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
            await anyio.sleep(0.25)  # every request is mid-way through its layers
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
        assert time.monotonic() - killed < 15
        failed = [v for v in outcomes.values() if isinstance(v, kv.RequestFailed)]
        assert 0 < len(failed) < 6, outcomes  # the victim's requests failed, the others finished
        assert all("gone" in str(e) or "unreachable" in str(e).lower() for e in failed), failed
        # new requests go to the survivor
        r = await run_request(prefill, 100)
        await r.wait_kv_complete(timeout=30)
        await other.leave()
        s = await other.finish()
        assert s["bad"] == 0 and s["verified"] == 6 - len(failed) + 1
        await victim.proc.wait()


@asynccontextmanager
async def in_process(**worker_kw) -> AsyncIterator[tuple[kv.PrefillServer, kv.DecodeWorker]]:  # type: ignore[no-untyped-def]
    async with prefill_server() as prefill, aiote.open_engine() as de, kv.DecodeWorker(
        de, LAYOUT, prefill.engine.address, **worker_kw
    ) as worker:
        await prefill.wait_for_decoders(1, timeout=10)
        yield prefill, worker


def holds(worker: kv.DecodeWorker, req: kv.DecodeRequest, rid: int, layers: int) -> bool:
    """Whether the request's pages hold exactly what the synthetic model computed for
    request ``rid`` in its first ``layers`` layers."""
    want = np.empty_like(BLOCK)
    for layer in range(layers):
        for k in (0, 1):
            for i in range(len(req.pages)):
                np.add(BLOCK, kvdemo._tag(rid, layer, k, i), out=want, casting="unsafe")
                if not np.array_equal(req.page(layer, k, i), want):
                    return False
    return True


async def test_cancel_from_the_decode_side_and_pages_reused_at_once() -> None:
    async with in_process() as (prefill, worker):
        first = await prefill.start(1024, timeout=10)
        got = await worker.admitted(timeout=10)
        pages = got.pages.copy()
        for layer in range(3):
            kvdemo.compute_layer(first, layer, BLOCK)
            await first.send_layer(layer)
        await got.layer_ready(2, timeout=10)  # per-layer readiness
        await got.cancel()
        with pytest.raises(kv.RequestFailed):
            await got.wait_ready(timeout=5)
        # the prefill side stops writing: every further layer is refused
        await eventually(lambda: first.error is not None, "the prefill side to stop")
        kvdemo.compute_layer(first, 3, BLOCK)
        with pytest.raises(kv.RequestFailed):
            await first.send_layer(3)
        # its pages come back once the prefill side confirmed nothing more can land
        await eventually(lambda: worker.free_pages == LAYOUT.pool_pages, "every page back")
        # its counters are gone from the C table too, whatever arrived for them
        from aiote.kv._proto import layer_imm

        for layer in range(LAYOUT.layers):
            assert worker.engine.imm_counter(layer_imm(got.seq, layer)).total == 0
            worker.engine.imm_counter(layer_imm(got.seq, layer)).release()
        second = await run_request(prefill, 1024)
        got2 = await worker.next_request(timeout=10)
        assert np.array_equal(np.sort(got2.pages), np.sort(pages))  # the very same pages
        assert got2.rid == second.rid
        assert holds(worker, got2, second.rid, LAYOUT.layers)  # the next request's bytes only
        await got2.release()


async def test_cancel_from_the_prefill_side() -> None:
    async with in_process() as (prefill, worker):
        r = await prefill.start(500, timeout=10)
        got = await worker.admitted(timeout=10)
        for layer in range(2):
            kvdemo.compute_layer(r, layer, BLOCK)
            await r.send_layer(layer)
        await r.cancel()
        with pytest.raises(kv.RequestFailed):
            await got.wait_ready(timeout=10)
        await eventually(lambda: worker.free_pages == LAYOUT.pool_pages, "every page back")
        r2 = await run_request(prefill, 500)
        got2 = await worker.next_request(timeout=10)
        assert holds(worker, got2, r2.rid, LAYOUT.layers)
        await got2.release()


async def test_kv_deadline_fails_the_request_and_frees_its_pages() -> None:
    async with in_process(kv_timeout=0.5) as (prefill, worker):
        r = await prefill.start(300, timeout=10)
        got = await worker.admitted(timeout=10)
        kvdemo.compute_layer(r, 0, BLOCK)
        await r.send_layer(0)  # then the prefill side stalls
        with pytest.raises(kv.RequestFailed, match="kv_timeout"):
            await got.wait_ready(timeout=10)
        await eventually(lambda: r.error is not None, "the prefill side to stop")
        with pytest.raises(kv.RequestFailed):
            await r.send_layer(1)
        await eventually(lambda: worker.free_pages == LAYOUT.pool_pages, "every page back")
        assert worker.failed == 1


async def test_a_prefill_side_once_counted_gone_is_served_again() -> None:
    """The worker counted its prefill side gone (a send timed out, or it was unreachable for a
    while); it lives on and routes a request here: served, every page back after."""
    async with in_process(drain_timeout=2) as (prefill, worker):
        worker._on_prefill_gone(prefill.engine.address, aiote.TransferTimeout("a send timed out"))
        r = await prefill.start(300, timeout=5)  # before: the pages answer was dropped, never granted
        for layer in range(LAYOUT.layers):
            kvdemo.compute_layer(r, layer, BLOCK)
            await r.send_layer(layer)
        await r.finish(timeout=10)
        got = await worker.next_request(timeout=10)
        assert got.rid == r.rid and holds(worker, got, r.rid, LAYOUT.layers)
        await got.release()
        await eventually(lambda: worker.free_pages == LAYOUT.pool_pages, "every page back", 10)


@dataclass
class _Decoder:
    address: bytes
    descriptors: dict[str, aiote.MemoryDescriptor] = field(default_factory=dict)
    meta: dict[str, object] = field(default_factory=dict)


@dataclass
class _Expiry:  # a DecoderEvent: the decoder left the membership without notice
    member: _Decoder
    joined: bool = False
    clean: bool = False


async def test_pages_granted_to_a_decoder_expired_meanwhile_are_freed() -> None:
    """The membership drops a decoder that still lives (its lease expired) while its answer to
    an admission is on the way: told to free those pages."""
    send, source = anyio.create_memory_object_stream[_Expiry](4)
    expire: list[bytes] = []

    def policy(live: Sequence[kv.DecoderInfo]) -> kv.DecoderInfo:
        expire.append(live[0].address)
        send.send_nowait(_Expiry(_Decoder(live[0].address)))  # handled while the admission is out
        return live[0]

    async with prefill_server(policy=policy, decoders=source) as prefill, aiote.open_engine() as de, \
            kv.DecodeWorker(de, LAYOUT, prefill.engine.address, drain_timeout=2) as worker:
        await prefill.wait_for_decoders(1, timeout=10)
        with pytest.raises(kv.RequestFailed):
            await prefill.start(300, timeout=1)
        assert expire == [worker.engine.address] and not prefill.decoders
        await eventually(lambda: worker.free_pages == LAYOUT.pool_pages and not worker.in_flight,
                         "the decoder's pages back", 10)
    send.close()


async def test_hundred_concurrent_requests() -> None:
    async with in_process() as (prefill, worker):
        seen: dict[int, bool] = {}

        async def consumer() -> None:
            for _ in range(100):
                got = await worker.next_request(timeout=60)
                seen[got.rid] = holds(worker, got, got.rid, LAYOUT.layers)
                await got.release()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            for i in range(100):
                tg.start_soon(run_request, prefill, 16 + 7 * i)
        assert len(seen) == 100 and all(seen.values())
        # every page, and every per-request counter, went back
        await eventually(lambda: worker.free_pages == LAYOUT.pool_pages, "every page back")
        assert len(worker.engine._counters) == 0


async def test_bad_arguments() -> None:
    with pytest.raises(aiote.InvalidArgument):
        kv.KVLayout(layers=0, page_tokens=16, token_bytes=8, pool_pages=4)
    with pytest.raises(aiote.InvalidArgument):
        kv.KVLayout(layers=257, page_tokens=16, token_bytes=8, pool_pages=4)
    async with in_process() as (prefill, _worker):
        with pytest.raises(aiote.InvalidArgument):
            await prefill.start(0)
        with pytest.raises(aiote.InvalidArgument):
            await prefill.start(LAYOUT.pool_pages * LAYOUT.page_tokens + 1)
        r = await prefill.start(20, timeout=10)
        with pytest.raises(aiote.InvalidArgument):
            await r.send_layer(LAYOUT.layers)
        await r.cancel()


@ROUTES
async def test_across_processes_hundred_concurrent_deadline_and_prefill_cancel(
    anyio_backend: str, same_host: str | None
) -> None:
    """The decode worker in its own process (verifying every page it receives): 100
    concurrent requests; a request cancelled by the prefill side mid-way whose pages the next
    request reuses; a request the prefill side stalls past the worker's kv_timeout."""
    args = demo_args(anyio_backend, same_host)
    args.kv_timeout = 2.0
    async with prefill_server(same_host) as prefill:
        d = await kvdemo.spawn_decoder(args, prefill.engine.address, "d")
        await prefill.wait_for_decoders(1, timeout=30)
        assert_route(prefill, same_host)
        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(run_request, prefill, 16 + 5 * i)
        # cancelled by the prefill side after two layers; the next request, on the same
        # pages, must hold its own bytes only (the decoder verifies it)
        r = await prefill.start(800, timeout=30)
        for layer in range(2):
            kvdemo.compute_layer(r, layer, BLOCK)
            await r.send_layer(layer)
        await r.cancel()
        await run_request(prefill, 800)
        # stalled past the decoder's kv_timeout: it cancels the request at this side
        s = await prefill.start(300, timeout=30)
        kvdemo.compute_layer(s, 0, BLOCK)
        await s.send_layer(0)
        await eventually(lambda: s.error is not None, "the decoder to cancel the late request", 30)
        with pytest.raises(kv.RequestFailed, match="decode side"):
            await s.send_layer(1)
        await run_request(prefill, 300)  # and the next one works
        await d.leave()
        summary = await d.finish()
    assert summary["bad"] == 0
    assert summary["verified"] == 102  # 100 + the two after the cancelled and the late one
    assert summary["failed"] == 2  # the cancelled one and the late one
    assert summary["exit"] == 0


@ROUTES
async def test_across_processes_decode_side_cancellation_and_page_reuse(
    anyio_backend: str, same_host: str | None
) -> None:
    """The decode worker process cancels every second request once its second layer arrived;
    the prefill side stops writing those, and the requests that reuse their pages at once
    verify with their own bytes only."""
    args = demo_args(anyio_backend, same_host)
    args.cancel_every = 2
    async with prefill_server(same_host) as prefill:
        d = await kvdemo.spawn_decoder(args, prefill.engine.address, "d")
        await prefill.wait_for_decoders(1, timeout=30)
        assert_route(prefill, same_host)
        outcomes: list[str] = []
        for _ in range(10):  # one at a time: each request gets the pages the previous freed
            try:
                await run_request(prefill, 1500, layer_delay=0.02)
                outcomes.append("ok")
            except kv.RequestFailed as exc:
                assert "decode side" in str(exc)
                outcomes.append("cancelled")
            await eventually(lambda: not prefill._requests, "the request to be released", 30)
        await d.leave()
        summary = await d.finish()
    assert outcomes.count("cancelled") == 5 and outcomes.count("ok") == 5
    assert summary["cancelled"] == 5
    assert summary["verified"] == 5 and summary["bad"] == 0 and summary["exit"] == 0
