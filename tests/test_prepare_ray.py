"""`marge prepare --engine ray`: the single-process engine's documents and tokens, from Ray Data, with a file per
partition in its work folder, a large plain JSONL read by byte range and a bounded account of the bad lines; and the
tokenizer's language-balanced sample that both engines draw."""

from __future__ import annotations

import gzip
import json
import logging
import pickle
import random
from pathlib import Path

import pytest

from services.prepare import ray_engine, ray_reading
from marge.contracts.corpus import Corpus
from marge.contracts.documents import PrepareError, RawDocument, jsonl_lines
from services.prepare.options import PrepareOptions
from services.prepare.core import TokenizerSample
from services.prepare.run import prepare
from services.prepare.ray_reading import Rejected, first_lines, jsonl_range_lines, line_starts, read_tasks
from test_prepare import ENGLISH, GERMAN, assert_nothing_written, good_rows, write_jsonl  # tests/test_prepare.py


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


def test_the_byte_ranges_of_a_file_give_its_lines_and_their_numbers(tmp_path):
    """Every split of a file (ranges of 1 byte to more than the file) gives what one reader gives: each line once,
    numbered alike, wherever a range starts (in a line, on its newline, in a multi-byte character, on a blank line,
    in a final line without a newline)."""
    lines = [b'{"id": "a", "text": "caf\xc3\xa9 \xe7\x94\xb5\xe5\xad\x90"}\n', b"\n", b"\r\n",
             b'{"id": "b"}\n', b"\n", b'{"id": "long", "text": "' + b"x" * 300 + b'"}\n', b'{"id": "c"}']
    for name, content in (("no-final-newline.jsonl", b"".join(lines)), ("final-newline.jsonl", b"".join(lines) + b"\n"),
                          ("blank-end.jsonl", b"".join(lines) + b"\n\n")):
        path = tmp_path / name
        path.write_bytes(content)
        whole = list(jsonl_lines(path))
        assert len(whole) == content.count(b"\n") + (not content.endswith(b"\n"))
        for split in [*range(1, 40), 97, 331, len(content) - 1]:
            tasks = read_tasks([path], split)
            assert [t["byte_range"] for t in tasks][-1][1] == len(content)
            first_lines(tasks, {i: line_starts(path, *t["byte_range"]) for i, t in enumerate(tasks)})
            pieces = [list(jsonl_range_lines(path, *t["byte_range"], t["first_line"])) for t in tasks]
            assert [item for piece in pieces for item in piece] == whole, (name, split)
    gz = tmp_path / "big.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(lines) * 10))
    assert read_tasks([gz], 10) == [{"kind": "jsonl", "input": 0, "path": str(gz)}]  # a gzip stream is read whole


def test_the_reports_of_parts_merge_into_the_report_of_the_whole_and_stay_bounded():
    """However the input's blocks are split between tasks, the driver gets the counts of all of them and the errors of
    the first SKIPPED_KEPT bad lines in input order, never more."""
    rng = random.Random(0)
    bad = rng.sample(range(10_000), 500)
    whole = Rejected(read=10_000, skipped_language=7)
    for order in bad:
        whole.add_bad(order, f"line {order}: bad")
    parts = [Rejected() for _ in range(6)]
    for order in bad:
        part = rng.choice(parts)
        part.add_bad(order, f"line {order}: bad")
        part.read += 1
    parts[0].read += 10_000 - len(bad)
    parts[3].skipped_language += 7
    parts[4].add_fatal(9_000, "late.jsonl: unreadable")
    parts[2].add_fatal(12, "early.jsonl: unreadable")
    merged = Rejected()
    for part in parts:
        merged.merge(Rejected.from_json(part.to_json()))  # as the reducers and the driver get them
    assert (merged.read, merged.skipped_language, merged.skipped_bad) == (10_000, 7, 500)
    assert merged.first_fatal == (12, "early.jsonl: unreadable")
    assert merged.first_bad == [(o, f"line {o}: bad") for o in sorted(bad)[:ray_reading.SKIPPED_KEPT]]
    assert len(json.loads(whole.to_json())["first_bad"]) == ray_reading.SKIPPED_KEPT


