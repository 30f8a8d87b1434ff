"""``aiote demo``: disaggregated prefill/decode with KV-cache transfer, layer by layer.

One prefill process (this one) and decode worker processes on tcp loopback. A synthetic
model computes each layer with NumPy, filling the request's KV pages with bytes derived from
(request, layer, K/V, page); each layer goes out as one paged write as soon as it is
computed. Halfway, one decoder leaves and a new one joins. Every decoder verifies every page
of every request it receives. Prints a progress bar and a summary on stderr, and one JSON
object as the last line of stdout; exits non-zero unless every finished request verified.

With ``--etcd URL`` the decoders are not told the prefill address: each registers itself in
the group ``--group`` (``kv/decode``) of that etcd cluster, and the prefill server takes its
decoders from a watch of the group (``aiote.membership``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np

import aiote
from aiote import kv, membership
from aiote._spawn import child_env, python_module
from aiote.testing import ready_line

from . import _observe

SEED = 20251107


def _block(layout: kv.KVLayout) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, layout.page_bytes, dtype=np.uint8)


def _tag(rid: int, layer: int, k: int, i: int) -> int:
    return (rid * 131 + layer * 7 + k * 3 + i * 13 + 1) % 256


def compute_layer(req: kv.PrefillRequest, layer: int, block: np.ndarray) -> None:
    """The synthetic model's layer: K and V of every page of the request."""
    for k in (0, 1):
        for i in range(len(req.pages)):
            np.add(block, _tag(req.rid, layer, k, i), out=req.page(layer, k, i), casting="unsafe")


def verify(req: kv.DecodeRequest, layout: kv.KVLayout, block: np.ndarray) -> bool:
    want = np.empty_like(block)
    for layer in range(layout.layers):
        for k in (0, 1):
            for i in range(len(req.pages)):
                np.add(block, _tag(req.rid, layer, k, i), out=want, casting="unsafe")
                if not np.array_equal(req.page(layer, k, i), want):
                    return False
    return True


def _same_host(args: argparse.Namespace) -> str | None:
    v = getattr(args, "same_host", "shm")
    return None if v in (None, "none") else str(v)


def _nics(args: argparse.Namespace) -> list[str] | None:
    v = getattr(args, "nics", None)
    return [n for n in v.split(",") if n] if v else None


async def _engine(
    stack: AsyncExitStack, args: argparse.Namespace, observe: aiote.Observability | None = None
) -> aiote.Engine:
    """The process's engine (``--provider``, ``--nics``, ``--same-host``, and what it
    exports), entered on ``stack``."""
    engine = aiote.open_engine(args.provider, _nics(args), same_host=_same_host(args), observe=observe)
    return await stack.enter_async_context(engine)


async def _members(stack: AsyncExitStack, args: argparse.Namespace) -> membership.Membership:
    """The etcd membership of ``--etcd``, entered on ``stack``."""
    return await stack.enter_async_context(membership.connect(args.etcd))


def _layout(args: argparse.Namespace) -> kv.KVLayout:
    return kv.KVLayout(
        layers=args.layers,
        page_tokens=args.page_tokens,
        token_bytes=args.token_bytes,
        pool_pages=args.pool_pages,
    )


# ------------------------------------------------------------------ decode worker process


