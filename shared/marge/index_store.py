"""Versioned indexes: what the indexer publishes and the batcher and retrieval service read.

    index/
      LATEST                       {"version": 3, "dir": "v000003"}   (written after the version folder)
      .staging-v000004/            a version being built (never read)
      v000003/
        manifest.json              written last: version, snapshot step, shards, checksums, stats
        shard-00000.faiss          IndexIDMap2(IndexFlatIP) over g(z) of the shard's documents (cosine);
                                   absent (index_file null) in a version built without FAISS
                                   (`marge experiment learning --single-process`)
        graph-00000.parquet        the shard's kept links: target_id, evidence_id, score, cross_lingual

A version becomes visible by renaming its complete staging folder; LATEST moves only forward.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marge.utils import atomic_write_text, fsync_dir, sha256_file

INDEX_FORMAT = "marge-index"
INDEX_SCHEMA_VERSION = 1

GRAPH_SCHEMA = pa.schema([
    pa.field("target_id", pa.int64(), nullable=False),
    pa.field("evidence_id", pa.int64(), nullable=False),
    pa.field("score", pa.float32(), nullable=False),
    pa.field("cross_lingual", pa.bool_(), nullable=False),
])


class IndexStoreError(ValueError):
    """A published index is incomplete or corrupt (the message names the file)."""


@dataclass(frozen=True)
class IndexVersion:
    version: int
    path: Path
    manifest: dict[str, Any]

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
        for s in self.shards:
            for key in ("graph_file", "index_file"):
                if s.get(key) is None:
                    continue
                path = self.path / s[key]
                if not path.exists():
                    raise IndexStoreError(f"{path} is missing from index version {self.version}")
                if sha256_file(path) != s[f"{key}_sha256"]:
                    raise IndexStoreError(f"{path}: sha256 does not match the manifest (corrupt index file)")


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
        for key in ("graph_file", "index_file"):
            if key == "index_file" and entry.get(key) is None:
                continue  # built without FAISS: links only
            path = staging / entry[key]
            if not path.exists():
                raise IndexStoreError(f"{path}: staged shard file is missing; cannot commit index version {version}")
            entry[f"{key}_sha256"] = sha256_file(path)
        entries.append(entry)
    manifest = {"format": INDEX_FORMAT, "schema_version": INDEX_SCHEMA_VERSION, "version": version,
                "snapshot_step": snapshot_step, "created_unix": time.time(), "shards": entries,
                "num_documents": int(sum(e["num_documents"] for e in entries)),
                "num_edges": int(sum(e["num_edges"] for e in entries)),
                "cross_lingual_edges": int(sum(e["cross_lingual_edges"] for e in entries)), **(extra or {})}
    atomic_write_text(staging / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    final = root / version_dirname(version)
    if final.exists():
        shutil.rmtree(final)  # a re-run of the same version (after a crash before LATEST moved)
    staging.rename(final)
    fsync_dir(root)
    current = latest_version(root)
    if current is None or current.version < version:
        atomic_write_text(root / "LATEST", json.dumps({"version": version, "dir": final.name}) + "\n")
    _prune(root, keep_versions)
    return IndexVersion(version, final, manifest)


def _prune(root: Path, keep: int) -> None:
    current = latest_version(root)
    versions = sorted(p for p in root.glob("v[0-9]*") if p.is_dir())
    for old in versions[:-keep] if keep > 0 else []:
        if current is None or old.name != current.path.name:
            shutil.rmtree(old, ignore_errors=True)


def drop_versions_after(root: Path, snapshot_step: int) -> list[int]:
    """Delete the versions built from snapshots of updates after `snapshot_step` (a resumed run's discarded
    lineage) and point LATEST at the newest one left. Returns the versions deleted."""
    root = Path(root)
    dropped = []
    for path in sorted(root.glob("v[0-9]*")):
        if (path / "manifest.json").exists() and read_version(path).snapshot_step > snapshot_step:
            shutil.rmtree(path)
            dropped.append(int(path.name[1:]))
    if dropped:
        kept = sorted(p for p in root.glob("v[0-9]*") if (p / "manifest.json").exists())
        if kept:
            atomic_write_text(root / "LATEST", json.dumps({"version": int(kept[-1].name[1:]), "dir": kept[-1].name}) + "\n")
        else:
            (root / "LATEST").unlink(missing_ok=True)
    return dropped


def read_version(path: Path) -> IndexVersion:
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise IndexStoreError(f"{manifest_path} is missing: {path} is not a committed index version")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if manifest.get("format") != INDEX_FORMAT or manifest.get("schema_version") != INDEX_SCHEMA_VERSION:
        raise IndexStoreError(f"{manifest_path}: not a schema-{INDEX_SCHEMA_VERSION} {INDEX_FORMAT} manifest")
    return IndexVersion(int(manifest["version"]), path, manifest)


def latest_version(root: Path) -> IndexVersion | None:
    pointer = Path(root) / "LATEST"
    if not pointer.exists():
        return None
    latest = json.loads(pointer.read_text(encoding="utf-8"))
    return read_version(Path(root) / latest["dir"])
