"""The prepared corpus: versioned Parquet shards plus a manifest, and a reader that validates both.

Layout of a prepared corpus folder (written by `marge prepare` the way every artifact is, marge.contracts.artifacts: in a
temporary folder renamed into place, manifest last):

    manifest.json               format, schema version, shards with row counts and sha256, tokenizer
    tokenizer.model / .json     the SentencePiece model the `tokens` column was made with
    shards/shard-00000.parquet  one file per shard

One row per document chunk (a "document" in the paper's sense: <= max_chunk_tokens tokens):

    doc_id       int64   unique in the corpus; FAISS ids and batch messages use it
    doc_key      string  human-readable: "<source document id>#<chunk index>"
    shard        int32   shard number; all chunks of a group share it
    group        string  what related documents share (the same page in every language)
    lang         string  ISO 639-1
    chunk_index  int32   position of the chunk in its source document
    num_chunks   int32   chunks of the source document
    text         string  the chunk's text
    tokens       list<int32>  tokenizer ids of `text`, without BOS/EOS
    num_tokens   int32   len(tokens)
    source       string  "<file>:<line>" or the source file path, for error messages and provenance
    paragraph_ids list<string>  ids of the input paragraphs the document holds, shared by their translations
                             in the group (empty when the input gave none). Measurement only (aligned link
                             precision, the aligned oracle): training never reads them. Schema version 2;
                             a version-1 corpus (without the column) reads with no ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marge.contracts import artifacts
from marge.contracts.languages import ISO_639_1
from marge.util.files import sha256_file

log = logging.getLogger(__name__)

CORPUS_FORMAT = "marge-corpus"
CORPUS_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)

CORPUS_SCHEMA_V1 = pa.schema([
    pa.field("doc_id", pa.int64(), nullable=False),
    pa.field("doc_key", pa.string(), nullable=False),
    pa.field("shard", pa.int32(), nullable=False),
    pa.field("group", pa.string(), nullable=False),
    pa.field("lang", pa.string(), nullable=False),
    pa.field("chunk_index", pa.int32(), nullable=False),
    pa.field("num_chunks", pa.int32(), nullable=False),
    pa.field("text", pa.string(), nullable=False),
    pa.field("tokens", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
    pa.field("num_tokens", pa.int32(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
])
CORPUS_SCHEMA = pa.schema(
    [*CORPUS_SCHEMA_V1, pa.field("paragraph_ids", pa.list_(pa.field("item", pa.string(), nullable=False)), nullable=False)],
    metadata={b"marge.format": CORPUS_FORMAT.encode(), b"marge.schema_version": str(CORPUS_SCHEMA_VERSION).encode()})
SCHEMAS = {1: CORPUS_SCHEMA_V1, 2: CORPUS_SCHEMA}
MANIFEST_FIELDS = ("shards", "tokenizer", "languages", "num_documents")
REBUILD = ". Re-run `marge prepare` to rebuild the corpus."


def split_paragraphs(text: str) -> list[str]:
    """A raw document's paragraphs (separated by a blank line), whitespace collapsed, empty ones dropped: the
    units `paragraph_ids` number."""
    paras = [" ".join(p.split()) for p in text.replace("\r\n", "\n").split("\n\n")]
    return [p for p in paras if p]


class CorpusError(artifacts.ArtifactError):
    """A corpus file is missing, corrupt or does not follow the schema. The message names the file."""


@dataclass
class ShardInfo:
    shard: int
    file: str
    rows: int
    tokens: int
    sha256: str


@dataclass
class ShardDocuments:
    """One shard in memory, as numpy arrays (what the indexer and batcher work on)."""

    shard: int
    doc_ids: np.ndarray  # int64
    langs: np.ndarray  # object (str)
    groups: np.ndarray  # object (str)
    tokens: list[np.ndarray]  # int32 each
    texts: list[str]
    paragraph_ids: list[tuple[str, ...]] | None = None
    """Input paragraph ids per document (None: the corpus has none). For measurement, never for training."""

    def __len__(self) -> int:
        return len(self.doc_ids)

    @property
    def aligned(self) -> bool:
        return self.paragraph_ids is not None and any(self.paragraph_ids)

    def translations(self, i: int, j: int) -> bool:
        """Whether documents i and j (positions in the shard) hold the same paragraph of one page in two
        languages: aligned content, not merely the same page."""
        if self.paragraph_ids is None or self.groups[i] != self.groups[j] or self.langs[i] == self.langs[j]:
            return False
        return not set(self.paragraph_ids[i]).isdisjoint(self.paragraph_ids[j])


def _fail(path: Path, problem: str) -> CorpusError:
    return CorpusError(f"{path}: {problem}{REBUILD}")


class Corpus:
    """A prepared corpus folder. Opening it checks the manifest; reading a shard checks the shard."""

    def __init__(self, root: Path, manifest: dict[str, Any], verify_checksums: bool = True):
        self.root = Path(root)
        self.manifest = manifest
        self.shards = [ShardInfo(**s) for s in manifest["shards"]]
        self.verify_checksums = verify_checksums

    @classmethod
    def open(cls, root: Path | str, verify_checksums: bool = True) -> "Corpus":
        root = Path(root)
        manifest = artifacts.read_manifest(
            root, CORPUS_FORMAT, READABLE_SCHEMA_VERSIONS, version_field="schema_version", fields=MANIFEST_FIELDS,
            what="prepared corpus", hint=f"; run `marge prepare INPUT --out {root}` to (re)build it", error=CorpusError)
        corpus = cls(root, manifest, verify_checksums)
        for info in corpus.shards:
            if not (root / info.file).exists():
                raise _fail(root / info.file, "listed in manifest.json but missing")
        return corpus

    def heldout_file(self, kind: str) -> Path | None:
        """The corpus's held-out split (`marge prepare --heldout-permille`): its `documents` JSONL or its translation
        `pairs` TSV, or None when it was prepared without one (or has no pairs: a single language)."""
        heldout = self.manifest.get("heldout") or {}
        name = heldout.get(f"{kind}_file")
        return self.root / name if name else None

    def probe_home(self, path: str | Path) -> str | None:
        """Where a probe file comes from, if it is this corpus's: "held-out split" (inside the corpus folder) or
        "inputs" (inside, or beside, one of the inputs it was prepared from, the way a dataset ships its held-out
        files next to its documents; relative inputs are read from the current directory, as `marge prepare`
        was given them); None for a file from anywhere else."""
        probe = Path(path).resolve()
        if probe.is_relative_to(self.root.resolve()):
            return "held-out split"
        for given in self.manifest.get("inputs", []):
            source = Path(given).resolve()
            folder = source if source.is_dir() else source.parent
            if probe.is_relative_to(folder):
                return "inputs"
        return None

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def languages(self) -> list[str]:
        return sorted(self.manifest["languages"])

    def tokenizer(self):
        from marge.contracts.tokenizer import MargeTokenizer

        tok = MargeTokenizer.load(self.root)
        if tok.sha256 != self.manifest["tokenizer"]["sha256"]:
            raise _fail(self.root / "tokenizer.model", "does not match the tokenizer sha256 in manifest.json")
        return tok

    def read_table(self, shard: int, verify_checksum: bool | None = None) -> pa.Table:
        """Shard `shard`, validated; its sha256 checked against the manifest unless `verify_checksum` is False
        (default: the corpus's `verify_checksums`), e.g. when a reader has checked this file before."""
        info = self.shards[shard]
        path = self.root / info.file
        verify = self.verify_checksums if verify_checksum is None else verify_checksum
        if verify:
            artifacts.verify_checksums(self.root, {info.file: info.sha256}, what="prepared corpus", hint=REBUILD,
                                       error=CorpusError)
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise _fail(path, f"not a readable Parquet file ({e})") from None
        validate_table(table, path, vocab_size=self.manifest["tokenizer"]["vocab_size"],
                       schema_version=self.manifest["schema_version"])
        if table.num_rows != info.rows:
            raise _fail(path, f"has {table.num_rows} rows, manifest.json says {info.rows}")
        if table.num_rows and set(table.column("shard").to_pylist()) != {info.shard}:
            raise _fail(path, f"rows belong to shards {sorted(set(table.column('shard').to_pylist()))}, expected {info.shard}")
        return table

    def read_shard(self, shard: int, verify_checksum: bool | None = None) -> ShardDocuments:
        table = self.read_table(shard, verify_checksum)
        tokens_col = table.column("tokens").combine_chunks()
        offsets = tokens_col.offsets.to_numpy()
        flat = tokens_col.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
        tokens = [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        return ShardDocuments(
            shard=self.shards[shard].shard,
            doc_ids=table.column("doc_id").to_numpy(),
            langs=np.array(table.column("lang").to_pylist(), dtype=object),
            groups=np.array(table.column("group").to_pylist(), dtype=object),
            tokens=tokens,
            texts=table.column("text").to_pylist(),
            paragraph_ids=([tuple(ids) for ids in table.column("paragraph_ids").to_pylist()]
                           if "paragraph_ids" in table.column_names else None),
        )


def validate_table(table: pa.Table, path: Path, vocab_size: int | None = None,
                   schema_version: int = CORPUS_SCHEMA_VERSION) -> None:
    """Raise CorpusError naming the file, column and row for anything that breaks the schema (of the version the
    corpus manifest gives)."""
    expected = {f.name: f.type for f in SCHEMAS[schema_version]}
    actual = {f.name: f.type for f in table.schema}
    missing = [name for name in expected if name not in actual]
    if missing:
        raise _fail(path, f"column(s) {missing} missing (has {sorted(actual)})")
    for name, typ in expected.items():
        if actual[name] != typ:
            raise _fail(path, f"column {name!r} has type {actual[name]}, expected {typ}")
    version = (table.schema.metadata or {}).get(b"marge.schema_version")
    if version is not None and version != str(schema_version).encode():
        raise _fail(path, f"schema version {version.decode()} is not {schema_version} (what manifest.json says)")
    for name in expected:
        nulls = table.column(name).null_count
        if nulls:
            row = table.column(name).is_null().to_pylist().index(True)
            raise _fail(path, f"column {name!r} has {nulls} null value(s), first at row {row}")
    langs = table.column("lang").to_pylist()
    for row, lang in enumerate(langs):
        if lang not in ISO_639_1:
            raise _fail(path, f"row {row}: lang {lang!r} is not an ISO 639-1 code")
    ids = table.column("doc_id").to_numpy()
    if len(np.unique(ids)) != len(ids):
        raise _fail(path, "column 'doc_id' has duplicate values")
    tokens = table.column("tokens").combine_chunks()
    lengths = np.diff(tokens.offsets.to_numpy())
    num_tokens = table.column("num_tokens").to_numpy()
    bad = np.nonzero(lengths != num_tokens)[0]
    if len(bad):
        raise _fail(path, f"row {int(bad[0])}: num_tokens {int(num_tokens[bad[0]])} != len(tokens) {int(lengths[bad[0]])}")
    empty = np.nonzero(lengths == 0)[0]
    if len(empty):
        raise _fail(path, f"row {int(empty[0])}: empty document (no tokens)")
    if vocab_size is not None and len(tokens.values):
        values = tokens.values.to_numpy(zero_copy_only=False)
        if values.min() < 0 or values.max() >= vocab_size:
            raise _fail(path, f"column 'tokens' has ids outside the tokenizer's vocabulary 0..{vocab_size - 1}")


def write_shard(path: Path, rows: dict[str, list]) -> ShardInfo:
    """Write one shard table (columns as lists). The caller publishes the folder atomically."""
    table = pa.Table.from_pydict(rows, schema=CORPUS_SCHEMA)
    validate_table(table, path)
    pq.write_table(table, path, compression="zstd")
    shards = set(rows["shard"])
    return ShardInfo(shard=int(next(iter(shards))) if shards else -1, file=str(path), rows=table.num_rows,
                     tokens=int(sum(rows["num_tokens"])), sha256=sha256_file(path))
