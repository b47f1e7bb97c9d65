"""Measures that tell aligned content from the same page, and the lexical bootstrap of the index.

* `marge prepare` keeps the input's paragraph ids (which documents are translations) and can make every
  paragraph a document; a version-1 corpus (without ids) still reads;
* the indexer's link sources: TF-IDF (the bootstrap's version 0 and the frozen lexical index), cos(g) +
  lambda * tfidf, the aligned oracle, and the aligned link precision every version reports;
* the aligned probe (held-out paragraphs with their translations) and g's health at the end of a run.

The tests of this subject that need a server or take long are in tests/integration/test_alignment_measures.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from alignment_inputs import LATIN, PAGE, encoder_for, pairs_of

from marge.contracts.corpus import Corpus, ShardDocuments
from marge.contracts.documents import PrepareError
from marge.model.architecture import preset
from marge.model.network import Marge, RelevanceEncoder
from services.indexer.config import IndexerConfig
from services.indexer.core import index_shard
from services.indexer.links import shard_links
from services.indexer.neighbours import lexical_vectors
from services.prepare.options import PrepareOptions
from services.prepare.run import prepare


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# --- prepare and the corpus ------------------------------------------------------------------------


def test_paragraph_documents_keep_their_ids_and_chunks_the_ids_of_their_paragraphs(tmp_path):
    raw = write_jsonl(tmp_path / "in.jsonl", PAGE)
    base = dict(inputs=[raw], vocab_size=300, lid=False, docs_per_shard=100)
    prepare(PrepareOptions(out=tmp_path / "para", document_unit="paragraph", min_document_tokens=2, **base))
    prepare(PrepareOptions(out=tmp_path / "chunk", **base))
    para = Corpus.open(tmp_path / "para").read_shard(0)
    by_text = {text: ids for text, ids in zip(para.texts, para.paragraph_ids)}
    assert by_text["Insert a table into the current document."] == ("a",)
    assert by_text["Fügt eine Tabelle in das aktuelle Dokument ein."] == ("a",)
    assert "OK" not in by_text  # shorter than min_document_tokens: dropped
    i = para.texts.index("Insert a table into the current document.")
    j = para.texts.index("Fügt eine Tabelle in das aktuelle Dokument ein.")
    k = para.texts.index("Choose Table - Insert Table.")
    assert para.translations(i, j) and para.translations(j, i) and not para.translations(i, k)
    assert not para.translations(j, k) and not para.translations(i, i)  # same page is not the same content
    manifest = json.loads((tmp_path / "para" / "manifest.json").read_text())
    assert manifest["document_unit"] == "paragraph" and manifest["stats"]["documents_too_short"] >= 1
    chunk = Corpus.open(tmp_path / "chunk").read_shard(0)
    assert sorted(chunk.paragraph_ids) == [("a", "b", "c"), ("a", "c")]
    assert chunk.aligned and chunk.translations(0, 1)


def test_a_long_paragraph_is_cut_to_the_document_size_and_counted(tmp_path):
    long = " ".join(f"word{i}" for i in range(200))
    raw = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "language": "en", "paragraph_ids": ["p1"], "text": long}])
    manifest = prepare(PrepareOptions(inputs=[raw], out=tmp_path / "out", vocab_size=300, lid=False,
                                      document_unit="paragraph", max_chunk_tokens=20))
    docs = Corpus.open(tmp_path / "out").read_shard(0)
    assert len(docs) == 1 and len(docs.tokens[0]) == 18 and docs.paragraph_ids == [("p1",)]
    assert manifest["stats"]["paragraphs_cut"] == 1


@pytest.mark.parametrize("ids, message", [
    (["a"], r"in.jsonl:1: field 'paragraph_ids' has 1 ids but 'text' has 3 paragraphs"),
    ("a b c", r"in.jsonl:1: field 'paragraph_ids' must be a list of non-empty strings"),
    (["a", "", "c"], r"must be a list of non-empty strings"),
])
def test_bad_paragraph_ids_name_the_line_and_the_field(tmp_path, ids, message):
    raw = write_jsonl(tmp_path / "in.jsonl", [{**PAGE[0], "paragraph_ids": ids}])
    with pytest.raises(PrepareError, match=message):
        prepare(PrepareOptions(inputs=[raw], out=tmp_path / "out", vocab_size=300, lid=False))
    assert not (tmp_path / "out").exists()


def test_bad_document_options_are_refused():
    with pytest.raises(PrepareError, match="--document-unit must be one of"):
        PrepareOptions(inputs=["x.jsonl"], out="o", document_unit="sentence")
    with pytest.raises(PrepareError, match="--min-document-tokens must be at least 1"):
        PrepareOptions(inputs=["x.jsonl"], out="o", min_document_tokens=0)


def test_a_version_1_corpus_without_paragraph_ids_still_reads(tmp_path):
    raw = write_jsonl(tmp_path / "in.jsonl", PAGE)
    out = tmp_path / "old"
    prepare(PrepareOptions(inputs=[raw], out=out, vocab_size=300, lid=False))
    from marge.contracts.corpus import CORPUS_SCHEMA_V1
    from marge.util.files import sha256_file

    manifest = json.loads((out / "manifest.json").read_text())
    path = out / manifest["shards"][0]["file"]
    table = pq.read_table(path).drop(["paragraph_ids"]).cast(CORPUS_SCHEMA_V1)
    pq.write_table(table, path)
    manifest["schema_version"] = 1
    manifest["shards"][0]["sha256"] = sha256_file(path)
    (out / "manifest.json").write_text(json.dumps(manifest))
    docs = Corpus.open(out).read_shard(0)
    assert docs.paragraph_ids is None and not docs.aligned and not docs.translations(0, 1)


def test_the_demo_documents_carry_paragraph_ids_for_every_paragraph(demo_raw):
    import gzip

    from marge.contracts.corpus import split_paragraphs

    for name in ("documents.jsonl.gz", "heldout_documents.jsonl.gz"):
        rows = [json.loads(line) for line in gzip.open(demo_raw / name, "rt", encoding="utf-8")]
        assert all(len(r["paragraph_ids"]) == len(split_paragraphs(r["text"])) for r in rows)
        assert all(len(set(r["paragraph_ids"])) == len(r["paragraph_ids"]) for r in rows)  # unique within a page


# --- the indexer's link sources --------------------------------------------------------------------


@pytest.fixture(scope="module")
def shard(paragraph_corpus) -> ShardDocuments:
    corpus = Corpus.open(paragraph_corpus)
    return max((corpus.read_shard(s) for s in range(corpus.num_shards)), key=len)


def test_lambda_0_is_todays_index_and_lambda_anneals_to_it(shard, paragraph_corpus, tmp_path):
    corpus = Corpus.open(paragraph_corpus)
    encoder, specials = encoder_for(corpus), corpus.tokenizer().specials
    plain = IndexerConfig(link_rule="document")
    annealed = IndexerConfig(link_rule="document", bootstrap="tfidf", lexical_weight=2.0, lexical_until=1000)
    assert annealed.link_source(0) == ("tfidf", 0.0)
    assert annealed.link_source(250) == ("hybrid", 1.5)
    assert annealed.link_source(1000) == annealed.link_source(5000) == ("g", 0.0) == plain.link_source(0)

    def graph(cfg, step, name):
        out = tmp_path / name
        out.mkdir()
        result = index_shard(shard, encoder, specials, out, cfg, search="torch", snapshot_step=step)
        return pq.read_table(out / result.graph_file)

    assert graph(annealed, 1000, "after").equals(graph(plain, 1000, "today"))  # byte for byte the same links
    hybrid = graph(annealed, 500, "hybrid").to_pydict()
    # every kept link's score is cos(g) + lambda * tfidf, lambda = 2 * (1 - 500 / 1000)
    from services.indexer.core import embed_documents

    unit = embed_documents(encoder, shard.tokens, specials)
    x = lexical_vectors(shard.texts)
    pos = {int(d): i for i, d in enumerate(shard.doc_ids)}
    for t, e, s in zip(hybrid["target_id"][:50], hybrid["evidence_id"][:50], hybrid["score"][:50]):
        i, j = pos[t], pos[e]
        assert s == pytest.approx(float(unit[i] @ unit[j]) + 1.0 * float((x[i] @ x[j].T).toarray()[0, 0]), abs=1e-4)


def test_aligned_links_are_every_translation_plus_distractors(shard, paragraph_corpus, tmp_path):
    corpus = Corpus.open(paragraph_corpus)
    cfg = IndexerConfig(links="aligned", aligned_distractors=2)
    result = index_shard(shard, encoder_for(corpus), corpus.tokenizer().specials, tmp_path, cfg, search="torch")
    graph = pq.read_table(tmp_path / result.graph_file).to_pydict()
    pos = {int(d): i for i, d in enumerate(shard.doc_ids)}
    per_target: dict[int, list[tuple[int, float]]] = {}
    for t, e, s in zip(graph["target_id"], graph["evidence_id"], graph["score"]):
        per_target.setdefault(pos[t], []).append((pos[e], s))
    for i in range(len(shard)):
        linked = per_target.get(i, [])
        translations = {j for j in range(len(shard)) if shard.translations(i, j)}
        assert {j for j, s in linked if s == 1.0} == translations
        distractors = [j for j, s in linked if s == 0.0]
        assert len(distractors) == 2 and not set(distractors) & (translations | {i})
    cross = np.array(graph["cross_lingual"])
    parallel = np.array([shard.translations(pos[t], pos[e]) for t, e in zip(graph["target_id"], graph["evidence_id"])])
    assert result.crosslingual_parallel_precision == pytest.approx(parallel[cross].mean())
    assert result.link_source == "aligned"


def test_aligned_links_need_paragraph_ids(paragraph_corpus, tmp_path):
    corpus = Corpus.open(paragraph_corpus)
    docs = corpus.read_shard(0)
    docs.paragraph_ids = None  # as a corpus prepared from input without them
    with pytest.raises(ValueError, match="needs a corpus prepared from input with paragraph_ids"):
        index_shard(docs, encoder_for(corpus), corpus.tokenizer().specials, tmp_path, IndexerConfig(links="aligned"),
                    search="torch")


def test_parallel_precision_counts_aligned_translations_not_the_same_page():
    docs = ShardDocuments(shard=0, doc_ids=np.arange(4, dtype=np.int64), langs=np.array(["en", "de", "de", "fr"], object),
                          groups=np.array(["p"] * 4, object), tokens=[np.array([5, 6, 7], np.int32)] * 4,
                          texts=["a b", "a c", "x y", "a d"], paragraph_ids=[("1",), ("1",), ("2",), ("9",)])
    cfg = IndexerConfig(link_rule="document", links_monolingual=0, links_crosslingual=1)
    unit = np.eye(4, dtype=np.float32)
    unit[0] = unit[2] = np.array([1, 0, 0, 0], np.float32)  # en doc 0 finds de doc 2: same page, other paragraph
    links = shard_links(docs.doc_ids, docs.langs, unit, cfg, search="torch")
    assert (0, 2) in pairs_of(links)
    parallel = [docs.translations(int(t), int(e)) for t, e in zip(links["target_id"], links["evidence_id"])]
    same_page = [docs.groups[int(t)] == docs.groups[int(e)] for t, e in zip(links["target_id"], links["evidence_id"])]
    assert all(same_page) and not all(parallel)


def test_link_source_settings_are_checked():
    from marge.contracts.config import ConfigError

    with pytest.raises(ConfigError, match="bootstrap must be 'none' when links is 'aligned'"):
        IndexerConfig(links="aligned", bootstrap="tfidf")
    with pytest.raises(ConfigError, match="lexical_until must be > 0 when lexical_weight > 0"):
        IndexerConfig(lexical_weight=1.0)
    with pytest.raises(ConfigError, match="links must be one of"):
        IndexerConfig(links="bm25")


# --- the aligned probe and g's health --------------------------------------------------------------


def test_aligned_probe_items_are_held_out_paragraphs_with_their_translations(aligned_items, latin_tokenizer, demo_raw):
    import gzip

    from marge.contracts.corpus import split_paragraphs
    from services.trainer.health import build_aligned_probe

    assert len(aligned_items) == 24
    pages: dict[tuple[str, str], dict[str, str]] = {}
    for line in gzip.open(demo_raw / "heldout_documents.jsonl.gz", "rt", encoding="utf-8"):
        row = json.loads(line)
        for pid, text in zip(row["paragraph_ids"], split_paragraphs(row["text"])):
            pages.setdefault((row["group"], pid), {})[row["language"]] = text
    encode = latin_tokenizer.encode
    for item in aligned_items:
        assert set(item.evidence_langs) <= set(LATIN) and item.target_lang not in item.evidence_langs
        assert len(item.target) >= 4
        # the evidence is the same paragraph of the same page in the other languages
        matches = [texts for (group, _), texts in pages.items() if group == item.group
                   and item.target_lang in texts and encode(texts[item.target_lang])[:62] == item.target.tolist()]
        assert any(all(lang in texts and encode(texts[lang])[:62] == e.tolist()
                       for lang, e in zip(item.evidence_langs, item.evidence)) for texts in matches)
    again = build_aligned_probe(demo_raw / "heldout_documents.jsonl.gz", latin_tokenizer, size=24, max_tokens=64)
    assert all(np.array_equal(a.target, b.target) for a, b in zip(aligned_items, again))


def test_every_g_is_centred_on_the_same_documents_whatever_its_own_running_centre(latin_tokenizer, few_pairs):
    from marge.eval.evaluation import fitted_centre, read_pairs, retrieval_hits
    from marge.model.embedding import encode_texts

    pairs = read_pairs(few_pairs, latin_tokenizer.languages)
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=latin_tokenizer.vocab_size, max_positions=64, relevance_pooling="mean",
                 relevance_layers=1, relevance_centering=True)
    encoder = RelevanceEncoder.from_model(Marge(cfg)).eval()
    rows = encode_texts(latin_tokenizer, [t for p in pairs for t in p.targets], cfg.max_positions)
    centre = fitted_centre(encoder, rows, latin_tokenizer.specials)
    before = retrieval_hits(encoder, latin_tokenizer, pairs, centre)
    with torch.no_grad():
        encoder.relevance_center.fill_(3.0)  # a running centre far off: the fitted centre ignores it
    assert np.allclose(fitted_centre(encoder, rows, latin_tokenizer.specials), centre)
    after = retrieval_hits(encoder, latin_tokenizer, pairs, centre)
    assert all((before[k] == after[k]).all() for k in before)
    uncentred = preset("tiny", vocab_size=latin_tokenizer.vocab_size, max_positions=64, relevance_centering=False)
    assert fitted_centre(RelevanceEncoder.from_model(Marge(uncentred)), rows, latin_tokenizer.specials) is None
