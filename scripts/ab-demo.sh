#!/usr/bin/env bash
# Colocated, always-PD and adaptive PD on this machine's CPU cores, in one command (docs/bench.md "PD vs colocated
# on real vLLM" and "Adaptive PD on real vLLM"). Same two cores on every side: one pair of vLLM CPU engines (core 0,
# core 1) from examples/cpu-ab/, and three gateways over them: always-PD (prefill on core 0, decode on core 1),
# colocated (whole requests to either engine) and adaptive PD (routing.pd_mode = "adaptive": short or cached
# prompts to decode alone). Then `pdctl bench --ab --ab-side adaptive=...` with the recipe's mixed workload at
# several rates, and with the agent workload (multi-turn conversations) at several conversation counts.
#
#   scripts/ab-demo.sh                                  # small model, rates 1,2,4,8, 80 requests per run
#   scripts/ab-demo.sh --size tiny --rates 1,2 -n 12    # a smoke run: a few minutes
#   scripts/ab-demo.sh --engine sim                     # the same flow on pdctl's simulator (no vLLM needed)
#   scripts/ab-demo.sh --exact --rates 0                # + adaptive PD on the engines' KV events; agents only
#   scripts/ab-demo.sh --stall-ms 20                    # + adaptive PD with routing.local_max_stall_ms = 20
#   scripts/ab-demo.sh ... -- --goodput ttft:3000 tpot:150   # anything after -- goes to `pdctl bench`
#
# Writes into the results folder (--out, default results/ab-DATE): ab.json (every run, vLLM's keys), report.html,
# agent-N.json / agent-N.html / agent-N.txt (the agent workload with N conversations), agreement.json / .txt
# (every side's greedy answers against colocated's, benchmarks/side_agreement.py),
# plots/*.svg (and *.png when rsvg-convert or ImageMagick is installed), bench.txt (the tables), metrics/ (each
# worker's raw /metrics before and after), machine.txt (CPU, cores, load before and after), deploy/ (the files
# the deployment ran from, its logs under deploy/.pdctl/logs). Stops everything it started on exit, Ctrl-C
# included. The engines share the two cores with anything else running: see machine.txt before trusting numbers.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PDCTL="$VENV/bin/pdctl"
PY="$VENV/bin/python"

SIZE=small
RATES=1,2,4,8
REQUESTS=80
DURATION=""
ENGINE=vllm
INSTALL=1
PNG=1
SLO_SCALE=3
CONVERSATIONS=4,8
EXACT=0
STALL_MS=""
PORT=8000
OUT=""
BENCH_EXTRA=()

