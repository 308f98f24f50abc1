#!/usr/bin/env bash
# GPU smoke test: pdctl init -> check -> up -> verify -> bench -> down, serving a `pdctl model tiny` model
# with real vLLM (CUDA build) and NixlConnector (kv_buffer_device = "cuda"). See docs/gpu.md.
#
# Usage: scripts/gpu-smoke.sh [--check-only] [WORKDIR]   (default WORKDIR: a new temporary folder, kept)
#   --check-only   stop after `pdctl check` (no engine starts; what the CPU test suite runs)
# Needs: NVIDIA GPUs, and vLLM's CUDA build and nixl in pdctl's Python (PDCTL_PYTHON, else .venv/bin/python).
# With two or more GPUs prefill gets GPU 0 and decode GPU 1; with one GPU both share GPU 0 at 0.4 each.
# Exit status: 0 when every step passed; otherwise the failing step's status (its output says which).
set -euo pipefail

check_only=0
if [[ "${1:-}" == "--check-only" ]]; then check_only=1; shift; fi
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d -t pdctl-gpu-smoke.XXXXXX)}
py=${PDCTL_PYTHON:-$repo/.venv/bin/python}
pdctl() { "$py" -m pdctl "$@"; }
mkdir -p "$work"
cd "$work"
echo "== gpu-smoke in $work with $py"

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [[ "$gpus" -lt 1 ]]; then
  echo "no NVIDIA GPU visible (nvidia-smi -L): nothing to test" >&2
  exit 3
fi

export TAOTOKEN_API_KEY=${TAOTOKEN_API_KEY:-gpu-smoke-key}

step() { echo "== $*"; "$@"; }

step pdctl model tiny models/tiny-qwen3
step pdctl init --force .

# The recipe's files, changed only where a tiny local model on this machine needs it.
"$py" - "$gpus" <<'EOF'
import json, sys, tomlkit
gpus = int(sys.argv[1])
doc = tomlkit.parse(open("config.toml").read())
for i, table in enumerate(("prefill", "decode")):
    w = doc[table]
    w["model"] = "./models/tiny-qwen3"
    w["served_model_name"] = "tiny"
    # the tiny model's context is 4096 (its config.json); both workers keep the same value
    w["max_model_len"] = 4096
    w["gpu_ids"] = [i if gpus >= 2 else 0]
    if gpus < 2:
        w["gpu_memory_utilization"] = 0.4
doc["cluster"]["gateway_host"] = "127.0.0.1"
open("config.toml", "w").write(tomlkit.dumps(doc))
s = json.load(open("settings.json"))
s["gateway"]["listen"] = "127.0.0.1:8000"
json.dump(s, open("settings.json", "w"), indent=2)
EOF

step pdctl check
if [[ $check_only == 1 ]]; then echo "== gpu-smoke: check passed, stopping (--check-only)"; exit 0; fi
trap 'pdctl down || true' EXIT
step pdctl up -d
step pdctl verify
step pdctl bench -w random --input-len 256 --output-len 32 -n 20 --rate 4 --no-slo -o bench.json
trap - EXIT
step pdctl down
echo "== gpu-smoke passed ($work)"