def test_auto_picks_the_engine_by_input_size(tmp_path):
    from services.prepare.run import chosen_engine

    path = write_jsonl(tmp_path / "in.jsonl", good_rows())
    size = path.stat().st_size
    assert chosen_engine(PrepareOptions(inputs=[path], out=tmp_path / "o", local_max_bytes=size)) == "local"
    assert chosen_engine(PrepareOptions(inputs=[path], out=tmp_path / "o", local_max_bytes=size - 1)) == "ray"
    with pytest.raises(PrepareError, match="--engine must be one of"):
        PrepareOptions(inputs=[path], out=tmp_path / "o", engine="spark")


# --- the tokenizer's sample ---------------------------------------------------------------------------


def documents(lang: str, count: int, lines: int, start: int = 0) -> list[RawDocument]:
    return [RawDocument(f"f:{start + i}", f"{lang}{i}", f"g{i}", lang,
                        "\n".join(f"{lang} line {j} of document {i}" for j in range(lines)), order=start + i)
            for i in range(count)]


def test_merging_the_samples_of_parts_gives_the_sample_of_the_whole():
    docs = documents("en", 300, 4) + documents("de", 50, 3, start=300)
    whole = TokenizerSample(200, seed=7)
    for d in docs:
        whole.add(d.lang, d.order, d.text)
    parts = [TokenizerSample(200, seed=7) for _ in range(4)]
    for d in random.Random(0).sample(docs, len(docs)):
        parts[hash(d.doc_id) % 4].add(d.lang, d.order, d.text)
    merged = TokenizerSample(200, seed=7)
    for part in parts:
        merged.merge(part)
    assert merged.lines() == whole.lines()
    assert whole.summary() == {"de": {"lines": 150, "sampled": 150}, "en": {"lines": 1200, "sampled": 200}}


def test_a_language_sorted_corpus_gets_a_balanced_uniform_sample():
    """The first lines in file order would be English only; the sample takes an equal share of each language, drawn
    from the whole of each, and keeps corpus order."""
    docs = documents("en", 1000, 2) + documents("de", 1000, 2, start=1000)
    sample = TokenizerSample(TokenizerSample.per_language_share(400, 2), seed=0)
    for d in docs:
        sample.add(d.lang, d.order, d.text)
    lines = sample.lines()
    assert len(lines) == 400 and sum(line.startswith("de") for line in lines) == 200
    english = [int(line.split()[-1]) for line in lines if line.startswith("en")]
    assert english == sorted(english)  # corpus order
    assert 300 < sum(english) / len(english) < 700  # drawn from the whole language, not its first documents
    other_seed = TokenizerSample(200, seed=1)
    for d in docs:
        other_seed.add(d.lang, d.order, d.text)
    assert other_seed.lines() != lines


def test_the_tokenizer_sample_bounds_the_lines_the_local_engine_trains_on(tmp_path):
    rows = [{"id": f"en{i}", "group": f"g{i}", "language": "en", "text": f"{ENGLISH} {i}"} for i in range(40)]
    rows += [{"id": f"de{i}", "group": f"g{i}", "language": "de", "text": f"{GERMAN} {i}"} for i in range(5)]
    path = write_jsonl(tmp_path / "sorted.jsonl", rows)
    manifest = prepare(PrepareOptions(inputs=[path], out=tmp_path / "c", vocab_size=600, tokenizer_sample_lines=20,
                                      engine="local"))
    assert manifest["tokenizer"]["sample"] == {"de": {"lines": 5, "sampled": 5}, "en": {"lines": 40, "sampled": 10}}


def test_the_driver_prepares_a_missing_corpus_on_ray_data_with_the_configured_sample(ray_cluster, tmp_path):
    from services.driver.config import load_config
    from services.driver.pipeline import ensure_corpus

    path = write_jsonl(tmp_path / "in.jsonl", good_rows())
    cfg = load_config(None, [f"data.corpus={tmp_path / 'corpus'}", f"data.raw=[{path}]", "data.vocab_size=600",
                             "data.prepare_engine=ray", "data.prepare_workers=1", "data.tokenizer_sample_lines=2"])
    manifest = ensure_corpus(cfg).manifest
    assert manifest["engine"]["name"] == "ray" and manifest["engine"]["workers"] == 1
    assert manifest["tokenizer"]["sample"] == {lang: {"lines": 1, "sampled": 1} for lang in ("de", "en", "zh")}


