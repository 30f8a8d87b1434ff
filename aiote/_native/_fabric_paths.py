"""Where libfabric's headers and libraries are: used by the extension's build
(``_build.py``, which loads this file by its path) and by ``aiote bench``'s build of the C
baseline. Plain standard library, no side effects on import."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["libfabric_dirs"]


def libfabric_dirs() -> tuple[list[str], list[str]]:
    """libfabric's include and library directories (empty lists: the compiler's defaults).

    ``AIOTE_FABRIC_PREFIX``: a libfabric installed (or unpacked) under that prefix; else
    pkg-config; else the usual include directories. Raises RuntimeError, naming the package to
    install, when none has ``rdma/fabric.h``. Costs up to two pkg-config runs."""
    prefix = os.environ.get("AIOTE_FABRIC_PREFIX")
    if prefix:
        cands = (Path(prefix) / "lib", Path(prefix) / "lib64", Path(prefix) / "lib" / "x86_64-linux-gnu")
        return [str(Path(prefix) / "include")], [str(p) for p in cands if p.exists()]
    if shutil.which("pkg-config"):
        try:
            cflags = subprocess.run(
                ["pkg-config", "--cflags-only-I", "libfabric"], check=True, capture_output=True, text=True,
                timeout=30,
            ).stdout.split()
            libs = subprocess.run(
                ["pkg-config", "--libs-only-L", "libfabric"], check=True, capture_output=True, text=True,
                timeout=30,
            ).stdout.split()
            return [f[2:] for f in cflags], [f[2:] for f in libs]
        except (OSError, subprocess.SubprocessError):
            pass
    for inc in ("/usr/include", "/usr/local/include", "/opt/amazon/efa/include"):
        if (Path(inc) / "rdma" / "fabric.h").exists():
            return [inc], []
    raise RuntimeError(
        "aiote needs libfabric's development files to build its C core, and none were found "
        "(no rdma/fabric.h, no libfabric.pc). On Debian/Ubuntu: apt-get install libfabric-dev; "
        "on Fedora/RHEL: dnf install libfabric-devel."
    )
