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

echo "== lint and types"
.venv/bin/ruff check pdctl tests benchmarks
.venv/bin/ruff format --check pdctl tests benchmarks
.venv/bin/mypy pdctl
.venv/bin/mypy benchmarks   # relaxed settings (pyproject.toml)

echo "== fast suite (simulator, fakes, fixtures)"
$py -m pytest -m "not real and not gpu and not soak" -q "$@"

if [[ $fast == 0 ]]; then
  echo "== real vLLM CPU end to end"
  PDCTL_REQUIRE_REAL=1 $py -m pytest -m real -q "$@"
fi
