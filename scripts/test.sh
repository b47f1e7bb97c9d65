#!/usr/bin/env bash
# Sets up (see setup.sh), lints (ruff), type-checks (mypy) and runs the test tiers fastest first, so that a failure in a
# fast tier ends the run before the slow ones start: real redis-server, real local Ray, CPU only (docs/testing.md).
#   bash scripts/test.sh              ruff, mypy, then tests/unit, tests/integration, tests/cluster (what CI runs)
#   bash scripts/test.sh --fast       ruff, mypy, then tests/unit alone: no server, under a minute on a 2-core CPU
#   bash scripts/test.sh ARGS...      ruff, mypy, then one pytest run with ARGS (a file, -k EXPRESSION, ...)
#   bash scripts/test.sh --fast ARGS  ARGS go to the unit tier's run
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup.sh
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
python -m ruff check .   # lint first: a name that is not defined fails here in a second, not in a test an hour in
python -m mypy   # files and settings from pyproject.toml's [tool.mypy]: no arguments here, so the two never disagree
if [ "$fast" = 1 ]; then
  exec python -m pytest -q tests/unit "$@"
fi
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# one pytest run per tier, so a failing tier stops the script before the next, slower one
python -m pytest -q tests/unit
python -m pytest -q tests/integration
exec python -m pytest -q tests/cluster
