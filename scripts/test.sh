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

stage "lint and types" lint
stage "fast suite (simulator, fakes, fixtures)" $py -m pytest -m "not real and not gpu and not soak" -q "$@"
if [[ $fast == 0 ]]; then
  stage "real vLLM CPU end to end" env PDCTL_REQUIRE_REAL=1 $py -m pytest -m real -q "$@"
fi

if (( ${#failed[@]} )); then
  printf 'FAILED stage: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "all stages passed"
