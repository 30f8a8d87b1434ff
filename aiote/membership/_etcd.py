"""A small etcd v3 client over the JSON gateway (``/v3/...`` on etcd's client URL) with httpx
on anyio, so one client serves asyncio and trio. Unary calls fail over between endpoints;
every call has a deadline. httpx is imported when a client is built (the ``etcd`` extra)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from aiote import AioteError, InvalidArgument

from ._records import as_int, b64

if TYPE_CHECKING:  # pragma: no cover
    import httpx

__all__ = ["EtcdClient", "EtcdError", "EtcdUnavailable", "MembershipError", "parse_endpoints"]

# gRPC codes the gateway returns for a member that cannot serve now (another may):
# 4 DEADLINE_EXCEEDED, 14 UNAVAILABLE (no leader, stopping), 10 ABORTED
_RETRY_CODES = {4, 10, 14}
# a member without a leader refuses streams instead of serving stale ones (etcd's clientv3 does
# the same with this gRPC metadata)
_HEADERS = {"Grpc-Metadata-hasleader": "true"}


class MembershipError(AioteError):
    """A membership operation failed (see the subclasses)."""


class EtcdUnavailable(MembershipError):
    """No etcd endpoint answered in time. The message names the endpoints tried and the last
    error; ``endpoints`` lists them."""

    def __init__(self, message: str, endpoints: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.endpoints = tuple(endpoints)


class EtcdError(MembershipError):
    """etcd answered with an error (``code``: its gRPC code, e.g. 5 for a lease not found)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise MembershipError(
            "aiote.membership needs httpx (the etcd extra): pip install 'aiote[etcd]'"
        ) from None
    return httpx


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """Client URLs from a comma-separated string or a sequence: each ``http://host:port`` or
    ``https://...``, without a trailing slash. Raises :class:`~aiote.InvalidArgument` for an
    empty list or a URL of another scheme. O(endpoints), no I/O."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = [str(e).strip().rstrip("/") for e in items if str(e).strip()]
    if not out:
        raise InvalidArgument("no etcd endpoint given")
    for e in out:
        if not e.startswith(("http://", "https://")) or "://" not in e or len(e.split("://", 1)[1]) == 0:
            raise InvalidArgument(f"etcd endpoint {e!r} is not an http:// or https:// URL")
    return out


def _error_of(body: Any) -> tuple[int, str] | None:
    """(gRPC code, message) of a gateway error body, or None."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict):  # a stream's error line
        return as_int(err.get("grpc_code")), str(err.get("message", err))
    if err is not None or ("code" in body and "message" in body):
        return as_int(body.get("code")), str(body.get("message", err))
    return None