usage() {
    cat <<EOF
usage: scripts/ab-demo.sh [--size tiny|small|medium] [--rates R,R..] [-n N | --duration S] [--engine vllm|sim]
                          [--slo-scale S] [--conversations N,N..] [--exact] [--stall-ms MS] [--no-install]
                          [--no-png] [--port P] [--out DIR] [-- pdctl bench options]
  --size      model preset of \`pdctl model tiny\` (default small; tiny for a smoke run)
  --rates     request rates of the sweep, req/s (default 1,2,4,8; 0: no mixed sweep, the agent runs only)
  -n          requests per run and side (default 80); --duration S instead: seconds per run
  --engine    vllm (default) or sim (pdctl's simulator: the same flow in seconds, no vLLM)
  --slo-scale SLOs = S x the unloaded latency measured first: TTFT of a long prompt, TPOT of a short request
              (default 3; \`-- --goodput ttft:MS tpot:MS\` sets them instead)
  --conversations  agent workload: conversation counts, one run of each per side (default 4,8; 0: none)
  --exact     a fourth side, "exact": adaptive PD judged by the engines' own KV cache events
              (routing.prefix_view = "exact", events on P+300); "adaptive" keeps the approximate view
  --stall-ms  a side "stall": adaptive PD with routing.local_max_stall_ms = MS (no local prefill that would
              stall the decode's streams longer)
  --no-install  use \$VENV as it is (default: scripts/install-cpu-engine.sh into it first, with vllm)
  --no-png    SVG plots only (default: also PNG, with rsvg-convert or headless Chromium)
  --port      PD gateway port; colocated gets P+1, adaptive P+2, exact P+3, stall P+4, prefill P+100, decode P+200
              (default 8000)
  --out       results folder (default results/ab-DATE)
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --size) SIZE="$2"; shift 2 ;;
        --rates) RATES="$2"; shift 2 ;;
        -n) REQUESTS="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --engine) ENGINE="$2"; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        --no-png) PNG=0; shift ;;
        --slo-scale) SLO_SCALE="$2"; shift 2 ;;
        --conversations) CONVERSATIONS="$2"; shift 2 ;;
        --exact) EXACT=1; shift ;;
        --stall-ms) STALL_MS="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; BENCH_EXTRA=("$@"); break ;;
        *) echo "error: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
case "$SIZE" in tiny|small|medium) ;; *) echo "error: --size: expected tiny, small or medium, got '$SIZE'" >&2; exit 2 ;; esac
case "$ENGINE" in vllm|sim) ;; *) echo "error: --engine: expected vllm or sim, got '$ENGINE'" >&2; exit 2 ;; esac
[[ "$SLO_SCALE" =~ ^[0-9]+([.][0-9]+)?$ && ! "$SLO_SCALE" =~ ^0*([.]0*)?$ ]] \
    || { echo "error: --slo-scale: expected a positive number, got '$SLO_SCALE'" >&2; exit 2; }
[[ -z "$STALL_MS" || "$STALL_MS" =~ ^[0-9]+([.][0-9]+)?$ ]] \
    || { echo "error: --stall-ms: expected milliseconds, got '$STALL_MS'" >&2; exit 2; }
[[ "$CONVERSATIONS" =~ ^[0-9]+(,[0-9]+)*$ ]] \
    || { echo "error: --conversations: expected counts like 4,8 (0: no agent runs), got '$CONVERSATIONS'" >&2; exit 2; }
[[ "$PORT" =~ ^[0-9]+$ ]] && (( PORT >= 1024 && PORT <= 65000 )) \
    || { echo "error: --port: expected a port in 1024-65000, got '$PORT'" >&2; exit 2; }

OUT="${OUT:-results/ab-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT/metrics"
OUT="$(cd "$OUT" && pwd)"
DEPLOY="$OUT/deploy"
CONFIG=(-c "$DEPLOY/config.toml" -s "$DEPLOY/settings.json")
SIDE_PIDS=()

step() { printf '\n\033[1m[%s] %s\033[0m\n' "$1" "$2"; }

# Stops what this script started: the colocated and adaptive gateways' process groups, then the deployment.
stop_all() {
    local pid
    for pid in ${SIDE_PIDS[@]+"${SIDE_PIDS[@]}"}; do
        kill -0 "$pid" 2>/dev/null || continue
        kill -TERM -- "-$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    if [[ -f "$DEPLOY/config.toml" ]]; then
        "$PDCTL" down "${CONFIG[@]}" >/dev/null 2>&1 || true
    fi
    SIDE_PIDS=()
}
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    stop_all
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ -z "${PDCTL_API_KEY:-}" ]]; then
    PDCTL_API_KEY="ab-demo-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
    export PDCTL_API_KEY
    echo "PDCTL_API_KEY is not set: using a random key for this run (the gateways listen on 127.0.0.1 only)"
fi

step 1/8 "engine and model"
if [[ "$ENGINE" == vllm ]]; then
    if [[ "$INSTALL" == 1 ]]; then VENV="$VENV" scripts/install-cpu-engine.sh; fi
    MODEL_DIR="$ROOT/models/$SIZE-qwen3"
    "$PDCTL" model tiny "$MODEL_DIR" --size "$SIZE"
else
    MODEL_DIR="sim-$SIZE"
    echo "engine sim: no model files needed (the simulator serves '$MODEL_DIR')"
fi

step 2/8 "deployment files in $DEPLOY (from examples/cpu-ab/)"
"$PY" - "$ROOT/examples/cpu-ab" "$DEPLOY" "$MODEL_DIR" "$SIZE" "$ENGINE" "$PORT" "$EXACT" "$STALL_MS" <<'EOF'
import json, sys
from pathlib import Path

import tomlkit

src, dst, model, size, engine, port, exact, stall_ms = sys.argv[1:9]
src, dst, port, exact = Path(src), Path(dst), int(port), exact == "1"
dst.mkdir(parents=True, exist_ok=True)
doc = tomlkit.parse((src / "config.toml").read_text())
max_len = 8192
config_json = Path(model) / "config.json"
if config_json.is_file():
    max_len = min(max_len, int(json.loads(config_json.read_text()).get("max_position_embeddings", max_len)))
for i, role in enumerate(("prefill", "decode")):
    worker = doc[role]
    worker["model"], worker["served_model_name"], worker["max_model_len"] = model, size, max_len
    worker["side_channel_port"] = port - 2400 + 100 * i
    if engine == "sim":
        worker["engine"] = "sim"
if engine == "sim":
    # H100 timing; the KV bytes actually moved scaled down, so the copies do not load this machine's cores.
    doc["sim"] = {"profile": "h100", "speed": 1, "kv_scale": 0.001}
(dst / "config.toml").write_text(tomlkit.dumps(doc))
sides = [("settings.json", "settings.json", port), ("settings-colocated.json", "settings-colocated.json", port + 1),
         ("settings.json", "settings-adaptive.json", port + 2)]
if exact:
    sides.append(("settings.json", "settings-exact.json", port + 3))
if stall_ms:
    sides.append(("settings.json", "settings-stall.json", port + 4))
for name, out, listen in sides:
    settings = json.loads((src / name).read_text())
    settings["gateway"]["listen"] = f"127.0.0.1:{listen}"
    settings["routing"]["prefill_endpoint"] = f"http://127.0.0.1:{port + 100}"
    settings["routing"]["decode_endpoint"] = f"http://127.0.0.1:{port + 200}"
    if out in ("settings-adaptive.json", "settings-exact.json", "settings-stall.json"):
        settings["routing"]["pd_mode"] = "adaptive"  # the thresholds' defaults (docs/gateway.md, Adaptive PD)
    if out == "settings-stall.json":
        settings["routing"]["local_max_stall_ms"] = float(stall_ms)
    if exact and out in ("settings.json", "settings-exact.json"):
        # settings.json starts the engines: with prefix_view "exact" the plan has them publish KV cache events to
        # P+300, where only the exact side listens (pdctl check's PD034 info says so for the always-PD side).
        settings["routing"]["prefix_view"] = "exact"
        settings["routing"]["kv_events_port"] = port + 300
    (dst / out).write_text(json.dumps(settings, indent=2) + "\n")
EOF
"$PDCTL" check "${CONFIG[@]}"

machine() {
    echo "== $1 ($(date -u +%FT%TZ))"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
    echo "cores: $(nproc); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "busiest processes:"
    ps -eo pcpu,pid,comm --sort=-pcpu | head -6
}
machine "before" > "$OUT/machine.txt"

step 3/8 "start prefill (core 0), decode (core 1) and the PD gateway (:$PORT)"
"$PDCTL" up -d "${CONFIG[@]}"

# start_side NAME PORT: a gateway over the same two engines from settings-NAME.json, in its own process group
start_side() {
    local name="$1" port="$2" pid
    setsid "$PDCTL" gateway -c "$DEPLOY/config.toml" -s "$DEPLOY/settings-$name.json" \
        > "$OUT/$name-gateway.log" 2>&1 < /dev/null &
    pid=$!
    SIDE_PIDS+=("$pid")
    for _ in $(seq 150); do
        if "$PY" -c 'import sys, httpx; sys.exit(httpx.get(sys.argv[1], timeout=2).status_code != 200)' \
            "http://127.0.0.1:$port/health" 2>/dev/null; then
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "error: the $name gateway exited; the end of $OUT/$name-gateway.log:" >&2
            tail -n 15 "$OUT/$name-gateway.log" | sed 's/^/  /' >&2
            exit 1
        fi
        sleep 0.2
    done
}
step 4/8 "start the colocated (:$((PORT + 1))) and adaptive (:$((PORT + 2))) gateways over the same two engines"
start_side colocated $((PORT + 1))
start_side adaptive $((PORT + 2))
SIDES=(--ab --ab-gateway "http://127.0.0.1:$((PORT + 1))" --ab-side "adaptive=http://127.0.0.1:$((PORT + 2))")
NAMED=("colocated=http://127.0.0.1:$((PORT + 1))" "pd=http://127.0.0.1:$PORT" "adaptive=http://127.0.0.1:$((PORT + 2))")
if [[ "$EXACT" == 1 ]]; then
    start_side exact $((PORT + 3))
    SIDES+=(--ab-side "exact=http://127.0.0.1:$((PORT + 3))")
    NAMED+=("exact=http://127.0.0.1:$((PORT + 3))")
fi
if [[ -n "$STALL_MS" ]]; then
    start_side stall $((PORT + 4))
    SIDES+=(--ab-side "stall=http://127.0.0.1:$((PORT + 4))")
    NAMED+=("stall=http://127.0.0.1:$((PORT + 4))")
fi

scrape() {
    local when="$1" role port
    for role in prefill decode; do
        port=$([[ "$role" == prefill ]] && echo $((PORT + 100)) || echo $((PORT + 200)))
        "$PY" -c 'import sys, httpx; sys.stdout.write(httpx.get(sys.argv[1], timeout=10).text)' \
            "http://127.0.0.1:$port/metrics" > "$OUT/metrics/$when-$role.txt" 2>/dev/null || true
    done
}

LONG_LEN=2048
# The tiny preset's tokenizer splits bench words into several tokens: stay far below its 4096 positions.
if [[ "$SIZE" == tiny ]]; then LONG_LEN=512; fi
WORKLOAD=(-w mixed --short-len 128 --output-len 64 --long-len "$LONG_LEN" --long-output-len 8 --timeout 600
          --no-progress)

step 5/8 "SLOs scaled to this machine: $SLO_SCALE x the unloaded latencies, one request at a time on one engine"
"$PDCTL" bench --gateway "http://127.0.0.1:$((PORT + 1))" --model "$SIZE" "${WORKLOAD[@]}" --long-fraction 0.5 \
    --concurrency 1 -n 8 --no-slo --no-metrics -o "$OUT/unloaded.json" > "$OUT/unloaded.txt"
read -r TTFT_SLO TPOT_SLO < <("$PY" - "$OUT/unloaded.json" "$SLO_SCALE" <<'EOF'
import json, math, sys
run, scale = json.load(open(sys.argv[1])), float(sys.argv[2])
kinds = run["pdctl"]["by_kind"]
ttft = kinds.get("long", {}).get("ttft", {}).get("median") or run["median_ttft_ms"]
tpot = kinds.get("short", {}).get("tpot", {}).get("median") or run["median_tpot_ms"]
print(math.ceil(scale * ttft / 10) * 10, math.ceil(scale * tpot))
EOF
)
echo "unloaded latencies in $OUT/unloaded.txt; SLOs: TTFT <= $TTFT_SLO ms, TPOT <= $TPOT_SLO ms"

step 6/8 "bench: mixed workload at $RATES req/s, colocated, always-PD and adaptive in turn at each rate"
BOUND=(-n "$REQUESTS")
if [[ -n "$DURATION" ]]; then BOUND=(--duration "$DURATION"); fi
scrape before
if [[ "$RATES" != 0 ]]; then
    "$PDCTL" bench "${CONFIG[@]}" "${WORKLOAD[@]}" --long-fraction 0.2 --rate "$RATES" "${BOUND[@]}" \
        --goodput "ttft:$TTFT_SLO" "tpot:$TPOT_SLO" "${SIDES[@]}" \
        -o "$OUT/ab.json" --html "$OUT/report.html" --plots "$OUT/plots" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} \
        | tee "$OUT/bench.txt"
else
    echo "--rates 0: no mixed sweep"
fi

step 7/8 "bench: agent workload (multi-turn conversations) with ${CONVERSATIONS} conversations, the three sides in turn"
# vLLM's multi-turn generator's shapes (500-token system prompt, ~1,000-token context, 120-160-token user turns),
# with short answers and 4-6 turns so a run takes a minute or two on two cores.
AGENT=(-w agent --system-len 500 --context-len 1000 --turns 4:6 --user-len 120:160 --answer-len 24:32
       --timeout 600 --no-progress)
if [[ "$SIZE" == tiny ]]; then  # a quarter of the words: the tiny tokenizer's several tokens a word
    AGENT=(-w agent --system-len 120 --context-len 250 --turns 3:4 --user-len 30:40 --answer-len 8:12
           --timeout 600 --no-progress)
fi
for n in ${CONVERSATIONS//,/ }; do
    [[ "$n" == 0 ]] && continue
    "$PDCTL" bench "${CONFIG[@]}" "${AGENT[@]}" --conversations "$n" --goodput "ttft:$TTFT_SLO" "tpot:$TPOT_SLO" \
        "${SIDES[@]}" -o "$OUT/agent-$n.json" --html "$OUT/agent-$n.html" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} \
        | tee "$OUT/agent-$n.txt"
done
echo
echo "greedy answers of every side against colocated's, judged as pdctl verify judges them:"
"$PY" -m benchmarks.side_agreement --model "$SIZE" -n 4 --long-words "$LONG_LEN" "${NAMED[@]}" \
    -o "$OUT/agreement.json" | tee "$OUT/agreement.txt" \
    || echo "warning: some answers differ beyond a near-tie, or a side failed: see $OUT/agreement.json"
scrape after
machine "after" >> "$OUT/machine.txt"

step 8/8 "stop everything, then the plots as PNG"
stop_all
# PNG beside each SVG when a renderer is at hand: rsvg-convert, else a headless Chromium screenshot.
CHROMIUM="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
PNGS=0
for svg in "$OUT"/plots/*.svg; do
    [[ "$PNG" == 1 ]] || break
    png="${svg%.svg}.png"
    if command -v rsvg-convert >/dev/null; then
        rsvg-convert -b white -o "$png" "$svg" 2>/dev/null || true
    elif [[ -n "$CHROMIUM" ]]; then
        dims="$(sed -n 's/^<svg[^>]* width="\([0-9]*\)" height="\([0-9]*\)".*/\1,\2/p' "$svg" | head -1)"
        profile="$(mktemp -d)"
        "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking --no-first-run \
            --hide-scrollbars --user-data-dir="$profile" --window-size="${dims:-660,300}" \
            --screenshot="$png" "file://$svg" >/dev/null 2>&1 || true
        rm -rf "$profile"
    fi
    if [[ -s "$png" ]]; then PNGS=$((PNGS + 1)); fi
done
if [[ "$PNG" == 1 ]]; then echo "$PNGS PNG plots written (PNG needs rsvg-convert or Chromium; SVG always)"; fi

cat <<EOF

Results in $OUT:
  report.html    tables and plots (open it in a browser)
  ab.json        every run, colocated, always-PD and adaptive, vLLM bench serve's keys plus pdctl's (pdctl.engine,
                 pdctl.by_kind, pdctl.paths)
  agent-N.*      the agent workload with N conversations: results by turn (pdctl.by_turn), report, tables
  plots/         goodput vs rate, latency CDFs per rate (sides overlaid), TPOT over time with long-prompt arrivals,
                 requests running on each engine
  agreement.*    every side's greedy answers against colocated's (identical / near-tie / diverged), and paths
  bench.txt      the tables as printed; metrics/ raw /metrics of both engines before and after; machine.txt
EOF
