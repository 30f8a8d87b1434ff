"""cffi (API mode) build of the C core in ``cdeps/`` against the system libfabric.

Run by the package build (``cffi_modules`` in ``setup.py``). Fails early, naming the
missing Debian package, when libfabric's development files are not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from cffi import FFI

ROOT = Path(__file__).resolve().parents[2]
CDEPS = ROOT / "cdeps"
HEADER = CDEPS / "aiote_core.h"  # the API: the only header the binding sees
# the core, one file per concern (cdeps/core/internal.h lists them); each .c finds its internal
# headers beside it
SOURCES = sorted((CDEPS / "core").glob("*.c"))
INTERNAL_HEADERS = sorted((CDEPS / "core").glob("*.h"))


def _load_fabric_paths() -> Any:
    """``_fabric_paths.py`` beside this file, loaded by its path: cffi runs this file as a
    script, outside the package."""
    here = Path(__file__).with_name("_fabric_paths.py")
    spec = importlib.util.spec_from_file_location("_aiote_fabric_paths", here)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
_inc, _libdirs = _load_fabric_paths().libfabric_dirs()
_extra = ["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-O2"]
if os.environ.get("AIOTE_SANITIZE"):
    _extra += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]
ffibuilder.set_source(
    "aiote._native._core",
    '#include "aiote_core.h"',
    # setuptools wants paths relative to setup.py
    sources=[os.path.relpath(p, Path.cwd()) for p in SOURCES],
    depends=[os.path.relpath(p, Path.cwd()) for p in [HEADER, *INTERNAL_HEADERS]],
    include_dirs=[os.path.relpath(CDEPS, Path.cwd()), *_inc],
    library_dirs=_libdirs,
    libraries=["fabric", "pthread"],
    extra_compile_args=_extra,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
