#!/usr/bin/env bash
# pdctl's demo, no GPU needed: real vLLM prefill + decode on CPU with NIXL, plus the gateway.
#
#   scripts/demo.sh           # install, model, up, verify, bench; leaves the deployment running
#   scripts/demo.sh --down    # the same, then stops everything
#
# The first run takes several minutes (installing vLLM CPU ~3 min, starting two engines 1-3 min);
# later runs reuse the environment, the model and a deployment that is still running.
# The gateway's key comes from PDCTL_API_KEY; without it the demo uses the key "pdctl-demo"
# (the gateway listens on 127.0.0.1 only).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PDCTL="$VENV/bin/pdctl"
CONFIG=(-c examples/cpu/config.toml -s examples/cpu/settings.json)
MODEL_DIR=models/tiny-qwen3
RESULTS=results/demo-bench.json
STOP_AT_END=0
[[ "${1:-}" == "--down" ]] && STOP_AT_END=1

step() { printf '\n\033[1m[%s] %s\033[0m\n' "$1" "$2"; }

if [[ -z "${PDCTL_API_KEY:-}" ]]; then
    export PDCTL_API_KEY=pdctl-demo
    echo "PDCTL_API_KEY is not set: using the demo key 'pdctl-demo'"
fi

step 1/6 "install pdctl + vLLM CPU + NIXL into $VENV (first time ~3 min)"
VENV="$VENV" scripts/install-cpu-engine.sh

step 2/6 "generate the tiny random Qwen3 model in $MODEL_DIR"
"$PDCTL" model tiny "$MODEL_DIR"

# The state of a deployment of examples/cpu: "ready", "none" (no supervisor runs), or the status of one that
# runs but is not ready ("starting", "stopping", ...). Whatever `status --json` prints (nothing, an error, JSON
# of another shape), this prints one word and never shows a traceback.
deployment() {
    local out
    out="$("$PDCTL" status --json "${CONFIG[@]}" 2>/dev/null)" || true
    "$VENV/bin/python" -c '
import json, sys
try:
    d = json.loads(sys.argv[1])
except ValueError:
    d = None
running = isinstance(d, dict) and d.get("supervisor_running") is True
print(str(d.get("status") or "unknown") if running else "none")
' "$out" 2>/dev/null || echo none
}

step 3/6 "start prefill (core 0), decode (core 1) and the gateway (1-3 min on 2 cores)"
state="$(deployment)"
case "$state" in
    ready) echo "a deployment of examples/cpu is already running: reusing it" ;;
    none) "$PDCTL" up -d "${CONFIG[@]}" ;;
    *)
        echo "a deployment of examples/cpu is running but not ready (status: $state):" \
            "wait for it (\`$PDCTL status ${CONFIG[*]}\`), or stop it (\`$PDCTL down ${CONFIG[*]}\`)" \
            "and run the demo again" >&2
        exit 1
        ;;
esac
"$PDCTL" status "${CONFIG[@]}"

step 4/6 "verify: the recipe's requests, and proof that the KV moved from prefill to decode intact"
if ! "$PDCTL" verify "${CONFIG[@]}" --timeout 300; then
    echo "verify failed: each ✗ line above names its cause and next step; the deployment is still up" \
        "(\`$PDCTL logs --kv ${CONFIG[*]}\`, \`$PDCTL down ${CONFIG[*]}\`)" >&2
    exit 1
fi

step 5/6 "bench: a short run of the recipe's two prompts through the gateway"
mkdir -p "$(dirname "$RESULTS")"
"$PDCTL" bench "${CONFIG[@]}" -w doc -n 8 --concurrency 2 --warmup 1 --timeout 300 -o "$RESULTS"

step 6/6 "done"
if [[ "$STOP_AT_END" == 1 ]]; then
    "$PDCTL" down "${CONFIG[@]}"
    echo "stopped. Results: $RESULTS"
    exit 0
fi
cat <<EOF
The deployment is still running (gateway http://127.0.0.1:8000, model "tiny"). Results: $RESULTS

Try it:
  export PDCTL_API_KEY=$( [[ "$PDCTL_API_KEY" == pdctl-demo ]] && echo pdctl-demo || echo '<your key>' )
  curl -s http://127.0.0.1:8000/v1/chat/completions -H "Authorization: Bearer \$PDCTL_API_KEY" \\
    -H "Content-Type: application/json" \\
    -d '{"model":"tiny","messages":[{"role":"user","content":"用一句话解释 KV Cache"}],"max_tokens":32}'
  $PDCTL logs --kv ${CONFIG[*]}      # KV transfer events of prefill and decode

Stop it:
  $PDCTL down ${CONFIG[*]}

scripts/test.sh runs beside it (the tests use their own ports). Idle, its engines leave the cores to other work
where pdctl can move their spinning threads out (root, cgroup v1: [supervisor] idle_group, docs/cpu.md).
EOF
