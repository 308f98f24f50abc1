#!/usr/bin/env bash
# The README's test command: installs what the tests need (idempotent), then runs the fast suite and the
# real vLLM CPU end-to-end tests. Usage: scripts/test.sh [--fast] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [[ "${1:-}" == "--fast" ]]; then fast=1; shift; fi

if [[ $fast == 1 ]]; then
  # The fast suite needs no vLLM: a plain venv with the test extras.
  [[ -x .venv/bin/python ]] || python3 -m venv .venv
  .venv/bin/pip install -q -e '.[test]'
else
  PDCTL_EXTRAS=cpu,test bash scripts/install-cpu-engine.sh
fi
py=.venv/bin/python

# Every stage runs even when an earlier one failed (a red fast suite must not hide the real one); the exit
# status is non-zero when any failed, and the last line says which.
failed=()
stage() {
  local name=$1; shift
  echo "== $name"
  "$@" || failed+=("$name")
}
lint() {
  .venv/bin/ruff check pdctl tests benchmarks &&
    .venv/bin/ruff format --check pdctl tests benchmarks &&
    .venv/bin/mypy pdctl &&
    .venv/bin/mypy benchmarks # relaxed settings (pyproject.toml)
}

# scripts/demo.sh leaves its deployment up. The tests never touch it: each deployment they start is a copy on
# free ports with its own run directory (tests/conftest.py holds the examples' ports to keep it that way).
demo_up() {
  [[ -x .venv/bin/pdctl ]] || return 1
  .venv/bin/pdctl status --json -c examples/cpu/config.toml -s examples/cpu/settings.json 2>/dev/null |
    $py -c 'import json, sys; sys.exit(0 if json.load(sys.stdin).get("supervisor_running") is True else 1)' 2>/dev/null
}
if demo_up; then
  echo "note: the demo's deployment (examples/cpu) is up; the tests run beside it on their own ports and leave it" \
    "running. Its idle engines leave the cores where [supervisor] idle_group applies (root, cgroup v1), else the" \
    "real stage is slower (to free them: .venv/bin/pdctl down -c examples/cpu/config.toml -s examples/cpu/settings.json)"
fi

stage "lint and types" lint
stage "fast suite (simulator, fakes, fixtures)" $py -m pytest -m "not real and not gpu and not soak" -q "$@"
if [[ $fast == 0 ]]; then
  stage "real vLLM CPU end to end" env PDCTL_REQUIRE_REAL=1 $py -m pytest -m real -q --durations=15 "$@"
fi

if (( ${#failed[@]} )); then
  printf 'FAILED stage: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "all stages passed"
