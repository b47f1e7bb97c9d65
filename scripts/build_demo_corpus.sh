#!/usr/bin/env bash
# Rebuild the LibreOffice Help corpus from Debian's libreoffice-help-* packages (needs apt-get).
#   bash scripts/build_demo_corpus.sh                # the full corpus into data/build/libreoffice-help
#   bash scripts/build_demo_corpus.sh --fixture      # the committed extract in data/demo/libreoffice-help
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup.sh
if [ "${1:-}" = "--fixture" ]; then
  shift
  exec python -m tools.demo_corpus --out data/demo/libreoffice-help --max-train-pages 480 --max-heldout-pages 80 \
    --max-pairs-per-language 300 "$@"
fi
exec python -m tools.demo_corpus --out data/build/libreoffice-help "$@"
