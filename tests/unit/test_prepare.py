"""`marge prepare`: round trip on the demo fixture, and every kind of bad input.

The tests of this subject that need a server or take long are in tests/integration/test_prepare_demo.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prepare_inputs import (  # tests/prepare_inputs.py
    CHINESE,
    ENGLISH,
    GERMAN,
    assert_nothing_written,
    good_rows,
    write_jsonl,
)

from marge.contracts.corpus import Corpus, CorpusError
from marge.contracts.documents import PrepareError
from marge.util.files import sha256_file
from services.cli import main as marge_main
from services.prepare.options import PrepareOptions
from services.prepare.run import prepare


def opts(inputs, out, **kw) -> PrepareOptions:
    return PrepareOptions(inputs=inputs, out=out, vocab_size=kw.pop("vocab_size", 600), **kw)


# --- round trip --------------------------------------------------------------------------------


def test_held_out_pairs_tsv(demo_raw):
    rows = [line.split("\t") for line in (demo_raw / "heldout_pairs.tsv").read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 700 and all(len(r) == 4 for r in rows)
    assert {r[2] for r in rows} >= {"de", "fr", "ru", "zh", "ja"}
    assert all(r[0] == "en" and r[1] != r[3] and len(r[1].split()) >= 5 for r in rows)
    assert "Mozilla Public" in (demo_raw / "ATTRIBUTION.md").read_text()


def test_prepare_warns_when_the_tokenizer_or_the_held_out_split_is_far_below_what_was_asked(tmp_path, caplog):
    rows = [{"id": f"p{g}-{lang}", "group": f"p{g}", "language": lang, "text": f"{text} {g}"}
            for g in range(40) for lang, text in (("en", ENGLISH), ("de", GERMAN), ("zh", CHINESE))]
    raw = write_jsonl(tmp_path / "raw.jsonl", rows)
    with caplog.at_level("WARNING", logger="services.prepare"):
        manifest = prepare(opts([raw], tmp_path / "big", vocab_size=32000, heldout_permille=100))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    pieces = manifest["tokenizer"]["vocab_size"]
    assert pieces < 16000 and any(f"the tokenizer has {pieces} pieces, far below the 32000 asked for" in w
                                  and f"--vocab-size {pieces}" in w for w in warned), warned
    held = manifest["heldout"]["groups"]
    assert 0 < held < 30 and any(f"the held-out split has {held} groups" in w and "--heldout-permille 750" in w
                                 for w in warned), warned  # 30 of the 40 groups
    caplog.clear()
    with caplog.at_level("WARNING", logger="services.prepare"):
        prepare(opts([raw], tmp_path / "fits", vocab_size=pieces))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # asked what it could give, no split asked


def test_held_out_pairs_cover_every_language_direction(tmp_path):
    """Not only from the most common language: a corpus in en/de/zh measures en-de, en-zh and de-zh, and a group
    missing a language adds only the directions it has."""
    rows = [{"id": f"p{g}-{lang}", "group": f"p{g}", "language": lang, "text": f"{text} {g}"}
            for g in range(60) for lang, text in (("en", ENGLISH), ("de", GERMAN), ("zh", CHINESE))
            if not (lang == "en" and g % 2)]  # odd groups lack English
    manifest = prepare(opts([write_jsonl(tmp_path / "raw.jsonl", rows)], tmp_path / "out", heldout_permille=500))
    lines = (tmp_path / "out" / manifest["heldout"]["pairs_file"]).read_text(encoding="utf-8").splitlines()
    directions = [(cells[0], cells[2]) for cells in (line.split("\t") for line in lines)]
    assert set(directions) == {("de", "en"), ("de", "zh"), ("en", "zh")}
    held = {row["group"] for row in map(json.loads, gzip.open(tmp_path / "out" / manifest["heldout"]["documents_file"], "rt"))}
    with_english = sum(1 for g in held if int(g[1:]) % 2 == 0)
    assert directions.count(("de", "zh")) == len(held) and directions.count(("de", "en")) == with_english


def test_duplicates_are_dropped_and_long_documents_chunked(tmp_path):
    long_text = "\n\n".join(f"Paragraph number {i} explains another spreadsheet feature in detail." for i in range(60))
    rows = good_rows() + [{"id": "dup", "group": "p9", "language": "en", "text": "  " + ENGLISH.upper() + " "},
                          {"id": "long", "group": "p2", "language": "en", "text": long_text}]
    out = tmp_path / "out"
    manifest = prepare(opts([write_jsonl(tmp_path / "in.jsonl", rows)], out, max_chunk_tokens=64, lid=False))
    assert manifest["stats"]["documents_duplicate"] == 1
    all_docs = [Corpus.open(out).read_shard(s) for s in range(manifest["num_shards"])]
    long_chunks = [t for d in all_docs for t, g in zip(d.tokens, d.groups) if g == "p2"]
    assert len(long_chunks) > 1 and all(len(t) <= 62 for t in long_chunks)


def test_html_folder_input(tmp_path):
    root = tmp_path / "site"
    for lang, text in (("en", ENGLISH), ("de", GERMAN)):
        d = root / lang / "calc"
        d.mkdir(parents=True)
        (d / "sum.html").write_text(f"<html><head><title>x</title><script>var a=1;</script></head>"
                                    f"<body><nav>Menu</nav><h1>Title</h1><p>{text}</p></body></html>", encoding="utf-8")
    (root / "de" / "calc" / "notes.txt").write_text(GERMAN + "\n\nNoch ein Absatz über Zellen und Formeln.", encoding="utf-8")
    out = tmp_path / "out"
    manifest = prepare(opts([root], out))
    docs = Corpus.open(out).read_shard(0)
    assert manifest["languages"] == {"de": 2, "en": 1}
    assert set(docs.groups) == {"calc/sum", "calc/notes"}
    assert not any("var a" in t or "Menu" in t for t in docs.texts)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mutate, message", [
    (lambda rows: rows.append({"language": "en", "text": "   "}), r"in\.jsonl:4: field 'text' is empty"),
    (lambda rows: rows.append({"language": "xx", "text": ENGLISH + " More."}), r"in\.jsonl:4: field 'language'.*'xx'.*ISO 639-1"),
    (lambda rows: rows.append({"language": "en", "text": GERMAN + " Noch mehr."}), r"in\.jsonl:4: field 'language' says 'en'.*'de'"),
    (lambda rows: rows.append({"text": ENGLISH}), r"in\.jsonl:4: field 'language' is missing"),
    (lambda rows: rows.append({"language": "en", "text": 5}), r"in\.jsonl:4: field 'text' must be a string"),
    (lambda rows: rows.append({"language": "en", "text": "word " * 300}), r"in\.jsonl:4: document has 1,500 characters"),
])
def test_bad_documents_are_errors_naming_file_and_line(tmp_path, mutate, message):
    rows = good_rows()
    mutate(rows)
    out = tmp_path / "out"
    with pytest.raises(PrepareError, match=message):
        prepare(opts([write_jsonl(tmp_path / "in.jsonl", rows)], out, max_document_chars=1000))
    assert_nothing_written(out)


def test_invalid_utf8_names_file_line_and_byte(tmp_path):
    path = tmp_path / "in.jsonl"
    write_jsonl(path, good_rows())
    with open(path, "ab") as f:
        f.write(b'{"language": "de", "text": "Gr\xfc\xdfe aus M\xfcnchen"}\n')
    out = tmp_path / "out"
    with pytest.raises(PrepareError, match=r"in\.jsonl:4: invalid UTF-8 at byte 30"):
        prepare(opts([path], out))
    assert_nothing_written(out)


def test_invalid_utf8_in_a_folder_file(tmp_path):
    (tmp_path / "site" / "de").mkdir(parents=True)
    (tmp_path / "site" / "de" / "a.txt").write_bytes(b"Gr\xfc\xdfe")
    with pytest.raises(PrepareError, match=r"a\.txt: invalid UTF-8 at byte 2"):
        prepare(opts([tmp_path / "site"], tmp_path / "out"))


def test_not_json_and_not_a_language_folder(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"language": "en", "text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(PrepareError, match=r"in\.jsonl:2: not valid JSON"):
        prepare(opts([path], tmp_path / "out"))
    (tmp_path / "site" / "english").mkdir(parents=True)
    with pytest.raises(PrepareError, match=r"folder name 'english' is not an ISO 639-1"):
        prepare(opts([tmp_path / "site"], tmp_path / "out"))


def test_skip_mode_drops_and_counts_bad_documents(tmp_path):
    rows = good_rows() + [{"language": "en", "text": ""}, {"language": "en", "text": GERMAN + " Noch mehr."}]
    manifest = prepare(opts([write_jsonl(tmp_path / "in.jsonl", rows)], tmp_path / "out", on_bad_document="skip"))
    assert manifest["stats"]["documents_skipped_bad"] == 2
    assert manifest["num_documents"] == 3


def test_skip_mode_also_drops_lines_that_are_not_documents(tmp_path):
    """--skip-bad-documents skips what cannot be read as a document too: invalid UTF-8, a line that is not JSON,
    a missing field (and an unreadable file of a folder input), each counted; without it each stops the run."""
    path = write_jsonl(tmp_path / "in.jsonl", good_rows())
    with open(path, "ab") as f:
        f.write(b'{"language": "en", "text": "caf\xe9 latin-1"}\n')
        f.write(b"not json at all\n")
        f.write(b'{"language": "en"}\n')
    with pytest.raises(PrepareError, match=r"in\.jsonl:4: invalid UTF-8"):
        prepare(opts([path], tmp_path / "strict"))
    manifest = prepare(opts([path], tmp_path / "out", on_bad_document="skip"))
    assert manifest["stats"]["documents_skipped_bad"] == 3 and manifest["num_documents"] == 3
    assert any("in.jsonl:5: not valid JSON" in e for e in manifest["skipped_examples"])
    site = tmp_path / "site" / "en"
    site.mkdir(parents=True)
    (site / "good.txt").write_text(ENGLISH + " " + ENGLISH, encoding="utf-8")
    (site / "bad.txt").write_bytes(b"caf\xe9 " * 20)
    manifest = prepare(opts([tmp_path / "site"], tmp_path / "folder", on_bad_document="skip", lid=False))
    assert manifest["stats"]["documents_skipped_bad"] == 1 and manifest["num_documents"] == 1


def test_failed_overwrite_keeps_the_existing_corpus(tmp_path):
    out = tmp_path / "out"
    prepare(opts([write_jsonl(tmp_path / "good.jsonl", good_rows())], out))
    before = {p.name: sha256_file(p) for p in out.rglob("*") if p.is_file()}
    bad = write_jsonl(tmp_path / "bad.jsonl", good_rows() + [{"language": "en", "text": ""}])
    with pytest.raises(PrepareError):
        prepare(opts([bad], out, overwrite=True))
    assert before == {p.name: sha256_file(p) for p in out.rglob("*") if p.is_file()}
    with pytest.raises(PrepareError, match="already exists"):
        prepare(opts([bad], out))


# --- corrupt or wrong-schema Parquet -------------------------------------------------------------


@pytest.fixture
def built(tmp_path) -> Path:
    out = tmp_path / "corpus"
    prepare(opts([write_jsonl(tmp_path / "in.jsonl", good_rows())], out))
    return out


def shard_path(root: Path) -> Path:
    return root / "shards" / "shard-00000.parquet"


def test_corrupt_parquet_is_named(built):
    path = shard_path(built)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorpusError, match=r"shard-00000\.parquet: sha256 differs.*marge prepare"):
        Corpus.open(built).read_shard(0)
    with pytest.raises(CorpusError, match=r"shard-00000\.parquet: not a readable Parquet file"):
        Corpus.open(built, verify_checksums=False).read_shard(0)


def rewrite_with(root: Path, table: pa.Table) -> None:
    pq.write_table(table, shard_path(root))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = sha256_file(shard_path(root))
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_wrong_schema_parquet_names_the_column(built):
    table = pq.read_table(shard_path(built))
    rewrite_with(built, table.drop(["lang"]))
    with pytest.raises(CorpusError, match=r"column\(s\) \['lang'\] missing"):
        Corpus.open(built).read_shard(0)
    rewrite_with(built, table.set_column(table.schema.get_field_index("doc_id"), "doc_id",
                                         pa.array([str(i) for i in range(table.num_rows)])))
    with pytest.raises(CorpusError, match=r"column 'doc_id' has type string, expected int64"):
        Corpus.open(built).read_shard(0)
    langs = table.column("lang").to_pylist()
    langs[1] = "xx"
    rewrite_with(built, table.set_column(table.schema.get_field_index("lang"), pa.field("lang", pa.string(), nullable=False),
                                         pa.array(langs)))
    with pytest.raises(CorpusError, match=r"row 1: lang 'xx'"):
        Corpus.open(built).read_shard(0)


def test_missing_or_foreign_manifest(built, tmp_path):
    with pytest.raises(CorpusError, match="run `marge prepare"):
        Corpus.open(tmp_path / "nowhere")
    manifest = json.loads((built / "manifest.json").read_text())
    (built / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 99}))
    with pytest.raises(CorpusError, match="schema_version 99 is not supported"):
        Corpus.open(built)


def test_tokenizer_language_tokens_are_control_symbols(built):
    tok = Corpus.open(built).tokenizer()
    assert set(tok.languages) == {"en", "de", "zh"}
    ids = tok.encode("[en] literal brackets")
    assert tok.lang_id("en") not in ids
    assert len(set(tok.specials.lang_ids.values())) == 3


# --- CLI -------------------------------------------------------------------------------------------


def test_cli_prepare_and_info(tmp_path, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", good_rows())
    assert marge_main(["prepare", str(path), "--out", str(tmp_path / "c"), "--vocab-size", "600"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_documents"] == 3
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"language": "en", "text": ""}])
    assert marge_main(["prepare", str(bad), "--out", str(tmp_path / "d")]) == 2
    assert "bad.jsonl:1: field 'text' is empty" in capsys.readouterr().err
    assert marge_main(["info", "--preset", "paper", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert abs(info["num_parameters"] - 963e6) / 963e6 < 0.02
    assert info["config"]["decoder_ffn"] == 16536


def test_gzip_jsonl_is_read(tmp_path):
    path = tmp_path / "in.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in good_rows():
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    assert prepare(opts([path], tmp_path / "out"))["num_documents"] == 3


def test_a_lone_surrogate_names_file_line_and_field(tmp_path):
    path = tmp_path / "in.jsonl"
    write_jsonl(path, good_rows())
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"language": "en", "text": "' + ENGLISH + ' broken \\ud800 here"}\n')  # valid JSON, not text
    out = tmp_path / "out"
    with pytest.raises(PrepareError, match=r"in\.jsonl:4: field 'text' has a lone surrogate \('\\ud800'\)"):
        prepare(opts([path], out))
    assert_nothing_written(out)
    manifest = prepare(opts([path], out, on_bad_document="skip"))
    assert manifest["stats"]["documents_skipped_bad"] == 1


def test_a_corrupt_gzip_names_the_file_and_the_line_it_broke_at(tmp_path):
    good = tmp_path / "good.jsonl.gz"
    with gzip.open(good, "wt", encoding="utf-8") as f:
        for _ in range(200):
            for r in good_rows():
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    data = bytearray(good.read_bytes())
    data[-8] ^= 0xFF  # the CRC-32 trailer: every line decodes, the check at the end of the stream fails
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(PrepareError, match=r"bad\.jsonl\.gz:\d+: cannot be read after line \d+ .*gzip -t"):
        prepare(opts([bad], out))
    assert_nothing_written(out)
    truncated = tmp_path / "truncated.jsonl.gz"
    truncated.write_bytes(good.read_bytes()[:-200])
    with pytest.raises(PrepareError, match=r"truncated\.jsonl\.gz:\d+: cannot be read"):
        prepare(opts([truncated], out))