def test_held_out_pairs_staged_by_group_partition_merge_into_the_single_process_files(tmp_path):
    """The workers' held-out split (`_heldout_pairs` per partition of groups, `_write_heldout` merging the staged
    files) is the file `write_heldout` writes from every document at once, with the per-direction cap biting."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from services.prepare.core import write_heldout

    docs = []
    for i in range(60):  # groups in several languages, some aligned by paragraph, some in one language only
        for lang in ("de", "en", "fr")[: 1 + i % 3]:
            aligned = i % 4 == 0
            text = "\n\n".join(f"{lang} paragraph {p} of page {i} with words" for p in range(2))
            docs.append(RawDocument(f"s{i}", f"{lang}{i}", f"page-{(i * 7) % 60:02d}", lang, text,
                                    ("p0", "p1") if aligned else None, order=len(docs)))
    docs.append(RawDocument("s", "en-again", "page-03", "en", "a second English page 3", None, order=len(docs)))
    opts = PrepareOptions(inputs=[tmp_path], out=tmp_path / "out", heldout_permille=500, max_pairs_per_direction=9)
    expected = write_heldout(tmp_path / "local", docs, opts, train_groups=10)

    def table(part: list[RawDocument]) -> pa.Table:
        return pa.Table.from_pylist([{"order": d.order, "source": d.source, "doc_id": d.doc_id, "group": d.group,
                                      "lang": d.lang, "text": d.text, "paragraph_ids": d.paragraph_ids}
                                     for d in part])

    (tmp_path / "work" / "heldout-pairs").mkdir(parents=True)
    staged, pair_files, groups = [], [], 0
    for k in range(3):  # documents staged as the de-duplication does (three partitions, each in input order) ...
        staged.append(str(tmp_path / f"docs-{k}.parquet"))
        pq.write_table(table([d for d in docs if d.order % 3 == k]), staged[-1], row_group_size=5)
    for k in range(4):  # ... and shuffled by group into four partitions, each given in another order
        part = [d for d in docs if hash(d.group) % 4 == k][::-1]
        row = ray_engine._heldout_pairs(table(part), str(tmp_path / "work"), opts.max_pairs_per_direction)
        row = row.to_pylist()[0]
        groups += row["groups"]
        pair_files += [row["file"]] if row["file"] else []
    written = ray_engine._write_heldout(
        pa.Table.from_pylist([{"documents": json.dumps(staged), "pairs": json.dumps(pair_files)}]),
        str(tmp_path / "ray"), opts.max_pairs_per_direction).to_pylist()[0]
    assert (groups, written["documents"], written["pairs"]) == (expected["groups"], expected["documents"],
                                                                 expected["pairs"])
    assert expected["pairs"] == 9 * 3  # de-en, de-fr, en-fr: each cut at 9
    for name in ("documents.jsonl.gz", "pairs.tsv"):
        read = gzip.open if name.endswith(".gz") else open
        with read(tmp_path / "local" / name, "rb") as x, read(tmp_path / "ray" / name, "rb") as y:
            assert x.read() == y.read(), name


def test_the_tokenizer_sample_merged_by_worker_tasks_is_the_sample_of_the_whole(tmp_path, monkeypatch):
    """Partition samples staged and merged SAMPLE_FAN_IN at a time, over two levels: the sample of the whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = documents("en", 300, 4) + documents("de", 50, 3, start=300)
    whole = TokenizerSample(120, seed=7)
    for d in docs:
        whole.add(d.lang, d.order, d.text)
    (tmp_path / "tokenizer-sample").mkdir()
    files = []
    for k in range(7):
        path = tmp_path / f"part-{k}.parquet"
        pq.write_table(pa.Table.from_pylist([{"lang": d.lang, "order": d.order, "text": d.text}
                                             for d in docs if d.order % 7 == k]), path)
        row = ray_engine._tokenizer_sample(pa.table({"file": [str(path)]}), 120, 7, str(tmp_path))
        files.append(row.column("file")[0].as_py())
    monkeypatch.setattr(ray_engine, "SAMPLE_FAN_IN", 3)
    while len(files) > 1:  # what `tokenizer_sample` does with Ray Data: 7 -> 3 -> 1
        groups = [json.dumps(files[i:i + 3]) for i in range(0, len(files), 3)]
        files = [ray_engine._merge_tokenizer_samples(pa.table({"files": [g]}), 120, 7, str(tmp_path))
                 .column("file")[0].as_py() for g in groups]
    merged = pickle.loads(Path(files[0]).read_bytes())
    assert merged.lines() == whole.lines() and merged.summary() == whole.summary()
