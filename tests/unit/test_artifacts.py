"""The artifact contract (marge.contracts.artifacts): a folder is published whole or not at all, its manifest commits it,
readers refuse what they do not know or what does not match its checksums, LATEST names only committed folders
and only moves forward, and deleting versions never leaves LATEST on a missing one. Then the four artifacts
that use it keep their on-disk formats: manifests and LATEST pointers written before the shared module read,
and what is written now has the same fields, order and layout. Pure filesystem, no Ray, no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marge.contracts import artifacts
from marge.util.files import sha256_file

SERIES = artifacts.Series("v[0-9]*", lambda name: int(name[1:]), pointer_field="version", what="test artifact")


def committed(root: Path, name: str, files: dict[str, bytes] | None = None, **fields) -> Path:
    """A committed version folder: its files, then the manifest with their sha256."""
    folder = root / name
    folder.mkdir(parents=True)
    files = {"data.bin": name.encode()} if files is None else files
    for file, data in files.items():
        (folder / file).write_bytes(data)
    artifacts.write_manifest(folder, {"format": "test", "version": 1, **fields,
                                      "sha256": artifacts.file_sha256s(folder, files)})
    return folder


def read(folder: Path, verify: bool = True) -> dict:
    return artifacts.read_manifest(folder, "test", (1,), checksums=(lambda m: m["sha256"]) if verify else None,
                                   what="test artifact")


def visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# --- manifests --------------------------------------------------------------------------------------------


def test_a_folder_without_a_manifest_is_not_listed_and_not_read(tmp_path):
    committed(tmp_path, "v000001")
    (tmp_path / "v000002").mkdir()  # files written, manifest not yet (or never)
    (tmp_path / "v000002" / "data.bin").write_bytes(b"half")
    (tmp_path / "v1x").mkdir()  # matches the pattern but carries no version number
    assert [p.name for p in SERIES.versions(tmp_path)] == ["v000001"]
    with pytest.raises(artifacts.ArtifactError, match=r"v000002.manifest\.json is missing: .*not a complete test"):
        read(tmp_path / "v000002")


def test_versions_sort_by_their_number(tmp_path):
    for number in (10, 9, 100):
        committed(tmp_path, f"v{number}")
    assert [p.name for p in SERIES.versions(tmp_path)] == ["v9", "v10", "v100"]


def test_a_checksum_mismatch_is_refused_naming_the_file(tmp_path):
    folder = committed(tmp_path, "v000001", {"weights.bin": b"good", "config.json": b"{}"})
    assert read(folder)["format"] == "test"
    (folder / "weights.bin").write_bytes(b"evil")
    with pytest.raises(artifacts.ArtifactError, match=r"weights\.bin: sha256 differs from manifest\.json"):
        read(folder)
    assert read(folder, verify=False)["format"] == "test"  # verification is the reader's choice
    (folder / "config.json").unlink()
    with pytest.raises(artifacts.ArtifactError, match=r"config\.json is missing"):
        artifacts.verify_checksums(folder, {"config.json": "0" * 64})


def test_an_unknown_format_or_version_is_refused_naming_the_field_and_value(tmp_path):
    folder = committed(tmp_path, "v000001")
    with pytest.raises(artifacts.ArtifactError, match=r"manifest\.json: format is 'test', expected 'other'"):
        artifacts.read_manifest(folder, "other", (1,))
    with pytest.raises(artifacts.ArtifactError, match=r"manifest\.json: version 1 is not supported .*\[2, 3\]"):
        artifacts.read_manifest(folder, "test", (2, 3))
    with pytest.raises(artifacts.ArtifactError, match=r"manifest\.json: field 'step' is missing; do this"):
        artifacts.read_manifest(folder, "test", (1,), fields=("step",), hint="; do this")


def test_a_torn_manifest_is_refused_with_the_artifacts_own_error(tmp_path):
    class MyError(artifacts.ArtifactError):
        pass

    folder = committed(tmp_path, "v000001")
    (folder / "manifest.json").write_text('{"format": "te')
    with pytest.raises(MyError, match=r"manifest\.json cannot be read"):
        artifacts.read_manifest(folder, "test", (1,), error=MyError)
    (folder / "manifest.json").write_text("[]")
    with pytest.raises(MyError, match="a JSON object expected"):
        artifacts.read_manifest(folder, "test", (1,), error=MyError)


def test_the_manifest_is_written_as_given_with_a_format(tmp_path):
    manifest = {"format": "test", "version": 1, "b": 2, "a": 1}
    artifacts.write_manifest(tmp_path, manifest)
    assert (tmp_path / "manifest.json").read_text() == json.dumps(manifest, indent=2) + "\n"
    with pytest.raises(ValueError, match="format"):
        artifacts.write_manifest(tmp_path, {"version": 1})


def test_a_file_missing_when_the_manifest_is_written_is_named(tmp_path):
    with pytest.raises(artifacts.ArtifactError, match=r"absent\.bin is missing"):
        artifacts.file_sha256s(tmp_path, ["absent.bin"])


# --- publishing -------------------------------------------------------------------------------------------


def test_a_published_folder_appears_whole(tmp_path):
    target = tmp_path / "v000001"
    with artifacts.publish_dir(target) as tmp:
        (tmp / "data.bin").write_bytes(b"x")
        assert not target.exists()  # nothing visible while it is being built
        artifacts.write_manifest(tmp, {"format": "test", "version": 1,
                                       "sha256": artifacts.file_sha256s(tmp, ["data.bin"])})
    assert visible(tmp_path) == ["v000001"]
    assert read(target)["sha256"]["data.bin"] == sha256_file(target / "data.bin")


def test_a_crash_mid_publish_leaves_no_visible_folder(tmp_path):
    with pytest.raises(RuntimeError, match="killed"):
        with artifacts.publish_dir(tmp_path / "v000001") as tmp:
            (tmp / "data.bin").write_bytes(b"x")
            raise RuntimeError("killed")
    assert visible(tmp_path) == []  # neither the target nor its temporary folder


def test_a_crash_mid_republish_keeps_the_old_folder(tmp_path):
    old = committed(tmp_path, "v000001")
    with pytest.raises(RuntimeError):
        with artifacts.publish_dir(old, overwrite=True) as tmp:
            (tmp / "data.bin").write_bytes(b"new")
            raise RuntimeError("killed")
    assert visible(tmp_path) == ["v000001"] and (old / "data.bin").read_bytes() == b"v000001"
    read(old)


def test_a_folder_built_without_its_manifest_is_not_published(tmp_path):
    with pytest.raises(artifacts.ArtifactError, match="without its manifest.json"):
        with artifacts.publish_dir(tmp_path / "v000001") as tmp:
            (tmp / "data.bin").write_bytes(b"x")
    assert visible(tmp_path) == []


def test_a_staged_folder_commits_only_with_its_manifest_and_replaces_a_rerun(tmp_path):
    staging = tmp_path / ".staging-v000001"
    staging.mkdir()
    (staging / "data.bin").write_bytes(b"first")
    with pytest.raises(artifacts.ArtifactError, match="has no manifest.json"):
        artifacts.commit_staged(staging, tmp_path / "v000001")
    assert not (tmp_path / "v000001").exists()
    artifacts.write_manifest(staging, {"format": "test", "version": 1,
                                       "sha256": artifacts.file_sha256s(staging, ["data.bin"])})
    artifacts.commit_staged(staging, tmp_path / "v000001")
    assert visible(tmp_path) == ["v000001"]

    staging.mkdir()  # the same version built again (a crash before LATEST moved)
    (staging / "data.bin").write_bytes(b"second")
    artifacts.write_manifest(staging, {"format": "test", "version": 1,
                                       "sha256": artifacts.file_sha256s(staging, ["data.bin"])})
    artifacts.commit_staged(staging, tmp_path / "v000001")
    assert visible(tmp_path) == ["v000001"]  # no staging left, no old copy left
    assert (tmp_path / "v000001" / "data.bin").read_bytes() == b"second"
    read(tmp_path / "v000001")


# --- LATEST ----------------------------------------------------------------------------------------------


def test_latest_never_points_at_a_half_written_folder(tmp_path):
    assert SERIES.latest(tmp_path) is None
    (tmp_path / "v000001").mkdir()
    with pytest.raises(artifacts.ArtifactError, match=r"v000001: has no manifest\.json"):
        SERIES.set_latest(tmp_path, "v000001")
    assert not (tmp_path / "LATEST").exists()
    with artifacts.publish_dir(tmp_path / "v000002") as tmp:
        artifacts.write_manifest(tmp, {"format": "test", "version": 1, "sha256": {}})
        with pytest.raises(artifacts.ArtifactError):  # not renamed into place yet
            SERIES.set_latest(tmp_path, "v000002")
    assert SERIES.set_latest(tmp_path, "v000002")
    assert SERIES.latest(tmp_path) == tmp_path / "v000002"


def test_latest_moves_only_forward_and_keeps_its_format(tmp_path):
    for name in ("v000001", "v000002", "v000003"):
        committed(tmp_path, name)
    assert SERIES.set_latest(tmp_path, "v000002")
    assert not SERIES.set_latest(tmp_path, "v000001")  # a slow writer does not move readers back
    assert not SERIES.set_latest(tmp_path, "v000002")
    assert (tmp_path / "LATEST").read_text() == '{"version": 2, "dir": "v000002"}\n'
    assert SERIES.set_latest(tmp_path, "v000003")
    assert (tmp_path / "LATEST").read_text() == '{"version": 3, "dir": "v000003"}\n'


def test_a_damaged_latest_is_named(tmp_path):
    committed(tmp_path, "v000001")
    (tmp_path / "LATEST").write_text("{")
    with pytest.raises(artifacts.ArtifactError, match=r"LATEST cannot be read"):
        SERIES.latest(tmp_path)
    (tmp_path / "LATEST").write_text('{"step": 1, "dir": "v000001"}')
    with pytest.raises(artifacts.ArtifactError, match=r"LATEST: expected \{'version'"):
        SERIES.latest(tmp_path)


# --- deleting versions ------------------------------------------------------------------------------------


def test_prune_keeps_the_newest_n_and_the_one_latest_names(tmp_path):
    for number in range(1, 6):
        committed(tmp_path, f"v{number:06d}")
    SERIES.set_latest(tmp_path, "v000005")
    assert SERIES.prune(tmp_path, 2) == [1, 2, 3]
    assert visible(tmp_path) == ["LATEST", "v000004", "v000005"]
    assert SERIES.prune(tmp_path, 0) == [] and SERIES.prune(tmp_path, 5) == []

    (tmp_path / "LATEST").write_text('{"version": 4, "dir": "v000004"}\n')  # LATEST behind the newest
    committed(tmp_path, "v000006")
    assert SERIES.prune(tmp_path, 1) == [5]
    assert visible(tmp_path) == ["LATEST", "v000004", "v000006"]


def test_prune_clears_an_interrupted_deletion_but_not_a_newer_unfinished_folder(tmp_path):
    (tmp_path / "v000001").mkdir()  # a deletion that stopped half-way: manifest gone, files left
    (tmp_path / "v000001" / "data.bin").write_bytes(b"x")
    committed(tmp_path, "v000002")
    committed(tmp_path, "v000003")
    (tmp_path / "v000004").mkdir()  # newer than everything kept: left alone
    assert SERIES.prune(tmp_path, 2) == [1]
    assert visible(tmp_path) == ["v000002", "v000003", "v000004"]


def test_drop_after_removes_later_versions_and_moves_latest_back(tmp_path):
    for number in range(1, 5):
        committed(tmp_path, f"v{number:06d}", built_from=number * 10)
    SERIES.set_latest(tmp_path, "v000004")
    assert SERIES.drop_after(tmp_path, 20, key=lambda p: read(p)["built_from"]) == [3, 4]
    assert visible(tmp_path) == ["LATEST", "v000001", "v000002"]
    assert (tmp_path / "LATEST").read_text() == '{"version": 2, "dir": "v000002"}\n'
    assert SERIES.drop_after(tmp_path, 20) == []  # nothing later: LATEST untouched
    assert SERIES.drop_after(tmp_path, 0) == [1, 2]
    assert visible(tmp_path) == []  # no version left, no LATEST either


def test_a_series_without_a_pointer_lists_but_never_writes_latest(tmp_path):
    plain = artifacts.Series("step-*", lambda name: int(name.split("-")[1]), what="test artifact")
    for step in (1, 2, 3):
        committed(tmp_path, f"step-{step:08d}")
    assert plain.drop_after(tmp_path, 1) == [2, 3]
    assert visible(tmp_path) == ["step-00000001"]
    with pytest.raises(TypeError):
        plain.set_latest(tmp_path, "step-00000001")


# --- the four artifacts keep their formats ----------------------------------------------------------------


def test_index_versions_keep_their_manifest_and_latest(tmp_path):
    from marge.contracts.index_store import (
        IndexStoreError,
        commit_version,
        drop_versions_after,
        latest_version,
        read_version,
        staging_dir,
    )

    def stage(version: int, faiss: bool = True) -> list[dict]:
        staging = staging_dir(tmp_path, version)
        staging.mkdir(parents=True)
        (staging / "graph-00000.parquet").write_bytes(b"graph %d" % version)
        if faiss:
            (staging / "shard-00000.faiss").write_bytes(b"faiss %d" % version)
        return [{"shard": 0, "graph_file": "graph-00000.parquet", "index_file": "shard-00000.faiss" if faiss else None,
                 "num_documents": 3, "num_edges": 4, "cross_lingual_edges": 1}]

    committed0 = commit_version(tmp_path, 0, 0, stage(0), extra={"search": "faiss"})
    text = (committed0.path / "manifest.json").read_text()
    manifest = json.loads(text)
    assert text == json.dumps(manifest, indent=2) + "\n"
    assert list(manifest) == ["format", "schema_version", "version", "snapshot_step", "created_unix", "shards",
                              "num_documents", "num_edges", "cross_lingual_edges", "search"]
    assert list(manifest["shards"][0]) == ["shard", "graph_file", "index_file", "num_documents", "num_edges",
                                           "cross_lingual_edges", "graph_file_sha256", "index_file_sha256"]
    assert (tmp_path / "LATEST").read_text() == '{"version": 0, "dir": "v000000"}\n'
    read_version(committed0.path).verify()

    for version in range(1, 5):
        commit_version(tmp_path, version, version * 10, stage(version, faiss=version % 2 == 0), keep_versions=3)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v000002", "v000003", "v000004"]
    assert latest_version(tmp_path).version == 4 and latest_version(tmp_path).shards[0]["index_file"] is not None
    assert read_version(tmp_path / "v000003").shards[0]["index_file"] is None  # built without FAISS
    read_version(tmp_path / "v000003").verify()

    assert drop_versions_after(tmp_path, 25) == [3, 4]
    assert json.loads((tmp_path / "LATEST").read_text()) == {"version": 2, "dir": "v000002"}
    (tmp_path / "v000002" / "graph-00000.parquet").write_bytes(b"torn")
    with pytest.raises(IndexStoreError, match=r"graph-00000\.parquet: sha256 differs"):
        latest_version(tmp_path).verify()


def test_an_index_version_written_before_the_shared_module_reads(tmp_path):
    from marge.contracts.index_store import latest_version

    folder = tmp_path / "v000007"
    folder.mkdir()
    (folder / "graph-00000.parquet").write_bytes(b"g")
    manifest = {"format": "marge-index", "schema_version": 1, "version": 7, "snapshot_step": 70, "created_unix": 1.0,
                "shards": [{"shard": 0, "graph_file": "graph-00000.parquet", "index_file": None, "num_documents": 1,
                            "num_edges": 0, "cross_lingual_edges": 0,
                            "graph_file_sha256": sha256_file(folder / "graph-00000.parquet")}],
                "num_documents": 1, "num_edges": 0, "cross_lingual_edges": 0}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (tmp_path / "LATEST").write_text(json.dumps({"version": 7, "dir": "v000007"}) + "\n")
    version = latest_version(tmp_path)
    assert (version.version, version.snapshot_step) == (7, 70)
    version.verify()


def old_snapshot(root: Path, step: int) -> Path:
    """A snapshot folder as marge wrote it before the shared module (the bytes stand in for the tensors)."""
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / "relevance.safetensors").write_bytes(b"tensors %d" % step)
    manifest = {"format": "marge-relevance-snapshot", "version": 1, "step": step, "model_config": {},
                "tokenizer_sha256": "t" * 64, "weights_sha256": sha256_file(folder / "relevance.safetensors"),
                "created_unix": 1.0}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (root / "LATEST").write_text(json.dumps({"step": step, "dir": folder.name}) + "\n")
    return folder


def test_snapshots_written_before_the_shared_module_read_and_drop(tmp_path):
    from marge.model.snapshot import SnapshotError, drop_snapshots_after, latest_snapshot, read_snapshot

    for step in (0, 100, 200):
        old_snapshot(tmp_path, step)
    assert latest_snapshot(tmp_path).step == 200
    assert read_snapshot(tmp_path / "step-00000100").manifest["tokenizer_sha256"] == "t" * 64
    assert drop_snapshots_after(tmp_path, 100) == [200]
    assert (tmp_path / "LATEST").read_text() == '{"step": 100, "dir": "step-00000100"}\n'
    (tmp_path / "step-00000100" / "relevance.safetensors").write_bytes(b"flipped")
    with pytest.raises(SnapshotError, match=r"relevance\.safetensors: sha256 differs"):
        read_snapshot(tmp_path / "step-00000100")
    assert drop_snapshots_after(tmp_path, -1) == [0, 100]
    assert latest_snapshot(tmp_path) is None


def test_checkpoint_manifests_keep_their_fields_and_order(tmp_path):
    from marge.model.checkpoint import CheckpointError, complete_checkpoints, read_manifest, write_manifest

    root = tmp_path / "checkpoints"
    for name in ("step-00000012-1", "step-00000006", "step-00000012", "step-junk"):
        (root / name).mkdir(parents=True)
        (root / name / "model.safetensors").write_bytes(name.encode())
        write_manifest(root / name, "marge-checkpoint", ("model.safetensors",), step=12)
    (root / "step-00000018").mkdir()  # being written: no manifest yet
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000006", "step-00000012", "step-00000012-1"]

    text = (root / "step-00000006" / "manifest.json").read_text()
    manifest = json.loads(text)
    assert text == json.dumps(manifest, indent=2) + "\n"
    assert list(manifest) == ["format", "version", "step", "created_unix", "sha256"]
    assert read_manifest(root / "step-00000006")["sha256"] == {"model.safetensors": sha256_file(
        root / "step-00000006" / "model.safetensors")}
    with pytest.raises(CheckpointError, match=r"step-00000018.manifest\.json is missing.*marge pretrain"):
        read_manifest(root / "step-00000018")
    with pytest.raises(CheckpointError, match="format is 'marge-checkpoint', expected 'marge-finetuned'"):
        read_manifest(root / "step-00000006", formats=("marge-finetuned",))
    (root / "step-00000006" / "model.safetensors").write_bytes(b"corrupt")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 differs"):
        read_manifest(root / "step-00000006")
    read_manifest(root / "step-00000006", verify=False)


def test_a_corpus_manifest_is_refused_naming_the_field_and_what_to_do(tmp_path):
    from marge.contracts.corpus import Corpus, CorpusError

    manifest = {"format": "marge-corpus", "schema_version": 1, "shards": [], "tokenizer": {}, "languages": {},
                "num_documents": 0}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert Corpus.open(tmp_path).num_shards == 0  # a version-1 corpus still reads
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 3}))
    with pytest.raises(CorpusError, match=r"schema_version 3 is not supported .*\[1, 2\].*marge prepare"):
        Corpus.open(tmp_path)
    del manifest["tokenizer"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorpusError, match=r"field 'tokenizer' is missing"):
        Corpus.open(tmp_path)
    with pytest.raises(CorpusError, match=r"does not exist\).*run `marge prepare"):
        Corpus.open(tmp_path / "nowhere")
