#!/usr/bin/env bash
# Creates (or completes) .venv-peers, the virtualenv for benchmarks/peers/: NIXL, Mooncake
# Transfer Engine, UCXX and torch (gloo). Idempotent: re-running installs only what is missing.
# Takes minutes (torch and the UCX/NIXL wheels are large). Never run by CI.
#
#   scripts/setup-peers.sh            # .venv-peers in the repository root
#   PEERS_VENV=/elsewhere scripts/setup-peers.sh
#   TORCH_WHEEL=/path/torch-2.13.0+cpu-....whl scripts/setup-peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PEERS_VENV:-.venv-peers}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

# nixl-cu12 depends on torch: install torch 2.13.0 first, the CPU build when a local wheel is there
# (the default PyPI torch wheel pulls the CUDA libraries, gigabytes on a host without a GPU).
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    wheel=${TORCH_WHEEL:-}
    if [ -z "$wheel" ]; then
        wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1 || true)
    fi
    if [ -n "$wheel" ]; then
        "${PIP[@]}" "$wheel"
    else
        "${PIP[@]}" torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    fi
fi

"${PIP[@]}" nixl-cu12==1.5.1 mooncake-transfer-engine-non-cuda ucxx-cu12 numpy

"$VENV/bin/python" - <<'PY'
import importlib
for mod in ("nixl_cu12", "mooncake.engine", "ucxx", "torch.distributed"):
    try:
        importlib.import_module(mod)
        print(f"ok       {mod}")
    except Exception as e:  # noqa: BLE001 - report, don't fail: the benches skip what is missing
        print(f"missing  {mod}: {e}")
PY
echo "peers venv ready: $VENV/bin/python benchmarks/peers/run.py"
