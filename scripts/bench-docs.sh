#!/usr/bin/env bash
# Regenerates the benchmark figures of docs/benchmarks.md in one command:
#   aiote bench all (tcp and shm, Python beside the C core, same run, 5 repeats) -> docs/bench.json, docs/bench.png
#   aiote bench write,read --arena (shm, Engine.alloc_host buffers)    -> docs/bench-arena.json
#   aiote bench write --sizes 1MiB --repeats 40 (the target case alone)  -> docs/bench-target.json
#   aiote bench imm-latency --low-latency (the same, low-latency setting) -> docs/bench-lowlat.json
#   benchmarks/peers/run.py (peer libraries), when it exists          -> docs/peers.json
#     in 5 rounds: each round runs aiote (write, imm-latency, both settings) and every peer once,
#     and aiote is compared with the peers round by round (the machine's speed drifts over minutes)
#   benchmarks/render_docs.py rewrites the section between <!-- bench:begin --> and <!-- bench:end -->.
# Extra arguments go to `aiote bench` and override the defaults below, e.g. a smoke run:
#   scripts/bench-docs.sh --repeats 1 --total 64MiB --iters 200
# Run it on a quiet machine: `aiote bench` warns when other processes kept the CPU busy.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
"$PY" -m aiote bench all --provider tcp,shm --sizes 4KiB,64KiB,1MiB,16MiB --repeats 5 \
    --json docs/bench.json --plot docs/bench.png "$@"
# same-host writes and reads between buffers of the engines' host arenas (Engine.alloc_host)
"$PY" -m aiote bench write,read --arena --provider shm --sizes 64KiB,1MiB,16MiB --repeats 3 \
    --json docs/bench-arena.json "$@"
# the target case of the issue (tcp writes of 1 MiB against the C core) alone, with enough
# paired repeats to resolve a few percent: the median ratio's 90% confidence interval
# (ratio_ci90) spans about +-0.03 at 40 repeats on a 2-vCPU VM whose repeats range 0.7-1.3
"$PY" -m aiote bench write --provider tcp --sizes 1MiB --repeats "${TARGET_REPEATS:-40}" \
    --json docs/bench-target.json "$@"
# the WriteImm ping-pong again in the documented low-latency setting (both sides)
"$PY" -m aiote bench imm-latency --low-latency --provider tcp,shm --repeats 3 \
    --json docs/bench-lowlat.json "$@"
peers=()
if [ -f benchmarks/peers/run.py ]; then
    rm -f docs/peers.json
    if "$PY" benchmarks/peers/run.py --rounds "${PEER_ROUNDS:-5}" --run-aiote "$PY" --json docs/peers.json; then
        peers=(--peers docs/peers.json)
        rm -f docs/peers.aiote-*.json  # the last round's aiote JSON, kept beside it by run.py
    else
        echo "bench-docs: benchmarks/peers/run.py failed: the peers' table is left out" >&2
    fi
fi
"$PY" benchmarks/render_docs.py --bench docs/bench.json --bench docs/bench-arena.json --bench docs/bench-lowlat.json "${peers[@]}" --target docs/bench-target.json --plot bench.png --doc docs/benchmarks.md
