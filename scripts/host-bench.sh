#!/usr/bin/env bash
# `aiote bench` on a machine without network (the GPU hosts of the device tool), from the
# carried folders .whl/ and .deb/ (see scripts/_carried-env.sh and docs/gpu.md): builds the
# extension, then runs `aiote bench` with the given arguments (the C core is built by it).
#
#   scripts/host-bench.sh write --sizes 64KiB,1MiB,16MiB --repeats 9 --json "$OUT/bench.json"
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/_carried-env.sh
echo "# $(date -u +%FT%TZ) $(uname -srm), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
"$PY" setup.py -q build_ext --inplace >/tmp/aiote-build.txt 2>&1 || { tail -30 /tmp/aiote-build.txt; exit 1; }
"$PY" -m aiote bench "$@"
