"""The image and the deploy files: the image's install script run in a fresh virtual environment (no Docker
daemon needed), and the cluster files checked for what they name (the image the Dockerfile builds, configs and
scripts that exist, the shape KubeRay's RayJob has).

These need a server or take long; the quick tests of this subject are in tests/unit/test_deploy.py (no server)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
IMAGE = "marge:latest"


@pytest.mark.slow
def test_the_image_install_script_installs_a_working_marge_into_a_fresh_environment(tmp_path):
    """deploy/image/install.sh cpu in a new virtual environment (pip's cache makes it minutes, not a download):
    every stage and the CLI import, and `marge --help` builds every subcommand, from an installed copy (not the
    checkout: a module missing from pyproject's packages fails here)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", str(DEPLOY / "image" / "install.sh"), "cpu"], env=env, capture_output=True,
                          text=True, timeout=1500, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "marge installed:" in done.stdout
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import services, marge; print(services.__file__, "
                            "marge.__file__)"], env=env, capture_output=True, text=True, cwd=tmp_path, check=True)
    assert str(venv) in where.stdout and str(REPO) not in where.stdout  # the installed copy, not the checkout
