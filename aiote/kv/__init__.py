"""KV-cache transfer for disaggregated prefill/decode (``aiote.kv``).

A prefill server streams each computed layer of a request to the decode worker that admitted
it, as one paged write per layer; decode workers join and leave at run time::

    layout = aiote.kv.KVLayout(layers=80, page_tokens=16, token_bytes=8 * 128 * 2, pool_pages=4096)

    # prefill process
    async with aiote.open_engine() as engine, aiote.kv.PrefillServer(engine, layout) as prefill:
        req = await prefill.start(tokens=2048)          # routed to a live decoder
        for layer in range(layout.layers):
            compute_into(req, layer)                    # fill req.page(layer, kv, i)
            await req.send_layer(layer)                 # one paged write; overlaps the next layer
        await req.finish()

    # decode process
    async with aiote.open_engine() as engine, aiote.kv.DecodeWorker(engine, layout, prefill_addr) as worker:
        req = await worker.next_request()               # every layer has arrived
        ...                                             # decode from req.page(layer, kv, i)
        await req.release()

Or decoders are discovered across hosts through etcd (``aiote.membership``): the prefill
server takes ``decoders=members.watch("kv/decode")`` and each decode worker
``registry=members.group("kv/decode")`` instead of the prefill address.

How a page is never reused while a write to it may still land: the decode side frees a
request's pages only when the prefill side has told it that every write it posted for the
request has completed (on tcp a completed write has been placed; a posted write cannot be
taken back, so the prefill side waits for it), or when the prefill process is gone (its
connections are reset: nothing of it can land any more). Immediates name requests: the
decode side numbers each request with a 24-bit sequence it does not reuse, and layer ``l``
carries ``seq << 8 | l``, so a late write of an old request is never counted for another.
"""

from ._decode import DecodeRequest, DecodeWorker, RequestFailed
from ._layout import KVLayout, PageAllocator
from ._members import (
    LAYOUT_META,
    POOL_DESCRIPTOR,
    DecoderEvent,
    DecoderRecord,
    DecoderRegistration,
    DecoderRegistry,
    DecoderSource,
)
from ._prefill import DecoderInfo, LeastLoaded, PrefillRequest, PrefillServer, RoundRobin, RoutingPolicy

__all__ = [
    "LAYOUT_META",
    "POOL_DESCRIPTOR",
    "DecodeRequest",
    "DecodeWorker",
    "DecoderEvent",
    "DecoderInfo",
    "DecoderRecord",
    "DecoderRegistration",
    "DecoderRegistry",
    "DecoderSource",
    "KVLayout",
    "LeastLoaded",
    "PageAllocator",
    "PrefillRequest",
    "PrefillServer",
    "RequestFailed",
    "RoundRobin",
    "RoutingPolicy",
]
