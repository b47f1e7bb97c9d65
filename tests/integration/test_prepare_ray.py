"""`marge prepare --engine ray`: the single-process engine's documents and tokens, from Ray Data, with a file per
partition in its work folder, a large plain JSONL read by byte range and a bounded account of the bad lines; and the
tokenizer's language-balanced sample that both engines draw.

These need a server or take long; the quick tests of this subject are in tests/unit/test_prepare_ray_merging.py (no server)."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest
from prepare_inputs import ENGLISH, GERMAN, assert_nothing_written, good_rows, write_jsonl  # tests/prepare_inputs.py

from marge.contracts.corpus import Corpus
from marge.contracts.documents import PrepareError, RawDocument
from services.prepare import ray_engine, ray_reading
from services.prepare.options import PrepareOptions
from services.prepare.run import prepare


def corpus_documents(path: Path) -> set[tuple]:
    """Every document of a prepared corpus as it is trained on, apart from its shard and doc id."""
    corpus = Corpus.open(path)
    out = set()
    for s in range(corpus.num_shards):
        for r in corpus.read_table(s).to_pylist():
            out.add((r["doc_key"], r["group"], r["lang"], r["chunk_index"], r["num_chunks"], r["text"],
                     tuple(r["tokens"]), r["num_tokens"], r["source"], tuple(r["paragraph_ids"])))
    return out


def assert_same_corpus(local: Path, ray: Path) -> None:
    a, b = Corpus.open(local).manifest, Corpus.open(ray).manifest
    assert a["engine"]["name"] == "local" and b["engine"]["name"] == "ray"
    assert corpus_documents(local) == corpus_documents(ray)
    for key in ("num_documents", "num_groups", "num_tokens", "languages", "aligned_documents", "stats", "tokenizer",
                "heldout", "max_chunk_tokens", "document_unit", "skipped_examples"):
        assert a.get(key) == b.get(key), key
    assert (local / "tokenizer.model").read_bytes() == (ray / "tokenizer.model").read_bytes()
    for name in ("documents.jsonl.gz", "pairs.tsv"):
        if (local / "heldout" / name).exists():
            read = gzip.open if name.endswith(".gz") else open
            with read(local / "heldout" / name, "rb") as x, read(ray / "heldout" / name, "rb") as y:
                assert x.read() == y.read(), name
    shards = Corpus.open(ray)
    group_shard = {}
    for s in range(shards.num_shards):
        table = shards.read_table(s)
        assert set(table.column("shard").to_pylist()) == {s}
        for group in table.column("group").to_pylist():
            assert group_shard.setdefault(group, s) == s, "a group is split across shards"
    ids = sorted(i for s in range(shards.num_shards) for i in shards.read_table(s).column("doc_id").to_pylist())
    assert ids == list(range(len(ids)))


def assert_a_file_per_partition(ray: Path) -> None:
    """The work folder held at most one file per partition in each of its folders (a file per block and partition
    would be many more: the inputs of these tests have several blocks per partition)."""
    engine = Corpus.open(ray).manifest["engine"]
    files = engine["intermediate_files"]
    assert 0 < files["clean"] <= engine["document_partitions"], engine
    assert files["heldout"] <= engine["document_partitions"], engine
    assert 0 < files["chunks-clean"] <= engine["chunk_partitions"], engine


def both(tmp_path: Path, inputs: list[Path], **kw) -> tuple[Path, Path]:
    for engine in ("local", "ray"):
        prepare(PrepareOptions(inputs=inputs, out=tmp_path / engine, engine=engine, workers=2, **kw))
    return tmp_path / "local", tmp_path / "ray"


@pytest.mark.slow
def test_the_demo_corpus_has_the_same_documents_and_tokens_on_both_engines(ray_cluster, demo_raw, tmp_path):
    # 1 MiB partitions: the demo is de-duplicated in several partitions and its shards written by several tasks
    local, ray = both(tmp_path, [demo_raw / "documents.jsonl.gz"], vocab_size=4000, docs_per_shard=400,
                      max_chunk_tokens=128, heldout_permille=300, partition_bytes=1 << 20)
    assert_same_corpus(local, ray)
    manifest = Corpus.open(ray).manifest
    assert manifest["engine"]["document_partitions"] > 1 and manifest["engine"]["shard_groups"] > 1
    assert_a_file_per_partition(ray)
    assert manifest["heldout"]["documents"] > 100 and manifest["heldout"]["pairs"] > 100
    assert manifest["num_documents"] > 4000
    assert not list(tmp_path.glob(".*")), "the work folder is removed"


def test_paragraph_documents_languages_and_bad_lines_skipped_alike(ray_cluster, tmp_path):
    rows = [*good_rows(),
            {"id": "p2-en", "group": "p2", "language": "en", "text": f"{ENGLISH}\n\n{ENGLISH} Again.\n\nOk"},
            {"id": "p2-fr", "group": "p2", "language": "fr", "text": "Le tableur calcule la somme de la colonne."},
            {"id": "dup", "group": "p3", "language": "de", "text": f"  {GERMAN.upper()} "},  # a duplicate
            {"id": "bad", "group": "p4", "language": "xx", "text": "Unknown language."},
            {"id": "mislabelled", "group": "p4", "language": "de", "text": ENGLISH * 2}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    with open(path, "a", encoding="utf-8") as f:
        f.write("{not json\n\n")
    local, ray = both(tmp_path, [path], vocab_size=600, document_unit="paragraph", min_document_tokens=5,
                      max_chunk_tokens=16, languages=("en", "de", "zh"), on_bad_document="skip")
    assert_same_corpus(local, ray)
    stats = Corpus.open(ray).manifest["stats"]
    assert stats["documents_skipped_bad"] == 3 and stats["documents_skipped_language"] == 1
    assert stats["documents_duplicate"] == 1 and stats["paragraphs_cut"] >= 1 and stats["documents_too_short"] >= 1


def test_html_folders_on_both_engines(ray_cluster, tmp_path):
    root = tmp_path / "site"
    for lang, text in (("en", ENGLISH), ("de", GERMAN)):
        for page in range(3):
            (root / lang / "guide").mkdir(parents=True, exist_ok=True)
            (root / lang / "guide" / f"page{page}.html").write_text(
                f"<html><body><h1>{page}</h1><p>{text} {page}</p></body></html>", encoding="utf-8")
    local, ray = both(tmp_path, [root], vocab_size=600)
    assert_same_corpus(local, ray)
    assert Corpus.open(ray).manifest["num_groups"] == 3


def test_a_bad_document_stops_the_ray_engine_naming_the_first_one_and_nothing_is_left(ray_cluster, tmp_path):
    rows = good_rows() + [{"id": "x", "language": "en"}, {"id": "y", "text": "No language."}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises(PrepareError, match=r"bad\.jsonl:4: field 'text' is missing.*--skip-bad-documents"):
        prepare(PrepareOptions(inputs=[path], out=out, engine="ray", vocab_size=600))
    assert_nothing_written(out)
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in good_rows()).encode())[:-20])
    with pytest.raises(PrepareError, match=r"cut\.jsonl\.gz:\d+: cannot be read"):
        prepare(PrepareOptions(inputs=[truncated], out=out, engine="ray", vocab_size=600))
    assert_nothing_written(out)


def test_a_large_plain_jsonl_is_read_by_byte_range_with_a_file_per_partition_and_bad_lines_counted(
        ray_cluster, demo_raw, tmp_path, monkeypatch, caplog):
    """A plain JSONL of several MiB: read by several tasks (byte ranges of 256 KiB), checked in several blocks per
    partition, with more bad lines than the driver keeps the errors of: the corpus, the statistics and the first
    skipped errors are the single-process engine's, and the driver warns of the first SKIPPED_KEPT and counts the
    others."""
    path = tmp_path / "big.jsonl"
    with gzip.open(demo_raw / "documents.jsonl.gz", "rt", encoding="utf-8") as demo, \
            open(path, "w", encoding="utf-8") as f:
        for i, line in enumerate(demo):
            if i == 1500:
                break
            f.write(line)
            if i % 9 == 0:  # a bad line (no text) every few, 167 in all
                f.write(json.dumps({"id": f"bad{i}", "language": "en"}) + "\n")
    assert path.stat().st_size > 3 << 20
    monkeypatch.setattr(ray_engine, "READ_SPLIT_BYTES", 256 << 10)  # read in the driver, which plans the reads
    with caplog.at_level(logging.WARNING, logger="services.prepare.ray_engine"):
        local, ray = both(tmp_path, [path], vocab_size=2000, max_chunk_tokens=128, heldout_permille=100,
                          partition_bytes=1 << 20, on_bad_document="skip")
    assert_same_corpus(local, ray)
    manifest = Corpus.open(ray).manifest
    assert manifest["engine"]["read_tasks"] == -(-path.stat().st_size // (256 << 10))
    assert manifest["engine"]["document_partitions"] >= 3
    assert_a_file_per_partition(ray)
    assert manifest["stats"]["documents_skipped_bad"] >= 167 and len(manifest["skipped_examples"]) == 20
    warned = [r.getMessage() for r in caplog.records if r.name == "services.prepare.ray_engine"]
    assert sum(m.startswith("skipping: ") for m in warned) == ray_reading.SKIPPED_KEPT
    assert f"skipping {manifest['stats']['documents_skipped_bad'] - ray_reading.SKIPPED_KEPT} more bad" in "".join(warned)


# --- the tokenizer's sample ---------------------------------------------------------------------------


def documents(lang: str, count: int, lines: int, start: int = 0) -> list[RawDocument]:
    return [RawDocument(f"f:{start + i}", f"{lang}{i}", f"g{i}", lang,
                        "\n".join(f"{lang} line {j} of document {i}" for j in range(lines)), order=start + i)
            for i in range(count)]


def test_the_driver_prepares_a_missing_corpus_on_ray_data_with_the_configured_sample(ray_cluster, tmp_path):
    from services.driver.config import load_config
    from services.driver.pipeline import ensure_corpus

    path = write_jsonl(tmp_path / "in.jsonl", good_rows())
    cfg = load_config(None, [f"data.corpus={tmp_path / 'corpus'}", f"data.raw=[{path}]", "data.vocab_size=600",
                             "data.prepare_engine=ray", "data.prepare_workers=1", "data.tokenizer_sample_lines=2"])
    manifest = ensure_corpus(cfg).manifest
    assert manifest["engine"]["name"] == "ray" and manifest["engine"]["workers"] == 1
    assert manifest["tokenizer"]["sample"] == {lang: {"lines": 1, "sampled": 1} for lang in ("de", "en", "zh")}
