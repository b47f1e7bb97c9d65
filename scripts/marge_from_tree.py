#!/usr/bin/env python3
"""Run the `marge` command from this checkout without installing it.

For a machine where the package cannot be installed (for example a GPU node that has torch but no package index to
install from). Import paths match folders: the library `marge` is shared/marge, the stages are services/<stage>
(`services.indexer`, ...) and the command line services/cli, so putting shared/ and the checkout itself
on the import path is all an install would do.

    python3 scripts/marge_from_tree.py pretrain --single-process ...

Commands that need Ray, Redis, FAISS or FastAPI still need them installed; `pretrain
--single-process`, `eval`, `info`, `plan` and `prepare --no-lid` need none of them.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shared"), str(ROOT)]

from services.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
