#!/usr/bin/env bash
# Install MARGE into the current Python environment, as the image does (deploy/image/Dockerfile):
#   bash deploy/image/install.sh gpu     # FAISS on GPU (the cluster's trainer and indexer nodes)
#   bash deploy/image/install.sh cpu     # FAISS on CPU
# torch is pinned first (constraints.txt), then the project (not editable: the image holds a copy) with its FAISS
# extra and Ray Serve for the retrieval service; then it checks that every entry point imports. The same script
# runs in a fresh virtual environment in the tests (tests/integration/test_deploy_install.py), so the image's contents are tested
# without a Docker daemon.
set -euo pipefail
flavour="${1:-gpu}"
case "$flavour" in cpu|gpu) ;; *) echo "install.sh: the flavour is cpu or gpu, not '$flavour'" >&2; exit 2 ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q -c constraints.txt "torch==2.13.0"
python -m pip install -q -c constraints.txt ".[$flavour,serve]"
# what a cluster job runs: the CLI, every stage, the retrieval service
python - <<'PY'
import importlib, shutil, sys
for name in ("marge", "marge.model.network", "marge.contracts.protocol", "services.cli", "services.prepare.run",
             "services.driver.pipeline", "services.trainer.rank", "services.indexer.actor", "services.batcher.actor",
             "services.retrieval.app", "services.driver.single_process", "faiss", "ray.train", "ray.serve", "redis",
             "pyarrow", "fastapi", "uvicorn"):
    importlib.import_module(name)
if shutil.which("marge") is None:
    sys.exit("install.sh: the marge command is not on PATH")
print("marge installed:", importlib.import_module("marge").__version__)
PY
marge --help >/dev/null  # builds every subcommand's parser
