"""`marge prepare --engine ray`: the single-process engine's documents and tokens, from Ray Data, with a file per
partition in its work folder, a large plain JSONL read by byte range and a bounded account of the bad lines; and the
tokenizer's language-balanced sample that both engines draw.

The tests of this subject that need a server or take long are in tests/integration/test_prepare_ray.py."""

from __future__ import annotations

import gzip
import json
import pickle
import random
from pathlib import Path

import pytest
from prepare_inputs import ENGLISH, GERMAN, good_rows, write_jsonl  # tests/prepare_inputs.py

from marge.contracts.documents import PrepareError, RawDocument, jsonl_lines
from services.prepare import ray_engine, ray_reading
from services.prepare.core import TokenizerSample
from services.prepare.options import PrepareOptions
from services.prepare.ray_reading import Rejected, first_lines, jsonl_range_lines, line_starts, read_tasks
from services.prepare.run import prepare


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
