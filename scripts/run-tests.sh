#!/usr/bin/env bash
# The whole test suite: installs what it needs (scripts/bootstrap.sh), then lint, types,
# the documentation site (mkdocs --strict: a broken link or docstring reference fails it),
# the C core's tests (plain and under ASan/UBSan), and the Python suite (asyncio + trio,
# real processes over libfabric tcp/shm on loopback, network namespaces when root).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export FI_PROVIDER="${FI_PROVIDER:-tcp,ofi_rxm,shm}"
echo "== ruff";            .venv/bin/ruff check aiote tests examples benchmarks
echo "== mypy (strict)";   .venv/bin/mypy
echo "== docs";            site=$(mktemp -d); .venv/bin/mkdocs build --strict -q -d "$site"; rm -rf "$site"
# the two C runs wait on their transports more than they compute: run side by side
logs=$(mktemp -d)
make -s -C cdeps test >"$logs/plain" 2>&1 & plain=$!
make -s -C cdeps asan >"$logs/asan" 2>&1 & asan=$!
rc=0; wait $plain || rc=1; wait $asan || rc=$((rc + 2))
echo "== C core tests";    cat "$logs/plain"
echo "== C core tests under ASan/UBSan"; cat "$logs/asan"
rm -rf "$logs"
[ "$rc" = 0 ] || { echo "C core tests failed (plain: $((rc & 1)), ASan/UBSan: $((rc >> 1 & 1)))"; exit 1; }
echo "== python tests";    .venv/bin/python -m pytest -q "$@"