async def decode_main(args: argparse.Namespace) -> None:
    layout = _layout(args)
    block = _block(layout)
    prefill = bytes.fromhex(args.prefill) if args.prefill else None
    done = {"verified": 0, "bad": 0, "failed": 0, "requests": 0}
    async with AsyncExitStack() as stack:
        observe = await stack.enter_async_context(_observe.exporting(args, "decode"))
        engine = await _engine(stack, args, observe)
        registry = (await _members(stack, args)).group(args.group, ttl=args.ttl) if args.etcd else None
        leave = anyio.Event()

        async def watch_stdin() -> None:
            stream = anyio.wrap_file(sys.stdin)
            async for line in stream:
                if line.strip() == "leave":
                    break
            leave.set()

        worker = kv.DecodeWorker(engine, layout, prefill, registry=registry, kv_timeout=args.kv_timeout)
        async with worker:
            sys.stdout.write(f"AIOTE_KV_DECODER {engine.address.hex()}\n")
            sys.stdout.flush()

            async def leave_on_request() -> None:
                await leave.wait()
                await worker.leave()

            async def check(req: kv.DecodeRequest) -> None:
                done["requests"] += 1
                ok = verify(req, layout, block) if args.verify else None
                if ok is False:
                    done["bad"] += 1
                else:
                    done["verified"] += 1  # without --verify (benchmarks): counted as received
                if args.report:  # one line per request, as it is checked
                    sys.stdout.write(json.dumps({"rid": req.rid, "verified": ok}) + "\n")
                    sys.stdout.flush()
                await req.release()

            async def cancel_some() -> None:
                """Test mode: every n-th admitted request is cancelled once its second layer
                arrived; the others are verified as usual."""
                async with anyio.create_task_group() as handlers:
                    n = 0
                    while not leave.is_set():
                        with anyio.move_on_after(0.05):
                            req = await worker.admitted()
                            n += 1
                            handlers.start_soon(handle, req, n % args.cancel_every == 0)

            async def handle(req: kv.DecodeRequest, cancel: bool) -> None:
                try:
                    if cancel:
                        await req.layer_ready(min(1, layout.layers - 1))
                        await req.cancel()
                        done["cancelled"] = done.get("cancelled", 0) + 1
                        return
                    await req.wait_ready()
                except kv.RequestFailed:
                    return
                await check(req)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_stdin)
                tg.start_soon(leave_on_request)
                if args.cancel_every:
                    await cancel_some()
                else:
                    async for req in worker.requests():
                        await check(req)
                tg.cancel_scope.cancel()
            done["failed"] = worker.failed
        # leaving: the worker said bye and finished what was in flight
    sys.stdout.write(json.dumps(done) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------ the prefill side


class Decoder:
    def __init__(self, proc: anyio.abc.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.summary: dict[str, Any] | None = None

    async def leave(self) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send(b"leave\n")

    async def finish(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        out = b""
        with anyio.fail_after(120):
            async for chunk in self.proc.stdout:
                out += chunk
            await self.proc.wait()
        lines = [ln for ln in out.decode().splitlines() if ln.startswith("{")]
        self.summary = (
            json.loads(lines[-1]) if lines else {"verified": 0, "bad": 0, "failed": 0, "requests": 0}
        )
        self.summary["exit"] = self.proc.returncode
        return self.summary


async def spawn_decoder(args: argparse.Namespace, prefill: bytes, name: str) -> Decoder:
    etcd = getattr(args, "etcd", None)
    join = ["--prefill", prefill.hex()]
    if etcd:  # no address: it registers in etcd, the prefill server watches
        join = ["--etcd", etcd, "--group", args.group, "--ttl", str(args.ttl)]
    if getattr(args, "nics", None):
        join += ["--nics", args.nics]
    cmd = [
        *python_module("aiote"),
        "demo",
        "--role",
        "decode",
        *join,
        "--provider",
        args.provider,
        "--same-host",
        getattr(args, "same_host", "shm"),
        "--backend",
        args.backend,
        "--layers",
        str(args.layers),
        "--page-tokens",
        str(args.page_tokens),
        "--token-bytes",
        str(args.token_bytes),
        "--pool-pages",
        str(args.pool_pages),
        "--kv-timeout",
        str(args.kv_timeout),
        *([] if getattr(args, "verify", True) else ["--no-verify"]),
        *(["--cancel-every", str(args.cancel_every)] if getattr(args, "cancel_every", 0) else []),
        *_observe.child_arguments(args),
    ]
    proc = await anyio.open_process(cmd, stdin=-1, stdout=-1, stderr=None, env=child_env())
    await ready_line(proc, "AIOTE_KV_DECODER", 60)
    return Decoder(proc, name)


class Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.tty = sys.stderr.isatty()
        self.events: list[str] = []
        self.on_half: Callable[[], None] = lambda: None

    def note(self, text: str) -> None:
        self.events.append(text)
        sys.stderr.write(("\n" if self.tty else "") + f"[demo] {text}\n")
        self.draw()

    def step(self, ok: bool) -> None:
        self.done += 1
        if self.done == self.total // 2:
            self.on_half()
        self.failed += 0 if ok else 1
        if self.tty or self.done % 8 == 0 or self.done == self.total:
            self.draw()

    def draw(self) -> None:
        width = 40
        filled = width * self.done // self.total
        bar = "#" * filled + "." * (width - filled)
        line = f"[{bar}] {self.done}/{self.total} requests, {self.failed} failed"
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def _prefill_server(
    stack: AsyncExitStack, args: argparse.Namespace, layout: kv.KVLayout, observe: aiote.Observability | None
) -> kv.PrefillServer:
    """The demo's prefill server (and its engine, and with ``--etcd`` its watch of the
    decoders' group), entered on ``stack``."""
    engine = await _engine(stack, args, observe)
    watch = None
    if args.etcd:
        watch = await stack.enter_async_context((await _members(stack, args)).watch(args.group))
    server = kv.PrefillServer(engine, layout, policy=kv.LeastLoaded(), decoders=watch)
    return await stack.enter_async_context(server)


async def prefill_main(args: argparse.Namespace) -> int:
    """The demo's prefill process (this one); /metrics and spans while it runs (and
    ``--metrics-linger`` seconds after its summary)."""
    async with _observe.exporting(args, "prefill") as observe:
        return await _prefill_run(args, observe)


async def _prefill_run(args: argparse.Namespace, observe: aiote.Observability | None) -> int:
    layout = _layout(args)
    block = _block(layout)
    rng = np.random.default_rng(7)
    lengths = rng.integers(args.min_tokens, args.max_tokens + 1, size=args.requests).tolist()
    progress = Progress(args.requests)
    records: list[dict[str, Any]] = []
    failed = 0
    async with AsyncExitStack() as stack:
        prefill = await _prefill_server(stack, args, layout, observe)
        engine = prefill.engine
        decoders = [await spawn_decoder(args, engine.address, f"decoder-{i + 1}") for i in range(2)]
        await prefill.wait_for_decoders(2, timeout=60)
        routes = sorted({engine.route(a).provider for a in prefill.decoders})
        how = f", decoders discovered through etcd at {args.etcd}" if args.etcd else ""
        progress.note(f"prefill and {len(decoders)} decode workers up (route: {', '.join(routes)}{how})")
        sem = anyio.Semaphore(args.concurrency)
        t0 = time.monotonic()

        async def one(tokens: int) -> None:
            nonlocal failed
            req: kv.PrefillRequest | None = None
            async with sem:
                try:
                    req = await prefill.start(tokens, timeout=60)
                    first = time.monotonic()
                    for layer in range(layout.layers):
                        compute_layer(req, layer, block)
                        if args.layer_ms:
                            await anyio.sleep(args.layer_ms / 1000)
                        await req.send_layer(layer)
                    await req.finish(timeout=120)
                except kv.RequestFailed as exc:
                    if req is not None:
                        await req.cancel()  # we are done with it: its prefill pages go back
                    failed += 1
                    progress.note(f"request failed: {exc}")
                    progress.step(False)
                    return
            try:  # the prefill slot is free once its writes landed; the decoder reports after
                done_at = await req.wait_kv_complete(timeout=120)
            except kv.RequestFailed as exc:
                failed += 1
                progress.note(f"request failed: {exc}")
                progress.step(False)
                return
            assert req.last_layer_at is not None
            records.append(
                {
                    "rid": req.rid,
                    "tokens": tokens,
                    "bytes": layout.layers * 2 * len(req.pages) * layout.page_bytes,
                    "transfer_ms": (done_at - first) * 1000,
                    "tail_ms": (done_at - req.last_layer_at) * 1000,
                    "decoder": req.decoder.address.hex()[-8:],
                }
            )
            progress.step(True)

        async def scale_halfway() -> None:
            # halfway: one decoder leaves (it finishes what it holds), a new one joins
            await halfway.wait()
            await decoders[0].leave()
            progress.note("decoder-1 leaving; decoder-3 joining")
            decoders.append(await spawn_decoder(args, engine.address, "decoder-3"))
            await prefill.wait_for_decoders(2, timeout=60)

        halfway = anyio.Event()
        progress.on_half = halfway.set
        async with anyio.create_task_group() as tg:
            tg.start_soon(scale_halfway)
            for tokens in lengths:
                tg.start_soon(one, int(tokens))
        wall = time.monotonic() - t0
        for d in decoders[1:]:
            await d.leave()
        for d in decoders:
            await d.finish()
    return _report(args, layout, decoders, records, failed, wall, progress.events)


def _report(
    args: argparse.Namespace, layout: kv.KVLayout, decoders: list[Decoder], records: list[dict[str, Any]],
    failed: int, wall: float, events: list[str],
) -> int:
    """Prints the summary (stderr) and the JSON result (stdout); the exit status."""
    summaries = [d.summary or {} for d in decoders]
    verified_requests = sum(s.get("verified", 0) for s in summaries)
    bad = sum(s.get("bad", 0) for s in summaries)
    kv_bytes = sum(r["bytes"] for r in records)
    exits_ok = all((d.summary or {}).get("exit") == 0 for d in decoders)
    ok = bad == 0 and failed == 0 and exits_ok and verified_requests == len(records) == args.requests
    transfer = sorted(r["transfer_ms"] for r in records) or [0.0]
    tail = sorted(r["tail_ms"] for r in records) or [0.0]

    def pct(v: list[float], q: float) -> float:
        return round(v[min(len(v) - 1, int(q * len(v)))], 2)

    sys.stderr.write("\n  decoder     requests  verified  bad  exit\n")
    for d in decoders:
        s = d.summary or {}
        sys.stderr.write(
            f"  {d.name:10} {s.get('requests', 0):9} {s.get('verified', 0):9} {s.get('bad', 0):4} "
            f"{s.get('exit')!s:>5}\n"
        )
    sys.stderr.write(
        f"  {len(records)} requests, {kv_bytes / 1e9:.2f} GB of KV in {wall:.2f} s "
        f"({kv_bytes / wall / 1e9:.2f} GB/s); transfer p50 {pct(transfer, 0.5)} ms, "
        f"p99 {pct(transfer, 0.99)} ms; "
        f"tail p50 {statistics.median(tail):.2f} ms; "
        f"{'every page verified' if ok else 'VERIFICATION FAILED'}\n"
    )
    result = {
        "requests": args.requests,
        "finished": len(records),
        "verified": ok,
        "failed": failed,
        "bad": bad,
        "kv_bytes": kv_bytes,
        "seconds": round(wall, 3),
        "throughput_gbps": round(kv_bytes / wall / 1e9, 3),
        "transfer_ms_p50": pct(transfer, 0.5),
        "transfer_ms_p99": pct(transfer, 0.99),
        "tail_ms_p50": round(statistics.median(tail), 2),
        "layers": layout.layers,
        "page_bytes": layout.page_bytes,
        "decoders": [d.summary for d in decoders],
        "events": events,
        "provider": args.provider,
        "same_host": _same_host(args),
        "backend": args.backend,
        "etcd": args.etcd,
    }
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


# ------------------------------------------------------------------ command line


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument(
        "--token-bytes", type=int, default=8 * 128 * 2, help="per token per layer, K (V the same)"
    )
    ap.add_argument("--pool-pages", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in prefill at once")
    ap.add_argument("--layer-ms", type=float, default=0.0, help="extra compute time per layer")
    ap.add_argument("--kv-timeout", type=float, default=60.0)
    ap.add_argument("--provider", default="tcp", help="libfabric provider (default tcp on lo)")
    ap.add_argument(
        "--same-host", default="shm",
        help="open_engine(same_host=...): 'shm' (the default: same-host peers get the same-host "
        "route, direct copies checked against the owner's table) or 'none' (every peer over --provider)",
    )
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--nics", help="comma-separated NICs of every process (default: lo)")
    ap.add_argument(
        "--etcd", metavar="URL",
        help="decoders register in etcd at URL (comma-separated client URLs) and the prefill server "
        "discovers them through a watch (aiote.membership; needs the etcd extra: httpx)",
    )
    ap.add_argument("--group", default="kv/decode", help="the decoders' membership group (with --etcd)")
    ap.add_argument("--ttl", type=float, default=5.0, help="the decoders' lease TTL in seconds (with --etcd)")
    ap.add_argument("--role", default="prefill", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--report", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prefill", help=argparse.SUPPRESS)
    ap.add_argument("--no-verify", dest="verify", action="store_false", help=argparse.SUPPRESS)
    ap.add_argument("--cancel-every", type=int, default=0, help=argparse.SUPPRESS)
    _observe.add_arguments(ap)


def main(args: argparse.Namespace) -> int:
    """Runs the demo (or, with ``--role decode``, one decode worker process)."""
    if args.requests < 2 or args.min_tokens < 1 or args.max_tokens < args.min_tokens:
        raise SystemExit("--requests must be >= 2 and 1 <= --min-tokens <= --max-tokens")
    if args.role == "decode":
        anyio.run(decode_main, args, backend=args.backend)
        return 0
    code: int = anyio.run(prefill_main, args, backend=args.backend)
    return code


if __name__ == "__main__":
    _ap = argparse.ArgumentParser(prog="aiote-kvdemo")
    add_arguments(_ap)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(_ap.parse_args()))
