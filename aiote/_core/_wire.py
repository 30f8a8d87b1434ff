"""Native constants the hot paths read as plain ints, the aio_op_desc row layout, and how
libfabric error codes become aiote's exceptions."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .._native import ffi, lib
from ._descriptor import EngineAddress
from ._errors import AioteError, InvalidArgument, PeerUnreachable, RemoteAccessError, TransferError

_U32 = 1 << 32
_CREDIT = int(lib.AIO_CREDIT_UNIT)
_SPILL_BYTES = 1 << 20  # see Engine._held: queued copies of messages that were not held
_CREDIT_MSG = struct.Struct("<BQIQ")  # internal credit message: kind, sequence number, imm, units
_K_CREDIT = 2  # (kind 1: a GPU staging part, aiote/_core/_gpu.py)
_K_CREDIT_BYTE = bytes([_K_CREDIT])
_CREDITS_SEEN_MAX = 1 << 16  # credit messages remembered for de-duplication
# deferred credits of multi-route operations: (path, imm, owner's address) -> logical writes
_Credits = dict[tuple[Any, int, EngineAddress], int]
# the sender's address length; the top bit marks internal messages, the next one a combined
# message (several messages of one connection's senders: see _coalesce.py)
_MSG_HEADER = struct.Struct("<H")
_INTERNAL = 0x8000
_PACKED = 0x4000
_ADDR_LEN = 0x3FFF
_GPU_COUNTS = ("gpu_ipc", "gpu_staged", "gpu_direct", "gpu_parts_in", "gpu_lane_credits", "gpu_ipc_imm")

# libfabric error numbers (rdma/fi_errno.h)
_FI_EINVAL = 22
_FI_EMSGSIZE = 90
_PEER_ERRORS = {
    111: "connection refused",  # ECONNREFUSED
    104: "connection reset",  # ECONNRESET
    113: "host unreachable",  # EHOSTUNREACH
    103: "connection aborted",  # ECONNABORTED
    107: "not connected",  # ENOTCONN
    110: "timed out",  # ETIMEDOUT
    32: "broken pipe",  # EPIPE
    112: "host down",  # EHOSTDOWN
    101: "network unreachable",  # ENETUNREACH
    100: "network down",  # ENETDOWN
}
# EPERM, EACCES, EFAULT, EREMOTEIO, EKEYREJECTED, FI_ENOKEY: the peer refused the access
_ACCESS_ERRORS = {1, 13, 14, 121, 129, 266}
_FI_ETRUNC = 265
_FI_EBUSY = 16
_NO_DIRECT = (0, 0)
_ELSEWHERE = bytes(16)  # a host id no engine has: routes a same-host peer as a remote one (_host_of)
_DIRECT_SLOTS = int(lib.AIO_DIRECT_SLOTS)
_FI_ECANCELED = 125
_ENOENT = 2
_PEER_GONE = int(lib.AIO_EPEERGONE)  # the core refused a request: its same-host peer is gone


def _strerror(code: int) -> str:
    text: bytes = ffi.string(lib.aio_strerror(code))
    return text.decode(errors="replace")


def _peer_gone(msg: str, code: int) -> PeerUnreachable:
    """The core refused a request to a same-host peer whose process is gone
    (``-AIO_EPEERGONE``, see cdeps' ``aio__shm_peer_gone``): final, never posted again."""
    exc = PeerUnreachable(msg, code, 0)
    exc._final = True  # type: ignore[attr-defined]  # not posted again
    return exc


def _completion_error(status: int, prov_errno: int, what: str) -> TransferError:
    code = -status
    if code == _PEER_GONE:  # refused by the core before posting (its same-host peer is gone)
        return _peer_gone(f"{what} failed: the same-host peer's process is gone; not posted", code)
    msg = f"{what} failed: {_strerror(code)} (libfabric error {code}, provider error {prov_errno})"
    if code in _PEER_ERRORS or (code == _FI_ECANCELED and prov_errno in _PEER_ERRORS):
        # tcp cancels what was in flight on a connection that broke (provider error: why)
        return PeerUnreachable(msg + "; the peer is gone or not listening", code, prov_errno)
    if code in _ACCESS_ERRORS:
        return RemoteAccessError(msg + "; check the descriptor's key and bounds", code, prov_errno)
    if code == _FI_ECANCELED and prov_errno == _ENOENT:
        # tcp's target closes the connection on a request it refuses (unknown key, range past
        # the region, no access right), and tcp cancels what was in flight on it; its provider
        # error is the errno its thread last saw (ENOENT here: likely from taking the socket out
        # of its poll set). A peer that died with nothing unread in its socket closes the connection
        # the same way: an awaited operation tells them apart by posting once more
        # (Retries._retry_after)
        exc = RemoteAccessError(
            msg + "; check the descriptor's key and bounds (or the peer closed the connection)",
            code, prov_errno,
        )
        exc._closed_by_peer = True  # type: ignore[attr-defined]
        return exc
    if code == _FI_ETRUNC:
        return TransferError(msg + "; the receiver's buffer was too small", code, prov_errno)
    return TransferError(msg, code, prov_errno)


# numpy view of aio_op_desc, for building batches without per-field cffi calls
_OP_DTYPE = np.dtype(
    [
        ("mr", "<u8"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("peer", "<u8"),
        ("raddr", "<u8"),
        ("rkey", "<u8"),
        ("data", "<u8"),
        ("rail", "<i4"),
        ("op", "<i4"),
        ("flags", "<i4"),
        ("direct", "<i4"),
    ]
)
assert _OP_DTYPE.itemsize == ffi.sizeof("aio_op_desc")
_OP_STRUCT = struct.Struct("<QQQQQQQiiii")  # one row of _OP_DTYPE
_REC_GROUP = int(lib.AIO_REC_GROUP)  # native constants on hot paths, as plain module ints
_OP_WRITE = int(lib.AIO_OP_WRITE)
_OP_READ = int(lib.AIO_OP_READ)
_F_DATA = int(lib.AIO_F_DATA)
_REC_COUNTER = int(lib.AIO_REC_COUNTER)
assert _OP_STRUCT.size == _OP_DTYPE.itemsize


def _post_error(code: int, what: str, posted: int) -> AioteError:
    c = -code
    tail = f" ({posted} requests of it were posted and completed first)" if posted else ""
    if c == _FI_EMSGSIZE:
        return InvalidArgument(f"{what}: message too large for the transport{tail}")
    if c == _FI_EINVAL:
        return InvalidArgument(f"{what}: the transport rejected the request as invalid{tail}")
    if c == _PEER_GONE:
        return _peer_gone(f"{what}: the same-host peer's process is gone; nothing was posted to it{tail}", c)
    if c in _PEER_ERRORS:
        return PeerUnreachable(f"{what}: {_strerror(c)}{tail}", c, 0)
    if c in _ACCESS_ERRORS:  # a same-host peer's table refused it before anything was posted
        return RemoteAccessError(f"{what}: {_strerror(c)}: check the descriptor's key and bounds{tail}", c, 0)
    return TransferError(f"{what}: posting failed: {_strerror(c)}{tail}", c, 0)
