"""Raw documents, the input a user brings: JSONL files (one object per line with "text" and "language"; optional
"id", "group", "title", "paragraph_ids") or folders laid out as <root>/<lang>/**/*.{html,htm,txt}. Reading them,
with errors that name the file, the line and the field (`PrepareError`), is shared by data preparation
(`services.prepare`), evaluation and the trainer's probes."""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from marge.contracts.corpus import split_paragraphs
from marge.contracts.html_text import extract_text
from marge.contracts.languages import normalize_language

log = logging.getLogger(__name__)


TEXT_SUFFIXES = {".html": "html", ".htm": "html", ".txt": "text"}


class PrepareError(ValueError):
    """Bad input. The message names the file, the line or field, and what to do."""


@dataclass
class RawDocument:
    source: str  # "<file>:<line>" or "<file>"
    doc_id: str
    group: str
    lang: str
    text: str
    paragraph_ids: tuple[str, ...] | None = None
    """One id per paragraph of `text` (`split_paragraphs`), shared by its translations in the group; None: unknown."""
    order: int = 0
    """Its place in the input (`input_order`): the first of two duplicates in this order is the one kept, by either
    engine."""


def input_order(input_index: int, position: int) -> int:
    """A document's place in the input: the input's index on the command line, then its line (JSONL) or its file's
    place in the sorted listing (folders)."""
    return (input_index << 40) + position


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{where}: invalid UTF-8 at byte {e.start} ({raw[max(0, e.start - 10):e.start + 10]!r}); "
                           "convert the file to UTF-8 (e.g. `iconv -f LATIN1 -t UTF-8`)") from None


@dataclass
class BadLine:
    """A line of an input file that is not a document (invalid UTF-8, not JSON, a field missing): `error` says why.
    Yielded in the documents' place, so that `--skip-bad-documents` can drop it and go on."""

    source: str
    error: PrepareError


def read_jsonl(path: Path, input_index: int = 0) -> Iterator[RawDocument | BadLine]:
    for line_no, raw in jsonl_lines(path):
        try:
            document = parse_jsonl_line(path, line_no, raw, input_index)
        except PrepareError as e:
            yield BadLine(f"{path}:{line_no}", e)
            continue
        if document is not None:
            yield document


def jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of a .jsonl or .jsonl.gz file; a file that is missing or cannot be read to its end
    is a PrepareError naming it and the line."""
    opener = gzip.open if path.suffix == ".gz" else open
    line_no = 0
    try:
        with opener(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                yield line_no, raw
    except (OSError, EOFError, zlib.error) as e:
        if isinstance(e, FileNotFoundError):
            raise PrepareError(f"{path}: file not found") from None
        raise PrepareError(f"{path}:{line_no + 1}: cannot be read after line {line_no} ({e}); is it a complete, "
                           "uncorrupted (gzip) JSONL file? (`gzip -t` checks one)") from None


def parse_jsonl_line(path: Path, line_no: int, raw: bytes, input_index: int = 0) -> RawDocument | None:
    """One JSONL line as a document (None: a blank line), or PrepareError naming the file, line and field."""
    obj = parse_jsonl_object(path, line_no, raw)
    if obj is None:
        return None
    where = f"{path}:{line_no}"
    doc_id, group = document_ids(obj, path, line_no)
    return RawDocument(where, doc_id, group, obj["language"], obj["text"], read_paragraph_ids(obj, where),
                       input_order(input_index, line_no))


def parse_jsonl_object(path: Path, line_no: int, raw: bytes) -> dict | None:
    """One JSONL line as an object with string 'text' and 'language' (None: a blank line), or PrepareError naming
    the file, line and field."""
    where = f"{path}:{line_no}"
    line = _decode(raw, where).strip()
    if not line:
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise PrepareError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise PrepareError(f"{where}: each line must be a JSON object with 'text' and 'language'")
    for key in ("text", "language"):
        if key not in obj:
            raise PrepareError(f"{where}: field {key!r} is missing (each line needs 'text' and 'language')")
        if not isinstance(obj[key], str):
            raise PrepareError(f"{where}: field {key!r} must be a string, got {type(obj[key]).__name__}")
    return obj


def document_ids(obj: dict, path: Path, line_no: int) -> tuple[str, str]:
    """(id, group) of a JSONL document: its 'id' (default file name:line) and its 'group' (default its id: a group
    of its own)."""
    doc_id = str(obj.get("id", f"{path.name}:{line_no}"))
    return doc_id, str(obj.get("group", doc_id))


def read_documents(path: Path, languages: Collection[str] | None = None,
                   unique: bool = False) -> dict[str, dict[str, str]]:
    """{group: {language: text}} of a documents JSONL (.jsonl or .jsonl.gz; one object per page and language, as
    `marge prepare` reads them and writes `heldout/documents.jsonl.gz`), groups in file order. Each line is checked
    as `read_jsonl` checks it, apart from 'paragraph_ids' (not read here), and a bad one is a PrepareError naming
    the file, line and field; a document without a 'group' is a group of its own. `languages`: keep only the
    documents in these. A second document of a group in one language replaces the first, or with `unique` is an
    error."""
    path = Path(path)
    groups: dict[str, dict[str, str]] = {}
    for line_no, raw in jsonl_lines(path):
        obj = parse_jsonl_object(path, line_no, raw)
        if obj is None or (languages is not None and obj["language"] not in languages):
            continue
        _, group = document_ids(obj, path, line_no)
        versions = groups.setdefault(group, {})
        if unique and obj["language"] in versions:
            raise PrepareError(f"{path}:{line_no}: a second document for group {group!r} in language "
                               f"{obj['language']!r} (one document per group and language)")
        versions[obj["language"]] = obj["text"]
    return groups


def read_paragraph_ids(obj: dict, where: str) -> tuple[str, ...] | None:
    """The optional `paragraph_ids` of a JSONL object: one string per paragraph of its text."""
    ids = obj.get("paragraph_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise PrepareError(f"{where}: field 'paragraph_ids' must be a list of non-empty strings (one per paragraph "
                           "of 'text', paragraphs separated by a blank line)")
    paragraphs = len(split_paragraphs(obj["text"]))
    if len(ids) != paragraphs:
        raise PrepareError(f"{where}: field 'paragraph_ids' has {len(ids)} ids but 'text' has {paragraphs} paragraphs "
                           "(separated by a blank line); give one id per paragraph, or leave the field out")
    return tuple(ids)


def folder_files(root: Path) -> Iterator[tuple[Path, Path]]:
    """(language folder, file) of every .html/.htm/.txt file under `root`, in the order both engines read them; a
    folder that is not laid out as <root>/<lang>/... is a PrepareError."""
    lang_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not lang_dirs:
        raise PrepareError(f"{root}: no language folders; lay out HTML/text input as {root}/<lang>/...")
    for lang_dir in lang_dirs:
        try:
            normalize_language(lang_dir.name)
        except ValueError:
            raise PrepareError(f"{lang_dir}: folder name {lang_dir.name!r} is not an ISO 639-1 language code; "
                               f"name each folder under {root} after the language of its files (en, de, zh, ...)") from None
        for path in sorted(p for p in lang_dir.rglob("*") if p.is_file() and not p.name.startswith(".")):
            if path.suffix.lower() not in TEXT_SUFFIXES:
                log.warning("skipping %s: not .html, .htm or .txt", path)
                continue
            yield lang_dir, path


def read_folder_file(lang_dir: Path, path: Path, order: int, raw: bytes) -> RawDocument:
    """One HTML or text file of a language folder as a document (HTML reduced to its text)."""
    text = _decode(raw, str(path))
    if TEXT_SUFFIXES[path.suffix.lower()] == "html":
        text = extract_text(text).text()
    rel = path.relative_to(lang_dir).with_suffix("").as_posix()
    return RawDocument(str(path), f"{lang_dir.name}/{rel}", rel, lang_dir.name, text, order=order)


def read_folder(root: Path, input_index: int = 0) -> Iterator[RawDocument | BadLine]:
    for position, (lang_dir, path) in enumerate(folder_files(root)):
        try:
            yield read_folder_file(lang_dir, path, input_order(input_index, position), path.read_bytes())
        except PrepareError as e:
            yield BadLine(str(path), e)


JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")


def check_input(path: Path) -> str:
    """'folder' or 'jsonl': what kind of input `path` is, or a PrepareError saying what is wrong with it."""
    if path.is_dir():
        return "folder"
    if path.name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if not path.exists():
        raise PrepareError(f"{path}: no such file or folder")
    raise PrepareError(f"{path}: unsupported input; give .jsonl / .jsonl.gz files or a folder of <lang>/ subfolders")


def read_inputs(inputs: list[Path]) -> Iterator[RawDocument | BadLine]:
    for index, path in enumerate(inputs):
        if check_input(path) == "folder":
            yield from read_folder(path, index)
        else:
            yield from read_jsonl(path, index)

