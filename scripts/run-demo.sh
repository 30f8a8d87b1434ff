#!/usr/bin/env bash
# The demo: disaggregated prefill/decode. One prefill and two decode processes over libfabric
# tcp on loopback; 64 requests' KV caches streamed layer by layer as paged writes; a decoder
# leaves and a new one joins halfway; every page verified. Installs what it needs first
# (scripts/bootstrap.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/aiote demo "$@"
