"""Shared configuration of aiote's test suite.

Async tests run under anyio's pytest plugin on both asyncio and trio (modules set
``pytestmark = pytest.mark.anyio``); tests/test_pytest_trio.py runs under pytest-trio instead.
The fixtures ``aiote_engine_pair`` and ``aiote_peer`` come from aiote's own pytest plugin
(aiote/testing/_plugin.py, registered through the ``pytest11`` entry point).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# helpers shared by the test modules (tests/_util.py)
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def need_shm() -> None:
    """Skips the test where libfabric's shm provider cannot open an engine here."""
    import aiote

    try:
        async with aiote.open_engine("shm", None):
            pass
    except aiote.ProviderError as exc:
        pytest.skip(f"libfabric's shm provider is not usable here: {exc}")


def pytest_report_header(config: pytest.Config) -> str:
    return f"aiote tests: FI_PROVIDER={os.environ.get('FI_PROVIDER', '<aiote default>')}"
