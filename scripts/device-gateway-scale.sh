#!/usr/bin/env bash
# Issue 19's run on the 16-core device machine: pdctl's gateway (1, 4 and 8 processes: gateway.workers) against
# vllm-router, PD path, at 256 and 1,024 streams, latency and throughput modes (benchmarks/gateway_overhead.py).
#
#   scripts/device-gateway-scale.sh --fetch   # here, once: the wheels the device lacks, for its Python 3.12, in .whl/
#   scripts/device-gateway-scale.sh           # on the 16-core machine, with .whl/ copied beside it: the run, into $OUT
#
# That machine is assumed to reach no package index: its image holds aiohttp, httpx, prometheus-client, psutil, pyyaml,
# rich, typer and uvloop; --fetch downloads the rest of the gateway's dependencies at the
# versions of this checkout's .venv, and vllm-router with its own. The run installs them into /tmp/site and
# vllm-router into the venv gateway_overhead.py looks for, and writes gateway_overhead.json and the log to $OUT.
# About 5 minutes of a 10-minute call: ARMS, STREAMS, MODES, MEASURE_S and ROUNDS override the run's shape.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
wheels=.whl

if [[ "${1:-}" == "--fetch" ]]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    py=${PYTHON:-.venv/bin/python}
    pins=$("$py" -m pip list --format=freeze 2>/dev/null | grep -i -E '^(uvicorn|httptools|msgspec|tomlkit|dnspython)==')
    platforms=()
    for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    # shellcheck disable=SC2086  # $pins: one requirement a word
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$wheels" \
        $pins vllm-router==0.1.17
    du -sh "$wheels"
    exit 0
fi

out=${OUT:-$repo/benchmarks/results/device}
mkdir -p "$out"
[[ -d $wheels ]] || { echo "no $wheels/: run '$0 --fetch' here first, then carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$wheels"/uvicorn-*.whl "$wheels"/httptools-*.whl "$wheels"/msgspec-*.whl "$wheels"/tomlkit-*.whl \
    "$wheels"/dnspython-*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# gateway_overhead.py runs vllm-router from this venv when it exists (ensure_venv)
python3 -m venv /tmp/pdbench-vllm-router
/tmp/pdbench-vllm-router/bin/pip install -q --no-index --find-links "$wheels" vllm-router==0.1.17
{
    echo "== $(date -u) $(nproc) cores, $(python3 --version)"
    python3 -m benchmarks.gateway_overhead \
        --arms "${ARMS:-direct-pd,pdctl-pd,pdctl-pd-w4,pdctl-pd-w8,vllm-router-pd}" \
        --streams "${STREAMS:-256,1024}" --modes "${MODES:-latency,throughput}" \
        --measure-s "${MEASURE_S:-6}" --rounds "${ROUNDS:-2}" --out "$out/gateway_overhead.json"
} 2>&1 | tee "$out/gateway_scale.log"
