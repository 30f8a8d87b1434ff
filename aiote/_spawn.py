"""How aiote starts a Python child (a bench peer, a demo's decoder, a test peer, a weight
worker) that imports the same aiote as this process.

``python -m aiote`` puts the current directory first on ``sys.path``. Run from a source
checkout after ``pip install .``, the child would import the checkout's unbuilt sources
instead of the installed package ("aiote's C core is not built"). So the child runs with
``-P`` (Python 3.11+: no script directory or current directory on ``sys.path``; on 3.10 the
same by a ``-c`` shim), and the directory this process imported aiote from goes first on
its ``PYTHONPATH``, before any ``PYTHONPATH`` it already had.

Imports nothing from aiote: every layer may use it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

# aiote's own parent directory: the sys.path entry this process imported aiote from
_HOME = str(Path(__file__).resolve().parent.parent)

# Python 3.10 has no -P: run the module with the script directory ('' for -c) taken off
# sys.path, as -P does; sys.argv becomes [module's file, *args] as under -m
_RUN_MODULE = (
    "import runpy, sys; del sys.path[0]; del sys.argv[0]; "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def python_module(module: str, *args: str) -> list[str]:
    """The command that runs ``python -m module args...`` with this interpreter, without the
    current directory on the child's ``sys.path`` (pair it with :func:`child_env`)."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", _RUN_MODULE, module, *args]  # pragma: no cover - Python 3.10


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the directory this process imported
    aiote from first on ``PYTHONPATH``, the existing entries after it."""
    out = dict(os.environ if env is None else env)
    rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != _HOME]
    out["PYTHONPATH"] = os.pathsep.join([_HOME, *rest])
    return out
