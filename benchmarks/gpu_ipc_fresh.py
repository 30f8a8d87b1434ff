"""Does a copy into memory another process exported through CUDA IPC slow down after the
source was written? The open question of docs/weights.md (one trainer GPU -> one inference
GPU): copies inside an aiote push run at 260-330 GB/s after the sender wrote its shards, while
a one-process ``cudaMemcpyPeerAsync`` into a peer allocation does not slow down at all.

    python benchmarks/gpu_ipc_fresh.py [--gb 2.18] [--repeats 5]

GPU 0 -> GPU 1, one ``cudaMemcpyPeerAsync`` of ``--gb`` GB timed with CUDA events, medians of
``--repeats``, in four cases, each fresh (the source rewritten by a fill kernel right before)
and warm (the same copy again): into a peer allocation of this process; into an allocation of
a child process on GPU 1 opened here through CUDA IPC (as aiote's IPC rail writes); both again
with the source exported through CUDA IPC too (as ``engine.register`` exports it). Two more
destinations, each skipped with an error line where a CUDA VMM step fails: an allocation of this
process made with ``cuMemCreate`` (no IPC), and one a child process made with ``cuMemCreate``
and exported as a POSIX file descriptor, fetched here with ``pidfd_getfd`` (SCM_RIGHTS where that
fails), imported with ``cuMemImportFromShareableHandle`` and mapped for GPUs 0 and 1 (issue 36).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import socket
import statistics
import subprocess
import sys
from typing import Any

STATES = ("fresh", "warm")


def child(nbytes: int) -> None:
    """On GPU 1: allocate, print the IPC handle in hex, keep it until stdin closes."""
    import cupy

    with cupy.cuda.Device(1):
        buf = cupy.zeros(nbytes, cupy.uint8)
        print(bytes(cupy.cuda.runtime.ipcGetMemHandle(buf.data.ptr)).hex(), flush=True)
        sys.stdin.read()


def _driver() -> Any:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        from cuda import cuda as cu  # older cuda-python
    return cu


def _ok(cu: Any, what: str, res: Any) -> Any:
    """The value(s) after a driver call's CUresult; raise with the error's name."""
    err, *rest = res
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


def vmm_create(cu: Any, dev: int, nbytes: int, shareable: bool) -> tuple[Any, int]:
    """cuMemCreate on ``dev`` of ``nbytes`` rounded up to the recommended granularity."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = dev
    if shareable:
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    gran = int(_ok(cu, "cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(prop, flag)))
    size = -(-nbytes // gran) * gran
    return _ok(cu, "cuMemCreate", cu.cuMemCreate(size, prop, 0)), size


def vmm_map(cu: Any, handle: Any, size: int, stack: contextlib.ExitStack) -> int:
    """Reserve, map and open ``handle`` to GPUs 0 and 1; undone when ``stack`` closes."""
    ptr = _ok(cu, "cuMemAddressReserve", cu.cuMemAddressReserve(size, 0, 0, 0))
    stack.callback(lambda: _ok(cu, "cuMemAddressFree", cu.cuMemAddressFree(ptr, size)))
    _ok(cu, "cuMemMap", cu.cuMemMap(ptr, size, 0, handle, 0))
    stack.callback(lambda: _ok(cu, "cuMemUnmap", cu.cuMemUnmap(ptr, size)))
    descs = []
    for d in (0, 1):
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = d
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(desc)
    _ok(cu, "cuMemSetAccess", cu.cuMemSetAccess(ptr, size, descs, len(descs)))
    return int(ptr)


def child_vmm(nbytes: int, sock_fd: int) -> None:
    """On GPU 1: cuMemCreate, export as a POSIX fd, print "pid fd size" (or "error ..."), send the
    fd over ``sock_fd`` too (the parent's fallback), keep it until stdin closes."""
    import cupy

    sock = socket.socket(fileno=sock_fd)
    with cupy.cuda.Device(1):
        cupy.zeros(1)  # the primary context of GPU 1, current
        try:
            cu = _driver()
            handle, size = vmm_create(cu, 1, nbytes, shareable=True)
            kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            fd = int(
                _ok(cu, "cuMemExportToShareableHandle", cu.cuMemExportToShareableHandle(handle, kind, 0))
            )
        except Exception as e:  # reported to the parent
            print(f"error {type(e).__name__}: {e}", flush=True)
            sys.stdin.read()
            return
        print(f"{os.getpid()} {fd} {size}", flush=True)
        with contextlib.suppress(OSError):
            socket.send_fds(sock, [b"f"], [fd])
        sys.stdin.read()
        os.close(fd)
        _ok(cu, "cuMemRelease", cu.cuMemRelease(handle))


def grab_fd(pid: int, fd: int, sock: socket.socket) -> tuple[int, str]:
    """A copy of the child's ``fd`` here: pidfd_getfd, else the one it sent over ``sock``."""
    try:
        pidfd = os.pidfd_open(pid)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            got = int(libc.syscall(438, pidfd, fd, 0))  # SYS_pidfd_getfd
            if got < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            return got, "pidfd_getfd"
        finally:
            os.close(pidfd)
    except (OSError, AttributeError) as e:
        print(f"pidfd_getfd failed ({e}); taking the fd over SCM_RIGHTS", flush=True)
        _, fds, _, _ = socket.recv_fds(sock, 16, 1)
        return fds[0], "SCM_RIGHTS"


def vmm_import(cu: Any, fd: int) -> Any:
    """cuMemImportFromShareableHandle of a POSIX fd, passed as an int, else as a c_void_p."""
    kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    errors = []
    for how, arg in (("int", fd), ("ctypes.c_void_p", ctypes.c_void_p(fd))):
        try:
            handle = _ok(cu, "cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(arg, kind))
        except (RuntimeError, TypeError, ValueError) as e:
            errors.append(f"{how}: {e}")
            continue
        print(f"cuMemImportFromShareableHandle took the fd as {how}", flush=True)
        return handle
    raise RuntimeError("; ".join(errors))


def setup_vmm(cu: Any, nbytes: int, stack: contextlib.ExitStack) -> tuple[int | None, int | None]:
    """Pointers to this process's VMM allocation and to a child's, None where a step failed."""
    own = other = None
    try:
        handle, size = vmm_create(cu, 1, nbytes, shareable=False)
        stack.callback(lambda h=handle: _ok(cu, "cuMemRelease", cu.cuMemRelease(h)))
        own = vmm_map(cu, handle, size, stack)
    except Exception as e:  # the other cases go on
        print(f"this process's VMM allocation: skipped, {type(e).__name__}: {e}", flush=True)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stack.callback(mine.close)
    cmd = [sys.executable, __file__, "--child-vmm", str(nbytes), "--sock", str(theirs.fileno())]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=[theirs.fileno()]
    )
    theirs.close()
    assert proc.stdout is not None and proc.stdin is not None
    stack.callback(proc.wait, timeout=60)
    stack.callback(proc.stdin.close)
    try:
        line = proc.stdout.readline().strip()
        if not line or line.startswith("error"):
            raise RuntimeError(f"child: {line or 'no answer'}")
        pid, child_fd, size = (int(x) for x in line.split())
        fd, how = grab_fd(pid, child_fd, mine)
        print(f"VMM fd {child_fd} of pid {pid} -> fd {fd} here by {how}", flush=True)
        try:
            handle = vmm_import(cu, fd)
        finally:
            os.close(fd)
        stack.callback(lambda h=handle: _ok(cu, "cuMemRelease", cu.cuMemRelease(h)))
        other = vmm_map(cu, handle, size, stack)
    except Exception as e:  # the other cases go on
        print(f"another process's VMM allocation (fd): skipped, {type(e).__name__}: {e}", flush=True)
    return own, other


def timed(cupy: Any, src: Any, dst_ptr: int, nbytes: int, repeats: int, fresh: bool) -> float:
    """GB/s of the median copy (after one warm-up)."""
    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    gbps = []
    for i in range(repeats + 1):
        if fresh:
            src.fill(i % 200)
            cupy.cuda.Device(0).synchronize()
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        rt.memcpyPeerAsync(dst_ptr, 1, src.data.ptr, 0, nbytes, stream.ptr)
        b.record(stream)
        b.synchronize()
        gbps.append(nbytes / (cupy.cuda.get_elapsed_time(a, b) / 1e3) / 1e9)
    return float(statistics.median_low(gbps[1:]))


def main(a: argparse.Namespace) -> None:
    import cupy

    nbytes = int(a.gb * 1e9) // 4096 * 4096
    rt = cupy.cuda.runtime
    for d, o in ((0, 1), (1, 0)):
        with cupy.cuda.Device(d), contextlib.suppress(rt.CUDARuntimeError):  # already enabled
            rt.deviceEnablePeerAccess(o)
    with cupy.cuda.Device(1):
        own = cupy.zeros(nbytes, cupy.uint8)
    cmd = [sys.executable, __file__, "--child", str(nbytes)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    handle = bytes.fromhex(proc.stdout.readline().strip())
    try:
        with cupy.cuda.Device(0), contextlib.ExitStack() as stack:
            ipc = int(rt.ipcOpenMemHandle(handle, 1))  # cudaIpcMemLazyEnablePeerAccess
            src = cupy.ones(nbytes, cupy.uint8)
            vmm_own = vmm_other = None
            try:
                vmm_own, vmm_other = setup_vmm(_driver(), nbytes, stack)
            except Exception as e:  # e.g. no cuda-bindings; the other cases go on
                print(f"VMM cases: skipped, {type(e).__name__}: {e}", flush=True)
            dests = [("this process's peer allocation", own.data.ptr), ("IPC-opened", ipc)]
            dests += [("this process's VMM allocation", vmm_own)] if vmm_own is not None else []
            dests += [("another process's VMM allocation (fd)", vmm_other)] if vmm_other is not None else []
            for exported in (False, True):
                if exported:
                    rt.ipcGetMemHandle(src.data.ptr)
                for where, ptr in dests:
                    got = {st: timed(cupy, src, ptr, nbytes, a.repeats, st == "fresh") for st in STATES}
                    how = "exported" if exported else "not exported"
                    print(
                        f"{nbytes / 1e9:.2f} GB into {where}, source {how}: "
                        f"fresh {got['fresh']:.1f} GB/s, warm {got['warm']:.1f} GB/s",
                        flush=True,
                    )
            rt.ipcCloseMemHandle(ipc)
            cupy.cuda.Device(0).synchronize()
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.18)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-vmm", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sock", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
    elif args.child_vmm is not None:
        child_vmm(args.child_vmm, args.sock)
    else:
        main(args)
