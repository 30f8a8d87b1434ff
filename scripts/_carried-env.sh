# Sourced by scripts/gpu-run.sh and scripts/host-bench.sh: on a machine without network, puts
# what it lacks within reach from carried folders: .whl/ (wheels for its Python, installed
# under /tmp/site) and .deb/ (Debian's libfabric1, libfabric-dev and the libraries they link,
# unpacked under /opt/fab when libfabric's headers are missing). See docs/gpu.md.
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 FI_PROVIDER=tcp,ofi_rxm,shm
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ ! -e /usr/include/rdma/fabric.h ] && [ -d .deb ]; then
    mkdir -p /opt/fab
    for f in .deb/*.deb; do dpkg -x "$f" /opt/fab; done
    export AIOTE_FABRIC_PREFIX=/opt/fab/usr
    export LD_LIBRARY_PATH="/opt/fab/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export FI_PROVIDER_PATH=/opt/fab/usr/lib/x86_64-linux-gnu/libfabric
    # for `make -C cdeps` (the C bench), which takes libfabric from the compiler's paths
    export CPATH="/opt/fab/usr/include${CPATH:+:$CPATH}"
    export LIBRARY_PATH="/opt/fab/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
fi
