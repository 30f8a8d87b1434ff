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
echo "== C core tests";    make -s -C cdeps test
echo "== C core tests under ASan/UBSan"; make -s -C cdeps asan
# bytecode written once, so the suite's hundreds of child processes (peers, workers, examples)
# do not each compile aiote again where the environment sets PYTHONDONTWRITEBYTECODE
# (about 0.2 s a process on 2 cores); compileall writes it whatever that variable says
.venv/bin/python -m compileall -q -j 0 aiote tests examples benchmarks >/dev/null
if [ $# -gt 0 ]; then  # arguments: pytest runs as asked, in one process
    echo "== python tests";  .venv/bin/python -m pytest -q --durations=25 "$@"
    exit
fi
# the whole suite: every file but the serial ones in two worker processes (a file stays in
# one worker), then the serial ones alone (tests/conftest.py SERIAL says why each is)
rc=0
echo "== python tests, two workers"
.venv/bin/python -m pytest -q --durations=15 -n 2 --dist loadfile -m "not serial" || rc=$?
echo "== python tests, alone"
.venv/bin/python -m pytest -q --durations=15 -m serial || rc=$?
exit $rc
