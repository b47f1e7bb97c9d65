#!/usr/bin/env bash
# Sets up (see setup.sh), lints (ruff) and runs the whole test suite: real redis-server, real local Ray, CPU only.
#   bash scripts/test.sh            everything (what CI runs)
#   bash scripts/test.sh --fast     the unit tier: every test not marked slow (no pipeline, no cluster runs)
# Other arguments go to pytest (a file, -k EXPRESSION, ...).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup.sh
if [ "${1:-}" = "--fast" ]; then
  shift
  exec python -m pytest -q -m "not slow" "$@"
fi
python -m ruff check .   # lint first: a name that is not defined fails here in a second, not in a test an hour in
exec python -m pytest -q "$@"
