"""The ``aiote`` command (``python -m aiote``): ``demo`` runs the KV-cache transfer demo
(prefill and decode processes), ``write-demo`` the two-process 1 GiB write demo, ``info``
reports what libfabric offers here."""

from __future__ import annotations

import argparse
import sys

from . import _benchobs, bench, demo, info, kvdemo

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` and runs the sub-command; returns the exit status."""
    ap = argparse.ArgumentParser(prog="aiote", description="aiote: awaitable transfers over libfabric")
    sub = ap.add_subparsers(dest="command", required=True)
    k = sub.add_parser(
        "demo", help="disaggregated prefill/decode: KV cache layer by layer over tcp loopback, verified"
    )
    kvdemo.add_arguments(k)
    d = sub.add_parser(
        "write-demo", help="two processes, 1 GiB of WriteImm chunks over tcp loopback, verified"
    )
    demo.add_arguments(d)
    i = sub.add_parser(
        "info", help="providers, NICs and capabilities as aiote sees them; what open_engine() picks"
    )
    info.add_arguments(i)
    b = sub.add_parser(
        "bench", help="write, read, send/recv, paged and latency figures beside the C core, same run"
    )
    bench.add_arguments(b)
    args = ap.parse_args(argv)
    if args.command == "bench":
        return _benchobs.main(args) if args.observe and not args.listen else bench.main(args)
    if args.command == "info":
        return info.main(args)
    if args.command == "demo":
        return kvdemo.main(args)
    if args.command == "write-demo":
        return demo.main(args)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
