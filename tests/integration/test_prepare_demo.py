"""`marge prepare`: round trip on the whole demo fixture (every language, a 4,000-piece tokenizer).

These need a server or take long; the quick tests of this subject are in tests/unit/test_prepare.py (no server)."""

from __future__ import annotations

from marge.contracts.corpus import CORPUS_SCHEMA, Corpus
from services.prepare.options import PrepareOptions
from services.prepare.run import prepare


def opts(inputs, out, **kw) -> PrepareOptions:
    return PrepareOptions(inputs=inputs, out=out, vocab_size=kw.pop("vocab_size", 600), **kw)


# --- round trip --------------------------------------------------------------------------------


def test_demo_fixture_round_trip(demo_raw, tmp_path):
    out = tmp_path / "demo"
    manifest = prepare(opts([demo_raw / "documents.jsonl.gz"], out, vocab_size=4000, docs_per_shard=400))
    corpus = Corpus.open(out)
    tok = corpus.tokenizer()
    assert len(corpus.languages) >= 8 and {"ru", "zh", "ja"} <= set(corpus.languages)  # non-Latin scripts
    heldout = set((demo_raw / "heldout_pages.txt").read_text().split())
    seen_ids, group_shard, total = set(), {}, 0
    for s in range(corpus.num_shards):
        table = corpus.read_table(s)
        assert table.schema.equals(CORPUS_SCHEMA, check_metadata=False)
        docs = corpus.read_shard(s)
        total += len(docs)
        for doc_id, group, lang, tokens, text in zip(docs.doc_ids, docs.groups, docs.langs, docs.tokens, docs.texts):
            assert doc_id not in seen_ids
            seen_ids.add(int(doc_id))
            assert group_shard.setdefault(group, s) == s, "a group is split across shards"
            assert group not in heldout, "a held-out page leaked into training"
            assert 1 <= len(tokens) <= 510
            assert tok.decode(tokens).split() == tok.decode(tok.encode(text)).split()
    assert total == manifest["num_documents"] == sum(manifest["languages"].values())
    # pages are in several languages in one shard (the paper's "same article in every language")
    assert manifest["num_groups"] < total / 4


# --- bad input -----------------------------------------------------------------------------------


# --- corrupt or wrong-schema Parquet -------------------------------------------------------------


# --- CLI -------------------------------------------------------------------------------------------
