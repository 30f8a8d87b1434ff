"""aiote: awaitable point-to-point transfers for LLM systems (RDMA-style one-sided writes,
immediates, counters and messages over libfabric), under asyncio and trio.

    async with aiote.open_engine(provider="tcp", nics=["lo"]) as engine:
        mr = await engine.register(array)
        await engine.write(mr, remote_descriptor, imm=7)
        await engine.imm_counter(7).wait(1)
"""

from ._core._counter import CREDIT_UNIT, ImmCounter
from ._core._descriptor import EngineAddress, MemoryDescriptor, RailAddress
from ._core._device import GpuUnavailable
from ._core._engine import (
    Engine,
    RailInfo,
    ScatterTarget,
    Transfer,
    TransferBatch,
    default_streams,
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

# isort: split
# the flows last: they import the public names above from this package (aiote.moe does)
from . import (
    kv,  # the KV-cache flow (prefill/decode), built on the core
    moe,  # MoE dispatch/combine: all-to-all over one-sided writes
    weights,  # RL weight updates: trainer ranks push versions into inference ranks
)

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
    "default_streams",
    "kv",
    "moe",
    "open_engine",
    "weights",
]
