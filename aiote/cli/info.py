"""``aiote info``: what libfabric offers here as aiote sees it, and what ``open_engine()``
would pick and why."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import aiote
from aiote._core._engine import KNOWN_PROVIDERS, auto_pollers, usable_cores
from aiote._native import ffi, lib

PROVIDERS = KNOWN_PROVIDERS

# libfabric capability and MR-mode bits worth showing (rdma/fabric.h)
_CAPS = {"RMA": 1 << 2, "MSG": 1 << 1, "READ": 1 << 8, "WRITE": 1 << 9, "HMEM": 1 << 47}
_MR_MODE = {
    "LOCAL": 1 << 2,
    "RAW": 1 << 3,
    "VIRT_ADDR": 1 << 4,
    "ALLOCATED": 1 << 5,
    "PROV_KEY": 1 << 6,
    "MMU_NOTIFY": 1 << 7,
    "RMA_EVENT": 1 << 8,
    "ENDPOINT": 1 << 9,
    "HMEM": 1 << 10,
}


def _link_speed(domain: str, reported: int) -> int | None:
    """Bits/s: what the provider reports, else the interface's speed from sysfs."""
    if reported:
        return reported
    try:
        mbps = int(Path(f"/sys/class/net/{domain}/speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return mbps * 1_000_000 if mbps > 0 else None


def probe() -> dict[str, Any]:
    """Everything ``aiote info`` reports, as a dict (the ``--json`` output)."""
    entries = ffi.new("aio_probe_entry[64]")
    providers: list[dict[str, Any]] = []
    for name in PROVIDERS:
        n = int(lib.aio_probe(name.encode(), entries, 64))
        nics: list[dict[str, Any]] = []
        for i in range(max(n, 0)):
            e = entries[i]
            domain = ffi.string(e.domain).decode()
            caps, mr_mode = int(e.caps), int(e.mr_mode)
            nics.append(
                {
                    "domain": domain,
                    "provider": ffi.string(e.provider).decode(),
                    "fabric": ffi.string(e.fabric).decode(),
                    "rma": bool(caps & _CAPS["RMA"]),
                    "remote_cq_data_bytes": int(e.cq_data_size),
                    "hmem": bool(e.hmem),
                    "mr_mode": [k for k, bit in _MR_MODE.items() if mr_mode & bit],
                    "max_msg_size": int(e.max_msg_size),
                    "iov_limit": int(e.iov_limit),
                    "link_speed_bps": _link_speed(domain, int(e.link_speed)),
                }
            )
        providers.append(
            {
                "name": name,
                "available": n > 0,
                "nics": nics,
                "error": None if n >= 0 else f"libfabric error {-n}",
            }
        )
    by = {p["name"]: p for p in providers}
    tcp_lo = any(x["domain"] == "lo" for x in by["tcp"]["nics"])
    same_host = "shm" if by["shm"]["available"] else None
    streams = aiote.default_streams("tcp", ["lo"])
    default = {
        "provider": "tcp",
        "nics": ["lo"],
        "same_host": same_host,
        "usable": tcp_lo,
        # what depends on this host: the cores this process may use decide these
        "cores": usable_cores(),
        "streams": streams,
        "pollers": auto_pollers(streams + (same_host is not None)),
        "copy_threads": aiote.default_copy_threads(),
        "follow_loop": aiote.follow_loop_default(),
        "why": (
            "open_engine() defaults to libfabric's tcp provider (tcp;ofi_rxm) on the loopback "
            "interface, which every Linux machine has; pass nics=[...] for real interfaces, "
            "provider='verbs' or 'efa' for RDMA NICs. "
            + (
                "Peers on this host are reached over shm (same_host='shm'), which is available here."
                if by["shm"]["available"]
                else "shm is not available here: same-host peers use tcp too."
            )
        ),
    }
    fv = int(lib.aio_fabric_version())
    return {
        "aiote": aiote.__version__,
        "libfabric": f"{fv >> 16}.{fv & 0xFFFF}",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "providers": providers,
        "default": default,
    }


def _speed(bps: int | None) -> str:
    if not bps:
        return "-"
    return f"{bps / 1e9:g} Gb/s" if bps >= 1e9 else f"{bps / 1e6:g} Mb/s"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    """Prints the report; exits 1 when the default engine could not open here."""
    info = probe()
    if args.json:
        print(json.dumps(info))
        return 0 if info["default"]["usable"] else 1
    out = sys.stdout
    out.write(f"aiote {info['aiote']}, libfabric {info['libfabric']}, Python {info['python']}\n")
    out.write(f"{info['platform']}\n\n")
    out.write(
        f"{'provider':9} {'NIC (domain)':14} {'fabric':18} {'RMA':4} {'CQ data':8} {'HMEM':5} "
        f"{'max msg':>10} {'link':>10}  MR mode\n"
    )
    for p in info["providers"]:
        if not p["nics"]:
            out.write(f"{p['name']:9} {'(not available here)':14}\n")
        for n in p["nics"]:
            mm = "2^64-1" if n["max_msg_size"] >= 2**64 - 1 else str(n["max_msg_size"])
            out.write(
                f"{p['name']:9} {n['domain']:14} {n['fabric'][:18]:18} {'yes' if n['rma'] else 'no':4} "
                f"{str(n['remote_cq_data_bytes']) + ' B':8} {'yes' if n['hmem'] else 'no':5} {mm:>10} "
                f"{_speed(n['link_speed_bps']):>10}  {','.join(n['mr_mode'])}\n"
            )
    d = info["default"]
    out.write(
        f"\nopen_engine() picks: provider={d['provider']!r}, nics={d['nics']}, same_host={d['same_host']!r}\n"
    )
    out.write(
        f"on this host ({d['cores']} usable cores): streams={d['streams']}, pollers={d['pollers']}, "
        f"copy_threads={d['copy_threads']}, follow_loop={d['follow_loop']}\n"
    )
    out.write(f"why: {d['why']}\n")
    return 0 if d["usable"] else 1
