"""docs/pipeline.md's "From a batch to an optimizer step": every function or class it names exists, the line count it
states is the one measured here, and the path stays short enough to read in an hour (at most 1,500 lines)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT = 1500
"""Lines a newcomer reads from a batch to an optimizer step, at most."""


def section() -> str:
    text = (REPO / "docs" / "pipeline.md").read_text(encoding="utf-8")
    start = text.index("## From a batch to an optimizer step")
    return text[start:text.index("\n## ", start + 1)]


def source_file(module: str) -> Path:
    parts = module.split(".")
    root = REPO / "shared" if parts[0] == "marge" else REPO
    return root.joinpath(*parts).with_suffix(".py")


def definition_lines(dotted: str) -> int:
    """Lines of the function or class `dotted` (module.name or module.Class.method), decorators left out."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is a file is the module
        path = source_file(".".join(parts[:cut]))
        if path.exists():
            break
    else:
        raise AssertionError(f"{dotted}: no module of it exists")
    body: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    node: ast.AST | None = None
    for name in parts[cut:]:
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None)
        assert node is not None, f"{dotted}: {name} is not defined in {path.relative_to(REPO)}"
        body = getattr(node, "body", [])
    assert node is not None
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def test_the_reading_path_exists_is_counted_right_and_is_short():
    text = section()
    names = re.findall(r"^\| \d+ \| `([\w.]+)` \|", text, flags=re.M)
    assert len(names) >= 20 and len(set(names)) == len(names)
    counted = {name: definition_lines(name) for name in names}
    # a method of a class already on the path is not counted twice
    total = sum(n for name, n in counted.items() if not any(name.startswith(other + ".") for other in counted))
    stated = int(re.search(r"\*\*([\d,]+) lines\*\*", text).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert stated == total, (f"docs/pipeline.md says {stated} lines, the path is {total}: write {total:,} there "
                             f"({counted})")
    assert total <= LIMIT
