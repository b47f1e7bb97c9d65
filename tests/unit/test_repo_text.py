"""The repository speaks of the software alone: no committed text file holds a path of the machine it was made on
(a home, temp or work folder: reports name paths relative to their run or the repository), and no ticket number
a reader cannot look up."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:root|home/[\w.-]+|tmp|work|private/var|Users/[\w.-]+)/")
TICKET = re.compile(r"\b[Ii]ssues? \d+\b")
BINARY = (".gz", ".png", ".parquet", ".pt", ".safetensors", ".model")


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()
    return [REPO / name for name in listed if not name.endswith(BINARY) and (REPO / name).is_file()]


def offending(pattern: re.Pattern, skip: set[str]) -> list[str]:
    found = []
    for path in tracked_text_files():
        rel = path.relative_to(REPO).as_posix()
        if rel in skip:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            if pattern.search(line):
                found.append(f"{rel}:{number}: {line.strip()[:120]}")
    return found


def test_no_committed_file_holds_a_machine_path():
    assert offending(MACHINE_PATH, {"tests/unit/test_repo_text.py"}) == []


def test_no_committed_file_cites_a_ticket_number():
    assert offending(TICKET, {"tests/unit/test_repo_text.py"}) == []
