"""pytest plugin shipped with aiote (registered through the ``pytest11`` entry point).

Fixtures (async; they run under anyio's pytest plugin with asyncio or trio, and under
pytest-trio):

- ``aiote_engine_pair``: two engines on tcp loopback in this process.
- ``aiote_peer``: a :class:`aiote.testing.PeerProcess`, a peer engine in another process,
  with a local engine to drive it (``aiote_peer.engine``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .._core._engine import Engine
from . import PeerProcess, engine_pair, spawn_peer


@pytest.fixture
async def aiote_engine_pair() -> AsyncIterator[tuple[Engine, Engine]]:
    """Two engines on tcp over loopback, closed after the test."""
    async with engine_pair() as pair:
        yield pair


@pytest.fixture
async def aiote_peer() -> AsyncIterator[PeerProcess]:
    """A peer engine in a separate process (tcp over loopback) and a local engine."""
    async with spawn_peer() as peer:
        yield peer
