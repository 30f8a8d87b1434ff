#!/usr/bin/env bash
# Installs what aiote needs on a Debian/Ubuntu machine that has only Python:
# libfabric's development files, a C compiler, etcd and Prometheus (apt, when missing; the
# membership and observability tests start their own servers), a virtualenv in .venv, and the
# package with its test, bench and docs extras. Idempotent; prints what it does.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
need_apt=()
[ -e /usr/include/rdma/fabric.h ] || need_apt+=(libfabric-dev)
command -v fi_info >/dev/null 2>&1 || need_apt+=(libfabric-bin)
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
# tests/test_observe.py scrapes a demo with a real Prometheus (its own port and data; the
# package's system service, where it starts one, is not used)
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -e "$inc/Python.h" ] || need_apt+=(python3-dev)
"$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)

if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${need_apt[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "bootstrap: need root (or sudo) to apt-get install ${need_apt[*]}" >&2; exit 1; }
    SUDO=sudo
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
  # the package enables a system etcd on localhost:2379 where systemd runs; the tests start
  # their own on free ports, so the one we installed is stopped and left disabled
  if [[ " ${need_apt[*]} " == *" etcd-server "* ]] && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
echo "bootstrap: installing aiote[test,bench,docs] into .venv (builds the C core)"
.venv/bin/python -m pip install -q -e ".[test,bench,docs]"
