#!/usr/bin/env bash
# The demo: two processes, 1 GiB written as WriteImm chunks over libfabric tcp on loopback,
# every byte verified at the receiver. Installs what it needs first (scripts/bootstrap.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/aiote demo "$@"
