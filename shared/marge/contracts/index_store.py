"""Versioned indexes: what the indexer publishes and the batcher and retrieval service read.

    index/
      LATEST                       {"version": 3, "dir": "v000003"}   (written after the version folder)
      .staging-v000004/            a version being built (never read)
      v000003/
        manifest.json              written last: version, snapshot step, shards, checksums, stats
        shard-00000.faiss          IndexIDMap2(IndexFlatIP) over g(z) of the shard's documents (cosine);
                                   absent (index_file null) in a version built without FAISS
                                   (`marge pretrain --single-process`)
        graph-00000.parquet        the shard's kept links: target_id, evidence_id, score, cross_lingual

A version is published the way every artifact is (marge.contracts.artifacts), except that its folder is a fixed
staging name the indexer workers fill before the coordinator commits it: checksums into the manifest, the
manifest last, one rename, then LATEST, which moves only forward. This module keeps the schema: which files,
which manifest fields.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marge.contracts import artifacts

INDEX_FORMAT = "marge-index"
INDEX_SCHEMA_VERSION = 1
MANIFEST_FIELDS = ("version", "snapshot_step", "shards")
SHARD_FILES = ("graph_file", "index_file")
"""A shard entry's files; each has its sha256 beside it as `<key>_sha256`. `index_file` is None without FAISS."""

GRAPH_SCHEMA = pa.schema([
    pa.field("target_id", pa.int64(), nullable=False),
    pa.field("evidence_id", pa.int64(), nullable=False),
    pa.field("score", pa.float32(), nullable=False),
    pa.field("cross_lingual", pa.bool_(), nullable=False),
])


class IndexStoreError(artifacts.ArtifactError):
    """A published index is incomplete or corrupt (the message names the file)."""


class IndexVersion(artifacts.Artifact):
    """A committed index version: `number` is its version."""

    @property
    def version(self) -> int:
        return self.number

    @property
    def snapshot_step(self) -> int:
        return int(self.manifest["snapshot_step"])

    @property
    def shards(self) -> list[dict[str, Any]]:
        return self.manifest["shards"]

    def read_graph(self, shard: int | None = None) -> pa.Table:
        """Links of one shard, or of every shard concatenated."""
        shards = self.shards if shard is None else [s for s in self.shards if s["shard"] == shard]
        tables = []
        for s in shards:
            path = self.path / s["graph_file"]
            table = pq.read_table(path)
            if not table.schema.equals(GRAPH_SCHEMA, check_metadata=False):
                raise IndexStoreError(f"{path}: graph schema {table.schema} differs from the expected {GRAPH_SCHEMA}")
            tables.append(table)
        return pa.concat_tables(tables) if tables else GRAPH_SCHEMA.empty_table()

    def read_faiss(self, shard: int):
        import faiss

        (entry,) = [s for s in self.shards if s["shard"] == shard]
        if entry.get("index_file") is None:
            raise IndexStoreError(f"{self.path}: index version {self.version} was built without FAISS (single-process "
                                  "run): it has link graphs but no searchable index; serve an index built by the pipeline")
        return faiss.read_index(str(self.path / entry["index_file"]))

    def verify(self) -> None:
        artifacts.verify_checksums(self.path, shard_digests(self.manifest), what=f"index version {self.version}",
                                   error=IndexStoreError)


def shard_digests(manifest: dict[str, Any]) -> dict[str, str]:
    """{file: sha256} of every shard file an index manifest lists."""
    return {s[key]: s[f"{key}_sha256"] for s in manifest["shards"] for key in SHARD_FILES if s.get(key) is not None}


def flat_ip_index(unit: np.ndarray, doc_ids: np.ndarray):
    """The index format of a shard: an exact inner-product FAISS index (on unit vectors: the cosine f) whose
    ids are the corpus doc ids."""
    import faiss

    index = faiss.IndexIDMap2(faiss.IndexFlatIP(unit.shape[1]))
    index.add_with_ids(np.ascontiguousarray(unit, dtype=np.float32), np.asarray(doc_ids, dtype=np.int64))
    return index


def version_dirname(version: int) -> str:
    return f"v{version:06d}"


def staging_dir(root: Path, version: int) -> Path:
    return Path(root) / f".staging-{version_dirname(version)}"


def write_graph(path: Path, target_ids: np.ndarray, evidence_ids: np.ndarray, scores: np.ndarray,
                cross_lingual: np.ndarray) -> None:
    table = pa.Table.from_arrays([pa.array(target_ids, pa.int64()), pa.array(evidence_ids, pa.int64()),
                                  pa.array(scores, pa.float32()), pa.array(cross_lingual, pa.bool_())],
                                 schema=GRAPH_SCHEMA)
    pq.write_table(table, path)


def _version_of(name: str) -> int:
    return int(name[1:])


VERSIONS = artifacts.Series("v[0-9]*", _version_of, pointer_field="version", what="index version",
                            error=IndexStoreError)


def commit_version(root: Path, version: int, snapshot_step: int, shard_entries: list[dict[str, Any]],
                   extra: dict[str, Any] | None = None, keep_versions: int = 3) -> IndexVersion:
    """Checksum the staged shard files, write the manifest, rename the folder into place, move LATEST.

    Older versions beyond `keep_versions` are deleted (never the one LATEST points at).
    """
    root = Path(root)
    staging = staging_dir(root, version)
    entries = []
    for entry in sorted(shard_entries, key=lambda e: e["shard"]):
        entry = dict(entry)
        # built without FAISS, a shard has links only (index_file None); a graph file it always has
        files = [entry["graph_file"]] + ([entry["index_file"]] if entry.get("index_file") is not None else [])
        digests = artifacts.file_sha256s(staging, files, what=f"index version {version}", error=IndexStoreError)
        for key in SHARD_FILES:
            if entry.get(key) is not None:
                entry[f"{key}_sha256"] = digests[entry[key]]
        entries.append(entry)
    manifest = artifacts.write_manifest(staging, {
        "format": INDEX_FORMAT, "schema_version": INDEX_SCHEMA_VERSION, "version": version,
        "snapshot_step": snapshot_step, "created_unix": time.time(), "shards": entries,
        "num_documents": int(sum(e["num_documents"] for e in entries)),
        "num_edges": int(sum(e["num_edges"] for e in entries)),
        "cross_lingual_edges": int(sum(e["cross_lingual_edges"] for e in entries)), **(extra or {})})
    final = artifacts.commit_staged(staging, root / version_dirname(version), error=IndexStoreError)
    VERSIONS.set_latest(root, final.name)
    VERSIONS.prune(root, keep_versions)
    return IndexVersion(version, final, manifest)


def drop_versions_after(root: Path, snapshot_step: int) -> list[int]:
    """Delete the versions built from snapshots of updates after `snapshot_step` (a resumed run's discarded
    lineage) and point LATEST at the newest one left. Returns the versions deleted."""
    return VERSIONS.drop_after(root, snapshot_step, key=lambda path: read_version(path).snapshot_step)


def read_version(path: Path) -> IndexVersion:
    path = Path(path)
    manifest = artifacts.read_manifest(path, INDEX_FORMAT, (INDEX_SCHEMA_VERSION,), version_field="schema_version",
                                       fields=MANIFEST_FIELDS, what="index version", error=IndexStoreError)
    return IndexVersion(int(manifest["version"]), path, manifest)


def latest_version(root: Path) -> IndexVersion | None:
    path = VERSIONS.latest(root)
    return None if path is None else read_version(path)
