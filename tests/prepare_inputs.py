"""Raw documents the preparation tests write (tests/unit/test_prepare.py, the Ray engine's tests in both tiers)."""

from __future__ import annotations

import json
from pathlib import Path

GERMAN = "Die Tabellenkalkulation berechnet die Summe aller Zellen in der ausgewählten Spalte automatisch."
ENGLISH = "The spreadsheet automatically calculates the sum of all cells in the selected column."
CHINESE = "电子表格会自动计算所选列中所有单元格的总和。"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def good_rows() -> list[dict]:
    return [{"id": "p1-en", "group": "p1", "language": "en", "text": ENGLISH},
            {"id": "p1-de", "group": "p1", "language": "de", "text": GERMAN},
            {"id": "p1-zh", "group": "p1", "language": "zh", "text": CHINESE}]


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == []
