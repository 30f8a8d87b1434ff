"""cffi (API mode) build of the C core in ``cdeps/`` against the system libfabric.

Run by the package build (``cffi_modules`` in ``setup.py``). Fails early, naming the
missing Debian package, when libfabric's development files are not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parents[2]
CDEPS = ROOT / "cdeps"
HEADER = CDEPS / "aiote_core.h"


def _libfabric_flags() -> tuple[list[str], list[str]]:
    """Include and library dirs for libfabric, or a clear error if it is missing.
    ``AIOTE_FABRIC_PREFIX``: a libfabric installed (or unpacked) under that prefix."""
    prefix = os.environ.get("AIOTE_FABRIC_PREFIX")
    if prefix:
        cands = (Path(prefix) / "lib", Path(prefix) / "lib" / "x86_64-linux-gnu")
        libs = [str(p) for p in cands if p.exists()]
        return [str(Path(prefix) / "include")], libs
    if shutil.which("pkg-config"):
        try:
            cflags = subprocess.run(
                ["pkg-config", "--cflags-only-I", "libfabric"], check=True, capture_output=True, text=True
            ).stdout.split()
            libs = subprocess.run(
                ["pkg-config", "--libs-only-L", "libfabric"], check=True, capture_output=True, text=True
            ).stdout.split()
            return [f[2:] for f in cflags], [f[2:] for f in libs]
        except subprocess.CalledProcessError:
            pass
    for inc in ("/usr/include", "/usr/local/include", "/opt/amazon/efa/include"):
        if (Path(inc) / "rdma" / "fabric.h").exists():
            return [inc], []
    raise RuntimeError(
        "aiote needs libfabric's development files to build its C core, and none were found "
        "(no rdma/fabric.h, no libfabric.pc). On Debian/Ubuntu: apt-get install libfabric-dev; "
        "on Fedora/RHEL: dnf install libfabric-devel."
    )


def _cdef_from_header(text: str) -> str:
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#define"):
            parts = s.split()
            if len(parts) >= 3 and re.fullmatch(r"[A-Z0-9_]+", parts[1]):
                out.append(f"#define {parts[1]} ...")
            continue
        if s.startswith("#") or s.startswith('extern "C"') or s == "}":
            continue
        out.append(line)
    return "\n".join(out)


ffibuilder = FFI()
ffibuilder.cdef(_cdef_from_header(HEADER.read_text()))
_inc, _libdirs = _libfabric_flags()
_extra = ["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-O2"]
if os.environ.get("AIOTE_SANITIZE"):
    _extra += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]
ffibuilder.set_source(
    "aiote._native._core",
    '#include "aiote_core.h"',
    # setuptools wants paths relative to setup.py
    sources=[os.path.relpath(CDEPS / "aiote_core.c", Path.cwd())],
    include_dirs=[os.path.relpath(CDEPS, Path.cwd()), *_inc],
    library_dirs=_libdirs,
    libraries=["fabric", "pthread"],
    extra_compile_args=_extra,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
