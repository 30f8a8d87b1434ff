"""Control messages of the KV flow (small JSON objects over engine.send/recv).

decoder -> prefill: hello {pool, layout}, bye, pages {rid, imm, pages}, reject {rid, why},
                    cancel {rid}, ready {rid, at}
prefill -> decoder: admit {rid, tokens, trace?}, released {rid, ok, why}

``trace``: the prefill side's request span as a W3C ``traceparent`` (engines opened with
tracing, see docs/observability.md): the decode side's spans of the request join its trace.
``imm``: the decoder names each request by a 24-bit sequence number it never reuses while
the request can still be written; layer ``l`` of the request carries ``imm << 8 | l``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .._core._engine import Engine
from .._core._errors import EngineClosed
from .._core._observe import KVRequestObs

TAG = "aiote.kv/1"


def encode(kind: str, **fields: Any) -> bytes:
    return json.dumps({"kv": TAG, "t": kind, **fields}, separators=(",", ":")).encode()


def decode(payload: bytes) -> dict[str, Any] | None:
    """The message, or None for anything that is not a KV-flow message."""
    try:
        msg = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(msg, dict) or msg.get("kv") != TAG or not isinstance(msg.get("t"), str):
        return None
    return msg


def layer_imm(seq: int, layer: int) -> int:
    """The immediate of layer ``layer`` of request ``seq``."""
    return ((seq & 0xFFFFFF) << 8) | layer


async def messages(engine: Engine) -> AsyncIterator[tuple[bytes, dict[str, Any]]]:
    """The KV-flow messages arriving at ``engine`` (others are dropped), until it closes."""
    while True:
        try:
            sender, payload = await engine.recv()
        except EngineClosed:
            return
        msg = decode(payload)
        if msg is not None:
            yield sender, msg


_NOOP = nullcontext()


def active(obs: KVRequestObs | None) -> AbstractContextManager[Any]:
    """``obs.active()`` (the request's span current inside it), or a no-op without one."""
    return _NOOP if obs is None else obs.active()


def outcome(error: BaseException | None) -> str:
    """A finished request's outcome label: ok, cancelled (by either side) or failed."""
    if error is None:
        return "ok"
    return "cancelled" if "cancel" in str(error) else "failed"