class EtcdClient:
    """A connection pool to an etcd cluster's JSON gateway: ``endpoints`` are client URLs
    (``http://10.0.0.1:2379``); ``timeout`` bounds every unary call (all endpoints
    together). A unary call tries the endpoints in turn from the last one that answered; one
    that cannot be reached, times out, or has no leader makes it try the next.

    Use it as an async context manager (it owns an ``httpx.AsyncClient``). Building one
    raises :class:`~aiote.InvalidArgument` for bad endpoints and
    :class:`~aiote.membership.MembershipError` when httpx is not installed; no I/O until a
    call."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout: float = 5.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be > 0, not {timeout!r}")
        self.timeout = float(timeout)
        self._httpx = _httpx()
        self._current = 0
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> EtcdClient:
        self._http = self._httpx.AsyncClient(trust_env=False, headers=_HEADERS, timeout=self.timeout)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        http, self._http = self._http, None
        if http is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await http.aclose()

    @property
    def endpoint(self) -> str:
        """The endpoint the next call tries first (the last one that answered). O(1)."""
        return self.endpoints[self._current]

    def rotate(self) -> str:
        """Makes the next endpoint the first to try; returns it. O(1), raises nothing."""
        self._current = (self._current + 1) % len(self.endpoints)
        return self.endpoint

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise MembershipError("the etcd client is not open (use it in `async with`)")
        return self._http

    async def call(
        self, path: str, body: dict[str, Any], *, timeout: float | None = None, endpoint: str | None = None
    ) -> dict[str, Any]:
        """POSTs ``body`` to ``path`` (``/v3/kv/range``...) and returns the JSON answer.

        Tries the endpoints in turn from :attr:`endpoint` (with ``endpoint``, that one only),
        each try getting an equal share of what is left of ``timeout`` (default: the
        client's). When every endpoint failed it gives up at once if none could be reached,
        and tries them all again (after 50 ms, then longer) while one answered that it cannot
        serve now (no leader: an election). Raises :class:`~aiote.membership.EtcdUnavailable` naming every
        endpoint tried and the last error, :class:`~aiote.membership.EtcdError` when etcd refused the call.
        Costs one HTTP request per try."""
        budget = self.timeout if timeout is None else timeout
        deadline = anyio.current_time() + budget
        urls = [endpoint] if endpoint is not None else None
        tried: list[str] = []
        last = "no endpoint tried"
        pause = 0.05
        while True:
            electing = False
            order = urls or [self.endpoints[(self._current + i) % len(self.endpoints)]
                             for i in range(len(self.endpoints))]
            for i, url in enumerate(order):
                left = deadline - anyio.current_time()
                if left <= 0:
                    break
                if url not in tried:
                    tried.append(url)
                answer, last, retry = await self._try(url, path, body, left / (len(order) - i))
                if answer is not None:
                    return answer
                electing = electing or retry
                if url == self.endpoint:
                    self.rotate()
            if not electing or deadline - anyio.current_time() <= pause:
                raise EtcdUnavailable(
                    f"etcd is unreachable at {', '.join(tried or self.endpoints)} "
                    f"({last}; within {budget:g} s)",
                    tried or self.endpoints,
                )
            await anyio.sleep(pause)
            pause = min(0.5, pause * 2)

    async def _try(
        self, url: str, path: str, body: dict[str, Any], share: float
    ) -> tuple[dict[str, Any] | None, str, bool]:
        """One request: (answer, "", False), or (None, why, whether the member answered that
        it cannot serve now). Raises :class:`~aiote.membership.EtcdError` for a refusal."""
        try:
            with anyio.fail_after(share):
                r = await self._client().post(url + path, json=body, timeout=share)
            answer = r.json()
        except (TimeoutError, self._httpx.HTTPError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, False
        err = _error_of(answer)
        if err is not None:
            code, msg = err
            if code in _RETRY_CODES:
                return None, f"{msg} (code {code})", True
            raise EtcdError(f"etcd at {url} refused {path}: {msg}", code)
        if not isinstance(answer, dict):
            raise EtcdError(f"etcd at {url} answered {path} with {answer!r}")
        return answer, "", False

    @asynccontextmanager
    async def stream(
        self, path: str, body: dict[str, Any], *, endpoint: str | None = None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """A streaming call (``/v3/watch``) on ``endpoint`` (default :attr:`endpoint`): yields an
        iterator of the
        ``result`` objects of the answer's lines. Connecting is bounded by the client's
        timeout; reading is not (a watch may stay quiet for hours: whoever reads must watch
        the endpoint's health, see :meth:`status`). The iterator raises
        :class:`~aiote.membership.EtcdError` for an error line or one that is not JSON,
        :class:`~aiote.membership.EtcdUnavailable` when the connection breaks, and ends when
        etcd closes the stream. Entering raises :class:`~aiote.membership.EtcdUnavailable` when
        the endpoint cannot be reached in time. Costs one HTTP connection while open."""
        http = self._client()
        base = endpoint or self.endpoint
        t = self._httpx.Timeout(self.timeout, read=None)
        try:
            with anyio.fail_after(self.timeout):
                cm = http.stream("POST", base + path, json=body, timeout=t)
                resp = await cm.__aenter__()
        except (TimeoutError, self._httpx.HTTPError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise EtcdUnavailable(f"etcd is unreachable at {base} ({why})", [base]) from None
        try:
            # closed here even when the reader stops mid-way (an exception at its yield)
            async with aclosing(self._lines(resp, base)) as lines:
                yield lines
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await cm.__aexit__(None, None, None)

    async def _lines(self, resp: httpx.Response, url: str) -> AsyncGenerator[dict[str, Any], None]:
        lines = resp.aiter_lines()
        while True:
            try:
                line = await lines.__anext__()
            except StopAsyncIteration:
                return
            except self._httpx.HTTPError as exc:
                raise EtcdUnavailable(f"etcd at {url} broke the stream ({type(exc).__name__}: {exc})",
                                      [url]) from None
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                raise EtcdError(f"etcd at {url} streamed a line that is not JSON: {line[:200]!r}") from None
            err = _error_of(msg)
            if err is not None:
                raise EtcdError(f"etcd at {url}: {err[1]}", err[0])
            result = msg.get("result") if isinstance(msg, dict) else None
            if isinstance(result, dict):
                yield result

    # ------------------------------------------------------------------ the calls aiote makes

    async def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``/v3/maintenance/status`` of the first endpoint that answers (it becomes
        :attr:`endpoint`). Raises as :meth:`call`; one request per endpoint tried."""
        return await self.call("/v3/maintenance/status", {}, timeout=timeout)

    async def grant(self, ttl: float, *, timeout: float | None = None) -> tuple[int, int]:
        """A new lease of ``ttl`` seconds (rounded up; etcd may raise it to its minimum):
        ``(lease id, TTL granted)``. Raises as :meth:`call`; one request."""
        r = await self.call("/v3/lease/grant", {"TTL": str(max(1, math.ceil(ttl)))}, timeout=timeout)
        return as_int(r.get("ID")), as_int(r.get("TTL"))

    async def keepalive(self, lease: int, *, timeout: float | None = None) -> int:
        """Renews ``lease`` once; returns its TTL now, 0 when the lease is gone (expired or
        revoked). Raises as :meth:`call`; one request (a one-message keep-alive stream)."""
        r = await self.call("/v3/lease/keepalive", {"ID": str(lease)}, timeout=timeout)
        result = r.get("result", r)
        return as_int(result.get("TTL")) if isinstance(result, dict) else 0

    async def revoke(self, lease: int, *, timeout: float | None = None) -> None:
        """Revokes ``lease``: its keys are deleted. A lease already gone is not an error.
        Raises as :meth:`call`; one request."""
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease)}, timeout=timeout)
        except EtcdError as exc:
            if exc.code != 5:  # NOT_FOUND: expired already
                raise

    async def put(self, key: bytes, value: bytes, *, lease: int = 0, timeout: float | None = None) -> None:
        """Sets ``key`` to ``value`` (attached to ``lease`` when not 0). Raises as :meth:`call`
        (:class:`~aiote.membership.EtcdError` code 5 when the lease is gone); one request."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        await self.call("/v3/kv/put", body, timeout=timeout)

    async def create(self, key: bytes, value: bytes, *, lease: int, timeout: float | None = None) -> bool:
        """Sets ``key`` only if it does not exist (one transaction); True when it was set, or
        when it exists under ``lease`` already: a try that timed out after etcd committed it,
        retried on the next endpoint, is this call's own key (a lease ID is never granted
        twice), not another's. Raises as :meth:`call`; one request."""
        k = b64(key)
        txn = {
            "compare": [{"target": "CREATE", "key": k, "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": b64(value), "lease": str(lease)}}],
            "failure": [{"request_range": {"key": k}}],
        }
        r = await self.call("/v3/kv/txn", txn, timeout=timeout)
        if r.get("succeeded"):
            return True
        for resp in r.get("responses") or []:
            rng = resp.get("response_range") if isinstance(resp, dict) else None
            for kv in (rng or {}).get("kvs") or []:
                if isinstance(kv, dict) and as_int(kv.get("lease")) == lease:
                    return True
        return False

    async def range(self, key: bytes, range_end: bytes | None = None, *,
                    timeout: float | None = None) -> dict[str, Any]:
        """The range answer for ``key`` (up to ``range_end``), linearizable. Raises as
        :meth:`call`; one request, plus O(answer) JSON parsing."""
        body = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        return await self.call("/v3/kv/range", body, timeout=timeout)
