"""The repository speaks of the software alone: no committed text file holds a path of the machine it was made on
(a home, temp or work folder: reports name paths relative to their run or the repository), no ticket number a reader
cannot look up, and no passage about the conditions the repository was built under rather than the software (a
borrowed machine, a work session's budget, notes or people a reader cannot see, runs that competed with the test
suite)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:root|home/[\w.-]+|tmp|work|private/var|Users/[\w.-]+)/")
TICKET = re.compile(r"\b[Ii]ssues? \d+\b")
BUILD_CONDITIONS = re.compile(
    r"\blent\b|\bsandbox|\bdevice[- ](?:minutes|time|budget)|\bsession(?:'s)? (?:budget|time)|\bCEO\b|DEVELOPERS\.md"
    r"|shared/notes|\bstop hook|\b(?:test suites?|test runs?)\b.{0,40}\b(?:compet|shar|alongside)"
    r"|\b(?:helper|agent)s? (?:wrote|built|ran)\b|\bcan install nothing|\bno registry", re.IGNORECASE)
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


def test_no_committed_file_speaks_of_the_conditions_it_was_built_under():
    assert offending(BUILD_CONDITIONS, {"tests/unit/test_repo_text.py"}) == []


def test_the_build_conditions_pattern_catches_what_it_is_for():
    caught = ["a first attempt ran while a test suite competed for the 2 cores", "on a lent GPU machine",
              "within the session's budget", "see shared/notes/review.md", "a GPU machine that can install nothing"]
    passed = ["the driver renews its lease every 5 s", "the suite runs in 30 min on a 2-core CPU",
              "Ray's dashboard agent", "a Unix session of its own"]
    assert [t for t in caught if not BUILD_CONDITIONS.search(t)] == []
    assert [t for t in passed if BUILD_CONDITIONS.search(t)] == []
