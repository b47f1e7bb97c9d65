#!/usr/bin/env bash
# The main job on the embedded default: sets up, prepares the bundled LibreOffice Help corpus (once),
# then runs MARGE pre-training on a local Ray with a private redis-server. Extra arguments are config
# overrides, e.g.  bash scripts/demo.sh run.max_steps=300
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup.sh
stamp="$(date +%Y%m%d-%H%M%S)"
exec marge pretrain --config deploy/configs/tiny.yaml "run.name=demo-$stamp" "run.dir=runs/demo-$stamp" "$@"
