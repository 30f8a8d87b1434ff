"""The ``aiote`` command (``python -m aiote``): ``demo`` runs the two-process transfer demo."""

from __future__ import annotations

import argparse
import sys

from . import demo

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` and runs the sub-command; returns the exit status."""
    ap = argparse.ArgumentParser(prog="aiote", description="aiote: awaitable transfers over libfabric")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="two processes, 1 GiB of WriteImm chunks over tcp loopback, verified")
    demo.add_arguments(d)
    args = ap.parse_args(argv)
    if args.command == "demo":
        return demo.main(args)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
