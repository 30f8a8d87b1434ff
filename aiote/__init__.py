"""aiote: awaitable point-to-point transfers for LLM systems (RDMA-style one-sided writes,
immediates, counters and messages over libfabric), under asyncio and trio.

    async with aiote.open_engine(provider="tcp", nics=["lo"]) as engine:
        mr = await engine.register(array)
        await engine.write(mr, remote_descriptor, imm=7)
        await engine.imm_counter(7).wait(1)
"""

import importlib
from typing import TYPE_CHECKING, Any

from ._core._counter import CREDIT_UNIT, ImmCounter
from ._core._descriptor import EngineAddress, MemoryDescriptor, RailAddress
from ._core._device import GpuUnavailable
from ._core._engine import (
    Engine,
    RailInfo,
    ScatterTarget,
    Transfer,
    TransferBatch,
    default_copy_threads,
    default_streams,
    follow_loop_default,
    open_engine,
)
from ._core._errors import (
    AioteError,
    DescriptorError,
    EngineClosed,
    InvalidArgument,
    PeerUnreachable,
    ProviderError,
    RegionBusy,
    RegistrationError,
    RemoteAccessError,
    TransferError,
    TransferStalled,
    TransferTimeout,
)
from ._core._gpu import UvmWatcher
from ._core._memory import MemoryRegion
from ._core._observe import Observability, Observer
from ._core._options import GpuOptions, PollerOptions, SameHostOptions, TransportOptions
from ._core._retry import RetryPolicy
from ._core._routing import DomainGroup, Route

# the flows: the KV-cache flow (prefill/decode), MoE dispatch/combine, RL weight updates. They
# import the public names above from this package, and are imported on first use (``aiote.kv``
# or ``import aiote.kv``), so that ``import aiote`` costs only the core
_FLOWS = ("kv", "moe", "weights")

if TYPE_CHECKING:
    from . import kv, moe, weights


def __getattr__(name: str) -> Any:
    """``aiote.kv``, ``aiote.moe`` and ``aiote.weights``, imported on first access."""
    if name in _FLOWS:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FLOWS))

__version__ = "0.1.0"

__all__ = [
    "CREDIT_UNIT",
    "AioteError",
    "DescriptorError",
    "DomainGroup",
    "Engine",
    "EngineAddress",
    "EngineClosed",
    "GpuOptions",
    "GpuUnavailable",
    "ImmCounter",
    "InvalidArgument",
    "MemoryDescriptor",
    "MemoryRegion",
    "Observability",
    "Observer",
    "PeerUnreachable",
    "PollerOptions",
    "ProviderError",
    "RailAddress",
    "RailInfo",
    "RegionBusy",
    "RegistrationError",
    "RemoteAccessError",
    "RetryPolicy",
    "Route",
    "SameHostOptions",
    "ScatterTarget",
    "Transfer",
    "TransferBatch",
    "TransferError",
    "TransferStalled",
    "TransferTimeout",
    "TransportOptions",
    "UvmWatcher",
    "default_copy_threads",
    "default_streams",
    "follow_loop_default",
    "kv",
    "moe",
    "open_engine",
    "weights",
]
