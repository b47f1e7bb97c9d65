#!/usr/bin/env bash
# Sets up (see setup.sh) and runs the whole test suite: real redis-server, real local Ray, CPU only.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup.sh
exec python -m pytest -q "$@"
