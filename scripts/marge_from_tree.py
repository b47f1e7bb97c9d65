#!/usr/bin/env python3
"""Run the `marge` command from this checkout without installing it.

For a machine where nothing can be installed (a lent GPU machine with torch but no registry): the
installed package maps `marge` to shared/marge and `marge.<stage>` to services/<stage> (pyproject.toml's
package-dir); this does the same mapping on the import path, then calls the CLI.

    python3 scripts/marge_from_tree.py experiment learning --single-process ...

Commands that need Ray, Redis, FAISS or FastAPI still need them installed; `experiment learning
--single-process`, `eval`, `info` and `prepare --no-lid` need none of them.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "shared"))

import marge  # noqa: E402  (the library, from shared/marge)

marge.__path__.append(str(ROOT / "services"))  # marge.indexer -> services/indexer, ...

from marge.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
