"""`marge prepare`: raw multilingual documents -> a validated, sharded Parquet corpus (see marge.corpus).

Steps (paper §3 "Data Pre-processing" and §2.4 "Data Sharding"):
  1. read documents: JSONL files (one object per line with "text" and "language"; optional "id",
     "group", "title", "paragraph_ids": one id per paragraph of "text", shared by a paragraph's translations
     in the other documents of its group) or folders laid out as <root>/<lang>/**/*.{html,htm,txt} (the language is the
     first folder name; a page's path below it is its group, so the same page in every language
     lands in one shard);
  2. check each document: valid UTF-8, not empty, not oversized, an ISO 639-1 language that offline
     language identification (fastText LID-176) does not contradict;
  3. drop exact duplicates (same language, same normalised text);
  4. train the tokenizer on the corpus (or load a given one);
  5. cut documents into chunks of at most `max_chunk_tokens` tokens along paragraph boundaries (or, with
     `document_unit="paragraph"`, make every paragraph a document of its own: dropped under
     `min_document_tokens`, cut at `max_chunk_tokens`), and drop duplicate chunks;
  6. assign groups to shards: all chunks of a group share a shard, groups are spread at random
     (seeded) over shards of about `docs_per_shard` chunks; with `heldout_permille`, a fixed share of the groups
     (chosen by a hash of the group) is held out of training instead and written as the run's probes
     (`heldout/documents.jsonl.gz` and, across languages, `heldout/pairs.tsv`);
  7. write shards, tokenizer and manifest into a temporary folder and rename it into place.

A bad document stops the run with an error naming the file, line and field (or, with
`on_bad_document="skip"`, is dropped, logged and counted in the manifest). Nothing half-written is
left behind either way.
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import json
import logging
import math
import time
import unicodedata
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from marge.progress import track

from marge import __version__
from marge.batch import max_text_tokens
from marge.corpus import CORPUS_FORMAT, CORPUS_SCHEMA_VERSION, split_paragraphs, write_shard
from marge.html_text import extract_text
from marge.langid import identify
from marge.languages import normalize_language
from marge.tokenizer import DEFAULT_VOCAB_SIZE, MargeTokenizer
from marge.artifacts import publish_dir, write_manifest

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


DOCUMENT_UNITS = ("chunk", "paragraph")
ENGINES = ("auto", "local", "ray")


@dataclass
class PrepareOptions:
    inputs: list[Path]
    out: Path
    tokenizer_dir: Path | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE
    max_chunk_tokens: int = 512
    document_unit: str = "chunk"
    """'chunk': whole paragraphs packed into documents of up to `max_chunk_tokens` (the paper's 512-token chunks).
    'paragraph': every paragraph is a document of its own, cut at `max_chunk_tokens` (short units whose
    translations are single documents; a deviation for small-scale runs)."""
    min_document_tokens: int = 1
    """Documents (chunks or paragraphs) with fewer text tokens are dropped and counted."""
    heldout_permille: int = 0
    """Groups per 1000 held out of training (chosen by a hash of the group: the same in every build) and written to
    `heldout/` for the health probes and retrieval P@1 of runs on this corpus; 0: none."""
    max_pairs_per_direction: int = 1000
    """Held-out translation pairs kept per language pair."""
    docs_per_shard: int = 512
    num_shards: int | None = None
    languages: tuple[str, ...] | None = None
    lid: bool = True
    lid_threshold: float = 0.5
    lid_min_chars: int = 20
    max_document_chars: int = 1_000_000
    on_bad_document: str = "error"
    seed: int = 0
    overwrite: bool = False
    tokenizer_sample_lines: int = 2_000_000
    """Lines the tokenizer is trained on, at most: an equal share per language, each share drawn at random (a hash of
    the seed and the line's place), so a language with more text than its share gets a uniform sample of it and not
    its first lines; a language with less gives all its lines. Lines are fed in corpus order."""
    engine: str = "auto"
    """'local': this process, the corpus in memory (small inputs); 'ray': streamed through Ray Data on the Ray
    cluster, memory bounded by the partition size, not the corpus; 'auto': 'ray' above `local_max_bytes` of input."""
    workers: int | None = None
    """Ray Data tasks per stage ('ray'); None: the CPUs of the Ray cluster."""
    local_max_bytes: int = 256 << 20
    """'auto' prepares input up to this many bytes on disk in this process, larger input on Ray Data."""
    partition_bytes: int = 32 << 20
    """'ray': bytes of documents per hash partition (the de-duplication and shard-writing units): what one task holds."""

    def __post_init__(self) -> None:
        self.inputs = [Path(p) for p in self.inputs]
        self.out = Path(self.out)
        if not self.inputs:
            raise PrepareError("no input given: pass JSONL files or language folders to `marge prepare`")
        if self.max_chunk_tokens < 3:
            raise PrepareError(f"--max-chunk-tokens must be at least 3 (BOS, a token, EOS), got {self.max_chunk_tokens}")
        if self.document_unit not in DOCUMENT_UNITS:
            raise PrepareError(f"--document-unit must be one of {list(DOCUMENT_UNITS)}, got {self.document_unit!r}")
        if not 0 <= self.heldout_permille < 1000:
            raise PrepareError(f"--heldout-permille must be in [0, 1000), got {self.heldout_permille}")
        if self.min_document_tokens < 1:
            raise PrepareError(f"--min-document-tokens must be at least 1, got {self.min_document_tokens}")
        if self.docs_per_shard < 1:
            raise PrepareError(f"--docs-per-shard must be positive, got {self.docs_per_shard}")
        if self.num_shards is not None and self.num_shards < 1:
            raise PrepareError(f"--num-shards must be positive, got {self.num_shards}")
        if self.on_bad_document not in ("error", "skip"):
            raise PrepareError(f"on_bad_document must be 'error' or 'skip', got {self.on_bad_document!r}")
        if self.engine not in ENGINES:
            raise PrepareError(f"--engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.workers is not None and self.workers < 1:
            raise PrepareError(f"--workers must be positive, got {self.workers}")
        if self.tokenizer_sample_lines < 1:
            raise PrepareError(f"--tokenizer-sample-lines must be positive, got {self.tokenizer_sample_lines}")
        if self.partition_bytes < 1 << 20:
            raise PrepareError(f"partition_bytes must be at least 1 MiB, got {self.partition_bytes}")
        if self.languages is not None:
            self.languages = tuple(normalize_language(lang) for lang in self.languages)


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


# --------------------------------------------------------------------------------------------------
# Checking, de-duplication, chunking, sharding
# --------------------------------------------------------------------------------------------------


def normalized_hash(text: str) -> bytes:
    norm = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return hashlib.sha1(norm.encode("utf-8")).digest()


def check_document(doc: RawDocument, opts: PrepareOptions) -> RawDocument:
    """The document with its language normalised, or PrepareError saying what is wrong."""
    try:
        lang = normalize_language(doc.lang)
    except ValueError as e:
        raise PrepareError(f"{doc.source}: field 'language': {e}") from None
    if not doc.text.strip():
        raise PrepareError(f"{doc.source}: field 'text' is empty; remove the document or give it text")
    for name, value in (("text", doc.text), ("id", doc.doc_id), ("group", doc.group)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PrepareError(f"{doc.source}: field {name!r} has a lone surrogate ({value[e.start]!r}) at character "
                               f"{e.start}, which is not text (a JSON escape like \\ud800 without its pair); fix "
                               "the producer of the file, or pass --skip-bad-documents") from None
    if len(doc.text) > opts.max_document_chars:
        raise PrepareError(f"{doc.source}: document has {len(doc.text):,} characters, more than --max-document-chars "
                           f"{opts.max_document_chars:,}; split it into smaller documents or raise the limit")
    if opts.lid and len(doc.text.strip()) >= opts.lid_min_chars:
        guess = identify(doc.text[:4000])
        if guess.lang != lang and guess.score >= opts.lid_threshold:
            raise PrepareError(f"{doc.source}: field 'language' says {lang!r} but language identification says "
                               f"{guess.lang!r} (confidence {guess.score:.2f}); fix the label, raise --lid-threshold, "
                               "or pass --no-lid to trust the labels")
    return RawDocument(doc.source, doc.doc_id, doc.group, lang, doc.text, doc.paragraph_ids, doc.order)


@dataclass
class Piece:
    """One document made from a raw document: its tokens, text and the ids of the paragraphs it holds."""

    tokens: list[int]
    text: str
    paragraph_ids: list[str]


def chunk_paragraphs(paragraphs: list[str], paragraph_tokens: list[list[int]], max_chunk_tokens: int,
                     tokenizer: MargeTokenizer, paragraph_ids: tuple[str, ...] | None = None) -> list[Piece]:
    """Greedily pack whole paragraphs into chunks of <= max_chunk_tokens - 2 tokens (BOS and EOS are
    added later); a paragraph longer than that is cut at token boundaries (each piece keeps its id)."""
    budget = max_text_tokens(max_chunk_tokens)
    ids = paragraph_ids or ("",) * len(paragraphs)
    chunks: list[Piece] = []
    current = Piece([], "", [])
    texts: list[str] = []

    def flush() -> None:
        nonlocal current
        if current.tokens:
            current.text = "\n\n".join(texts)
            chunks.append(current)
            current = Piece([], "", [])
            texts.clear()

    for text, toks, pid in zip(paragraphs, paragraph_tokens, ids):
        if not toks:
            continue
        if len(toks) > budget:
            flush()
            for start in range(0, len(toks), budget):
                piece = toks[start:start + budget]
                chunks.append(Piece(piece, tokenizer.decode(piece), [pid] if pid else []))
            continue
        if len(current.tokens) + len(toks) > budget:
            flush()
        current.tokens.extend(toks)
        if pid:
            current.paragraph_ids.append(pid)
        texts.append(text)
    flush()
    return chunks


def paragraph_documents(paragraphs: list[str], paragraph_tokens: list[list[int]], max_chunk_tokens: int,
                        tokenizer: MargeTokenizer, paragraph_ids: tuple[str, ...] | None = None) -> list[Piece]:
    """Every paragraph a document of its own, cut to max_chunk_tokens - 2 tokens (the text follows the cut)."""
    budget = max_text_tokens(max_chunk_tokens)
    ids = paragraph_ids or ("",) * len(paragraphs)
    out = []
    for text, toks, pid in zip(paragraphs, paragraph_tokens, ids):
        if not toks:
            continue
        if len(toks) > budget:
            toks = toks[:budget]
            text = tokenizer.decode(toks)
        out.append(Piece(list(toks), text, [pid] if pid else []))
    return out


def document_pieces(doc: RawDocument, tokenizer: MargeTokenizer, opts: PrepareOptions) -> tuple[list[Piece], int]:
    """The documents `doc` becomes (chunks, or paragraphs with `document_unit="paragraph"`), and how many of its
    paragraphs were cut at `max_chunk_tokens` (paragraph unit only)."""
    paragraphs = split_paragraphs(doc.text)
    paragraph_tokens = tokenizer.encode_batch(paragraphs)
    if opts.document_unit == "paragraph":
        budget = max_text_tokens(opts.max_chunk_tokens)
        cut = sum(len(t) > budget for t in paragraph_tokens)
        return paragraph_documents(paragraphs, paragraph_tokens, opts.max_chunk_tokens, tokenizer,
                                   doc.paragraph_ids), cut
    return chunk_paragraphs(paragraphs, paragraph_tokens, opts.max_chunk_tokens, tokenizer, doc.paragraph_ids), 0


class TokenizerSample:
    """The tokenizer's training lines: per language, the `per_language` lines with the smallest hash of (seed, the
    document's input order, the line's place in it). A uniform sample whatever order the input is in, and the same
    however the documents are split between workers: merging the samples of parts gives the sample of the whole."""

    def __init__(self, per_language: int, seed: int):
        self.per_language, self.seed = per_language, seed
        self.heaps: dict[str, list[tuple[int, int, int, str]]] = defaultdict(list)  # (-hash, -order, -line, text)
        self.lines_seen: Counter = Counter()

    @staticmethod
    def per_language_share(total: int, languages: int) -> int:
        return max(1, math.ceil(total / max(1, languages)))

    def add(self, lang: str, order: int, text: str) -> None:
        for i, line in enumerate(line for line in text.split("\n") if line.strip()):
            digest = hashlib.sha1(f"marge-tokenizer-sample:{self.seed}:{order}:{i}".encode()).digest()
            self._push(lang, (-int.from_bytes(digest[:8], "big"), -order, -i, line))
            self.lines_seen[lang] += 1

    def _push(self, lang: str, item: tuple[int, int, int, str]) -> None:
        heap = self.heaps[lang]
        if len(heap) < self.per_language:
            heapq.heappush(heap, item)
        elif item > heap[0]:  # a smaller hash than the largest kept
            heapq.heapreplace(heap, item)

    def merge(self, other: "TokenizerSample") -> None:
        for lang, heap in other.heaps.items():
            for item in heap:
                self._push(lang, item)
        self.lines_seen.update(other.lines_seen)

    def lines(self) -> list[str]:
        """The sampled lines in corpus order (document input order, then line)."""
        items = sorted((-order, -i, line) for heap in self.heaps.values() for _, order, i, line in heap)
        return [line for _, _, line in items]

    def summary(self) -> dict:
        return {lang: {"lines": self.lines_seen[lang], "sampled": len(self.heaps[lang])} for lang in sorted(self.heaps)}


def train_tokenizer(sample: TokenizerSample, languages: list[str], opts: PrepareOptions) -> MargeTokenizer:
    lines = sample.lines()
    log.info("training the tokenizer on %d sampled lines (%s)", len(lines),
             ", ".join(f"{lang} {s['sampled']}/{s['lines']}" for lang, s in sample.summary().items()))
    # SentencePiece keeps the first `input_sentence_size` lines it is given: never fewer than the sample (the
    # default is kept when the sample is smaller, as the setting is recorded in the model file and so in its sha256)
    tokenizer = MargeTokenizer.train(lines, languages, opts.vocab_size,
                                     input_sentence_size=max(len(lines), MargeTokenizer.DEFAULT_INPUT_SENTENCES))
    if tokenizer.vocab_size < opts.vocab_size / 2:
        log.warning("the tokenizer has %d pieces, far below the %d asked for (--vocab-size): this corpus holds no "
                    "more distinct pieces. The model's embeddings follow the tokenizer, so nothing breaks; pass "
                    "--vocab-size %d (or less) to get what you ask for, or prepare more text",
                    tokenizer.vocab_size, opts.vocab_size, tokenizer.vocab_size)
    return tokenizer


def load_tokenizer(opts: PrepareOptions, languages: list[str]) -> MargeTokenizer:
    """The tokenizer given with --tokenizer, checked to have a language token for each of `languages`."""
    tokenizer = MargeTokenizer.load(opts.tokenizer_dir)
    missing = sorted(set(languages) - set(tokenizer.languages))
    if missing:
        raise PrepareError(f"{opts.tokenizer_dir}: the tokenizer has no language token for {missing}; "
                           "train a new one (omit --tokenizer)")
    return tokenizer


def shard_columns(rows: list["_Chunk"], shard: int, first_doc_id: int) -> dict[str, list]:
    """The columns of one shard file: its chunks sorted by (group, language, chunk index), ids from `first_doc_id`."""
    rows = sorted(rows, key=lambda c: (c.group, c.lang, c.chunk_index))
    return {
        "doc_id": list(range(first_doc_id, first_doc_id + len(rows))),
        "doc_key": [c.doc_key for c in rows], "shard": [shard] * len(rows), "group": [c.group for c in rows],
        "lang": [c.lang for c in rows], "chunk_index": [c.chunk_index for c in rows],
        "num_chunks": [c.num_chunks for c in rows], "text": [c.text for c in rows],
        "tokens": [list(c.tokens) for c in rows], "num_tokens": [len(c.tokens) for c in rows],
        "source": [c.source for c in rows], "paragraph_ids": [list(c.paragraph_ids) for c in rows],
    }


def write_corpus_shard(folder: Path, shard: int, columns: dict[str, list]) -> dict:
    """Write one shard into the corpus folder being built; returns its manifest entry."""
    info = write_shard(folder / "shards" / f"shard-{shard:05d}.parquet", columns)
    info.file = f"shards/shard-{shard:05d}.parquet"
    info.shard = shard
    return asdict(info)


def corpus_manifest(opts: PrepareOptions, tokenizer: MargeTokenizer, shard_infos: list[dict], num_groups: int,
                    languages: Counter, num_tokens: int, aligned: int, stats: "_Stats", sample: dict | None,
                    engine: dict) -> dict:
    return {
        "format": CORPUS_FORMAT, "schema_version": CORPUS_SCHEMA_VERSION, "marge_version": __version__,
        "created_unix": int(time.time()), "num_documents": sum(s["rows"] for s in shard_infos),
        "num_shards": len(shard_infos), "num_groups": num_groups, "num_tokens": int(num_tokens),
        "languages": dict(sorted(languages.items())), "max_chunk_tokens": opts.max_chunk_tokens,
        "document_unit": opts.document_unit, "aligned_documents": int(aligned),
        "tokenizer": {"files": ["tokenizer.model", "tokenizer.json"], "sha256": tokenizer.sha256,
                      "vocab_size": tokenizer.vocab_size, **({"sample": sample} if sample is not None else {})},
        "inputs": [str(p) for p in opts.inputs],
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()
                    if k not in ("inputs", "out", "overwrite")},
        "engine": engine,
        "stats": {k: v for k, v in sorted(stats.counts.items()) if v}, "skipped_examples": stats.skipped[:20],
        "shards": shard_infos,
    }


def publish_corpus(opts: PrepareOptions, tokenizer: MargeTokenizer,
                   heldout: list[RawDocument] | Callable[[Path, int], dict | None],
                   write_shards: Callable[[Path], dict]) -> dict:
    """Write the corpus folder `opts.out` the way every artifact is written (`marge.artifacts`): in a temporary
    folder renamed into place, the tokenizer, the shards `write_shards(folder)` writes under `shards/` (it returns
    the manifest, `corpus_manifest`), the held-out split, and the manifest last. Returns the manifest. `heldout` is
    the held-out documents, or what writes them (`heldout(folder, training groups)`, returning the manifest's
    `heldout` or None when there are none: the Ray engine's workers write them)."""
    with publish_dir(opts.out, overwrite=opts.overwrite) as tmp:
        (tmp / "shards").mkdir()
        tokenizer.save(tmp)
        manifest = write_shards(tmp)
        if callable(heldout):
            written = heldout(tmp / HELDOUT_DIR, manifest["num_groups"])
            if written is not None:
                manifest["heldout"] = written
        elif heldout:
            manifest["heldout"] = write_heldout(tmp / HELDOUT_DIR, heldout, opts, manifest["num_groups"])
        write_manifest(tmp, manifest, ascii=False)
    return manifest


def assign_shards(group_sizes: dict[str, int], num_shards: int, seed: int) -> dict[str, int]:
    """Groups in random (seeded) order, each to the currently smallest shard: related documents stay
    together, unrelated ones are spread at random, shards stay about the same size."""
    groups = sorted(group_sizes)
    np.random.default_rng(seed).shuffle(groups)
    heap = [(0, s) for s in range(num_shards)]
    out = {}
    for g in groups:
        size, s = heapq.heappop(heap)
        out[g] = s
        heapq.heappush(heap, (size + group_sizes[g], s))
    return out


@dataclass
class _Chunk:
    group: str
    lang: str
    doc_key: str
    chunk_index: int
    num_chunks: int
    tokens: list[int]
    text: str
    source: str
    paragraph_ids: list[str]


@dataclass
class _Stats:
    counts: Counter = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)


def _collect(opts: PrepareOptions, stats: _Stats) -> list[RawDocument]:
    docs, seen = [], set()
    for raw in track(read_inputs(opts.inputs), "reading documents", unit="doc"):
        stats.counts["documents_read"] += 1
        try:
            if isinstance(raw, BadLine):
                raise raw.error
            doc = check_document(raw, opts)
        except PrepareError as e:
            if opts.on_bad_document == "error":
                raise PrepareError(f"{e} (or pass --skip-bad-documents to drop such documents)") from None
            stats.counts["documents_skipped_bad"] += 1
            if len(stats.skipped) < 100:
                stats.skipped.append(str(e))
            log.warning("skipping: %s", e)
            continue
        if opts.languages is not None and doc.lang not in opts.languages:
            stats.counts["documents_skipped_language"] += 1
            continue
        key = (doc.lang, normalized_hash(doc.text))
        if key in seen:
            stats.counts["documents_duplicate"] += 1
            continue
        seen.add(key)
        docs.append(doc)
    if not docs:
        raise PrepareError(f"no usable documents in {', '.join(map(str, opts.inputs))}")
    return docs


HELDOUT_DIR = "heldout"


def is_heldout_group(group: str, permille: int) -> bool:
    """Whether a group is held out: a hash of its name, so the same groups in every build of the same input."""
    return bool(permille) and int.from_bytes(hashlib.sha1(f"marge-heldout:{group}".encode()).digest()[:8], "big") % 1000 < permille


def heldout_pairs(docs: list[RawDocument], max_per_direction: int) -> list[tuple[str, str, str, str]]:
    """Translation pairs of the held-out groups in every language direction the groups cover (each unordered pair
    of languages once, the alphabetically first as the source; P@1 reads both ways): aligned paragraphs where the
    input numbers them (paragraph_ids), else the groups' whole documents (cut at 1,000 characters). At most
    `max_per_direction` pairs per pair of languages, groups in name order."""
    pairs = heldout_pairs_by_direction(docs, max_per_direction)
    return [pair for key in sorted(pairs) for _, pair in pairs[key]]


def heldout_pairs_by_direction(docs: list[RawDocument], max_per_direction: int
                               ) -> dict[tuple[str, str], list[tuple[str, tuple[str, str, str, str]]]]:
    """`heldout_pairs` by (source, target language), each pair with its group: the first `max_per_direction` pairs
    of each direction in (group name, place in the group) order. The pairs of a group depend on that group's
    documents alone, so the pairs of a set of whole groups split into parts are the first `max_per_direction` of each
    direction among the parts' own, merged in that order (how the Ray engine's workers write them)."""
    by_group: dict[str, dict[str, RawDocument]] = defaultdict(dict)
    for d in docs:
        by_group[d.group].setdefault(d.lang, d)
    pairs: dict[tuple[str, str], list[tuple[str, tuple[str, str, str, str]]]] = defaultdict(list)
    for group in sorted(by_group):
        versions = sorted(by_group[group].items())
        for i, (src_lang, source) in enumerate(versions):
            for tgt_lang, target in versions[i + 1:]:
                direction = pairs[(src_lang, tgt_lang)]
                if len(direction) >= max_per_direction:
                    continue
                if source.paragraph_ids and target.paragraph_ids:
                    theirs = dict(zip(target.paragraph_ids, split_paragraphs(target.text)))
                    for pid, text in zip(source.paragraph_ids, split_paragraphs(source.text)):
                        if pid in theirs and len(text.split()) >= 3 and text != theirs[pid]:
                            direction.append((group, (src_lang, text, tgt_lang, theirs[pid])))
                else:
                    direction.append((group, (src_lang, " ".join(source.text.split())[:1000], tgt_lang,
                                              " ".join(target.text.split())[:1000])))
    return {key: direction[:max_per_direction] for key, direction in pairs.items()}


def heldout_row(d: RawDocument) -> dict:
    """A held-out document as a line of `heldout/documents.jsonl.gz`."""
    return {"id": d.doc_id, "group": d.group, "language": d.lang, "text": d.text,
            **({"paragraph_ids": list(d.paragraph_ids)} if d.paragraph_ids else {})}


def pair_line(pair: tuple[str, str, str, str]) -> str:
    """A translation pair as a line of `heldout/pairs.tsv`."""
    return "\t".join(" ".join(cell.split()) for cell in pair) + "\n"


MIN_HELDOUT_GROUPS = 30
"""Fewer held-out pages than this measure P@1 with a 95% interval wider than +-0.18 (at P@1 0.5): prepare warns."""


def write_heldout(folder: Path, docs: list[RawDocument], opts: PrepareOptions, train_groups: int) -> dict:
    """The held-out groups as a documents JSONL (the page probe's and the aligned probe's input) and their translation
    pairs as a pairs TSV (retrieval P@1); returns what the manifest records of them. Warns, saying what to pass,
    when the split is too small to measure (`MIN_HELDOUT_GROUPS`) or has no pairs across languages."""
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "documents.jsonl.gz", "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(heldout_row(d), ensure_ascii=False) + "\n")
    pairs = heldout_pairs(docs, opts.max_pairs_per_direction)
    if pairs:
        with open(folder / "pairs.tsv", "w", encoding="utf-8", newline="\n") as f:
            for pair in pairs:
                f.write(pair_line(pair))
    return heldout_manifest(opts, len({d.group for d in docs}), len(docs), len(pairs), train_groups)


def heldout_manifest(opts: PrepareOptions, groups: int, documents: int, pairs: int, train_groups: int) -> dict:
    """What the manifest records of the held-out split written under `heldout/` (`write_heldout`); warns as it
    says."""
    if groups < MIN_HELDOUT_GROUPS or not pairs:
        wanted = min(999, math.ceil(MIN_HELDOUT_GROUPS * 1000 / max(1, groups + train_groups)))
        log.warning("the held-out split has %d groups and %d translation pairs: too few to measure retrieval P@1 "
                    "(over %d pages its 95%% interval is wider than +-0.18)%s; pass --heldout-permille %d (about %d "
                    "of the %d groups)", groups, pairs, MIN_HELDOUT_GROUPS,
                    "" if pairs else ", and no pairs across languages: documents need a shared `group`",
                    max(wanted, opts.heldout_permille), MIN_HELDOUT_GROUPS, groups + train_groups)
    return {"groups": groups, "documents": documents, "pairs": pairs,
            "permille": opts.heldout_permille, "documents_file": f"{HELDOUT_DIR}/documents.jsonl.gz",
            "pairs_file": f"{HELDOUT_DIR}/pairs.tsv" if pairs else None}


def input_bytes(inputs: list[Path], gzip_expansion: int = 1) -> int:
    """Bytes on disk of the inputs (files, and the files under folders), a .gz file's counted `gzip_expansion`
    times (an estimate of its text)."""
    total = 0
    for path in inputs:
        files = [p for _, p in folder_files(path)] if check_input(path) == "folder" else [path]
        total += sum(p.stat().st_size * (gzip_expansion if p.suffix == ".gz" else 1) for p in files)
    return total


def chosen_engine(opts: PrepareOptions) -> str:
    """'local' or 'ray': the engine `opts.engine` names, 'auto' by the size of the input."""
    if opts.engine != "auto":
        return opts.engine
    size = input_bytes(opts.inputs)
    engine = "ray" if size > opts.local_max_bytes else "local"
    log.info("%s of input: preparing it %s (engine=auto, local up to %s)", _mib(size),
             "on Ray Data" if engine == "ray" else "in this process", _mib(opts.local_max_bytes))
    return engine


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def prepare(opts: PrepareOptions, ray_address: str | None = None) -> dict:
    """Run the whole preparation on the engine `opts.engine` chooses; returns the manifest that was written.
    `ray_address`: the Ray cluster of the 'ray' engine (None: the one this process is connected to, RAY_ADDRESS, or a
    local Ray started for it)."""
    if opts.out.exists() and not opts.overwrite:
        raise PrepareError(f"{opts.out} already exists; choose another --out or pass --overwrite to replace it")
    for path in opts.inputs:
        check_input(path)
    if chosen_engine(opts) == "ray":
        from marge.prepare_ray import prepare_on_ray

        return prepare_on_ray(opts, ray_address)
    return prepare_locally(opts)


def prepare_locally(opts: PrepareOptions) -> dict:
    """The single-process engine: the whole corpus in this process's memory; for inputs of up to a few hundred MB."""
    started = time.time()
    stats = _Stats()
    docs = _collect(opts, stats)
    sample = TokenizerSample(TokenizerSample.per_language_share(opts.tokenizer_sample_lines,
                                                                len({d.lang for d in docs})), opts.seed)
    heldout = [d for d in docs if is_heldout_group(d.group, opts.heldout_permille)]
    docs = [d for d in docs if not is_heldout_group(d.group, opts.heldout_permille)]
    if not docs:
        raise PrepareError(f"--heldout-permille {opts.heldout_permille} held out every group: nothing left to train on")
    languages = sorted({d.lang for d in docs})
    log.info("%d documents in %d languages after checks and de-duplication", len(docs), len(languages))

    if opts.tokenizer_dir is not None:
        tokenizer, sample_summary = load_tokenizer(opts, languages), None
    else:
        for d in docs:
            sample.add(d.lang, d.order, d.text)
        tokenizer, sample_summary = train_tokenizer(sample, languages, opts), sample.summary()
        del sample

    chunks: list[_Chunk] = []
    seen_chunks = set()
    for doc in track(docs, "chunking", unit="doc"):
        pieces, cut = document_pieces(doc, tokenizer, opts)
        stats.counts["paragraphs_cut"] += cut
        for i, piece in enumerate(pieces):
            if len(piece.tokens) < opts.min_document_tokens:
                stats.counts["documents_too_short"] += 1
                continue
            key = (doc.lang, normalized_hash(piece.text))
            if key in seen_chunks:
                stats.counts["chunks_duplicate"] += 1
                continue
            seen_chunks.add(key)
            chunks.append(_Chunk(doc.group, doc.lang, f"{doc.doc_id}#{i}", i, len(pieces), piece.tokens, piece.text,
                                 doc.source, piece.paragraph_ids))
    if not chunks:
        raise PrepareError("every chunk was a duplicate or empty; nothing to write")

    group_sizes = Counter(c.group for c in chunks)
    num_shards = opts.num_shards or max(1, math.ceil(len(chunks) / opts.docs_per_shard))
    num_shards = min(num_shards, len(group_sizes))
    shard_of = assign_shards(dict(group_sizes), num_shards, opts.seed)
    by_shard: dict[int, list[_Chunk]] = defaultdict(list)
    for c in chunks:
        by_shard[shard_of[c.group]].append(c)

    def write_shards(folder: Path) -> dict:
        next_id = 0
        shard_infos = []
        for s in track(range(num_shards), "writing shards", unit="shard"):
            shard_infos.append(write_corpus_shard(folder, s, shard_columns(by_shard[s], s, next_id)))
            next_id += len(by_shard[s])
        return corpus_manifest(
            opts, tokenizer, shard_infos, len(group_sizes), Counter(c.lang for c in chunks),
            sum(len(c.tokens) for c in chunks), sum(bool(c.paragraph_ids) for c in chunks), stats, sample_summary,
            {"name": "local", "shard_assignment": "balanced"})

    manifest = publish_corpus(opts, tokenizer, heldout, write_shards)
    log.info("wrote %d chunks in %d shards to %s in %.1f s", manifest["num_documents"], num_shards, opts.out,
             time.time() - started)
    return manifest
