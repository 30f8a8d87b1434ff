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


# Files run alone (``-m serial``) by scripts/run-tests.sh, after the rest has run in two worker
# processes (pytest-xdist, ``-m "not serial"``): what they assert depends on the machine being
# otherwise quiet (CPU shares and sleeps of idle engines, latency, failure detection within a
# bound, other processes' CPU, wheel builds), or they use what a second test process would share
# (network namespaces on fixed subnets, every TCP socket of the host, /dev/shm's sweep).
SERIAL = {
    "test_containers",  # a /dev/shm and PID namespace of their own (unshare), heavy
    "test_examples",  # aiote bench's CPU accounting of other processes; a namespace (10.217/16)
    "test_idle",  # CPU shares and poller sleeps of idle engines
    "test_lowlatency",  # spinning and latency
    "test_membership_hosts",  # namespaces (10.218/16) and etcd in them
    "test_netns",  # namespaces (10.213/16), failover timings
    "test_owns",  # /dev/shm's files of dead processes, which any engine's first endpoint sweeps
    "test_packaging",  # wheel and C builds
    "test_pollers",  # poller threads' sleeps and wake-ups
    "test_resilience",  # failure detection within a bound; a namespace (10.214/16)
    "test_tcp_buffers",  # every TCP socket of the host (/proc/net/tcp)
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ in SERIAL:
            item.add_marker(pytest.mark.serial)


def pytest_report_header(config: pytest.Config) -> str:
    return f"aiote tests: FI_PROVIDER={os.environ.get('FI_PROVIDER', '<aiote default>')}"
