"""Measures that tell aligned content from the same page, and the lexical bootstrap of the index.

* `marge prepare` keeps the input's paragraph ids (which documents are translations) and can make every
  paragraph a document; a version-1 corpus (without ids) still reads;
* the indexer's link sources: TF-IDF (the bootstrap's version 0 and the frozen lexical index), cos(g) +
  lambda * tfidf, the aligned oracle, and the aligned link precision every version reports;
* the aligned probe (held-out paragraphs with their translations) and g's health at the end of a run.

These need a server or take long; the quick tests of this subject are in tests/unit/test_alignment.py (no server)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from alignment_inputs import encoder_for, pairs_of

from marge.contracts.corpus import Corpus, ShardDocuments
from marge.model.architecture import preset
from marge.model.network import Marge, RelevanceEncoder
from services.indexer.config import IndexerConfig
from services.indexer.core import index_shard
from services.indexer.links import shard_links
from services.indexer.neighbours import lexical_vectors

# --- prepare and the corpus ------------------------------------------------------------------------


# --- the indexer's link sources --------------------------------------------------------------------


@pytest.fixture(scope="module")
def shard(paragraph_corpus) -> ShardDocuments:
    corpus = Corpus.open(paragraph_corpus)
    return max((corpus.read_shard(s) for s in range(corpus.num_shards)), key=len)


def reference_tfidf_links(docs: ShardDocuments, per_doc: dict[bool, int]) -> set[tuple[int, int]]:
    """The per-document rule by brute force on the full TF-IDF cosine matrix (every document a candidate)."""
    from marge.eval.evaluation import char_tfidf

    x = char_tfidf().fit_transform(docs.texts)
    sims = (x @ x.T).toarray()
    out = set()
    for i in range(len(docs)):
        for cross, k in per_doc.items():
            candidates = [j for j in range(len(docs)) if j != i and (docs.langs[j] != docs.langs[i]) == cross]
            ranked = sorted(candidates, key=lambda j: -sims[i, j])[:k]
            out |= {(int(docs.doc_ids[i]), int(docs.doc_ids[j])) for j in ranked}
    return out


def test_bootstrap_version_0_links_are_exactly_tfidfs_top_k(shard, paragraph_corpus, tmp_path):
    corpus = Corpus.open(paragraph_corpus)
    cfg = IndexerConfig(link_rule="document", links_monolingual=2, links_crosslingual=3, bootstrap="tfidf",
                        candidates_per_language=1000)
    result = index_shard(shard, encoder_for(corpus), corpus.tokenizer().specials, tmp_path, cfg, search="torch",
                         snapshot_step=0)
    assert result.link_source == "tfidf"
    graph = pq.read_table(tmp_path / result.graph_file).to_pydict()
    got = set(zip(graph["target_id"], graph["evidence_id"]))
    assert got == reference_tfidf_links(shard, {False: 2, True: 3})
    # the frozen lexical index is the same ranking at every version
    frozen = shard_links(shard.doc_ids, shard.langs, None, IndexerConfig(links="tfidf", link_rule="document",
                         links_monolingual=2, links_crosslingual=3, candidates_per_language=1000),
                         lexical=lexical_vectors(shard.texts), lexical_weight=None)
    assert pairs_of(frozen) == got


# --- the aligned probe and g's health --------------------------------------------------------------


def test_aligned_gain_is_zero_without_cross_attention_and_its_split_adds_up(aligned_items, latin_tokenizer):
    from services.trainer.health import aligned_evidence_gain

    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=latin_tokenizer.vocab_size, max_positions=64)).eval()
    reading = aligned_evidence_gain(model, aligned_items, latin_tokenizer.specials)
    share = reading["aligned_verbatim_share"]
    total = share * reading["aligned_gain_verbatim_tokens"] + (1 - share) * reading["aligned_gain_other_tokens"]
    assert total == pytest.approx(reading["aligned_evidence_gain"], abs=1e-9)
    assert sum(reading["aligned_item_gains"]) / reading["aligned_target_tokens"] == pytest.approx(
        reading["aligned_evidence_gain"], abs=1e-5)
    assert reading["aligned_evidence_gain"] != 0.0  # a random decoder reads its evidence: the metric is not blind
    lo, hi = reading["aligned_evidence_gain_ci95"]
    assert lo <= reading["aligned_evidence_gain"] <= hi
    chars_per_token = reading["aligned_target_chars"] / reading["aligned_target_tokens"]
    assert reading["aligned_evidence_gain_per_char"] == pytest.approx(reading["aligned_evidence_gain"] / chars_per_token)
    with torch.no_grad():
        for layer in model.decoder_layers:
            layer.cross_attn.out_proj.weight.zero_()
            layer.cross_attn.out_proj.bias.zero_()
    blind = aligned_evidence_gain(model, aligned_items, latin_tokenizer.specials)
    assert blind["aligned_evidence_gain"] == pytest.approx(0.0, abs=1e-6)
    assert blind["aligned_copy_gain"] == pytest.approx(0.0, abs=1e-6)


def test_g_health_calls_g_learning_only_above_its_initialisations_by_more_than_the_interval(latin_tokenizer, few_pairs):
    from marge.eval.evaluation import read_pairs
    from marge.model.embedding import encode_texts
    from services.trainer.health import describe_g_health, g_health

    pairs = read_pairs(few_pairs, latin_tokenizer.languages)
    assert {p.tgt_lang for p in pairs} == {"de", "fr", "es", "it"}  # the tokenizer's directions only
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=latin_tokenizer.vocab_size, max_positions=64, relevance_pooling="mean",
                 relevance_layers=1, relevance_centering=True)
    initial = RelevanceEncoder.from_model(Marge(cfg)).eval()
    centre = encode_texts(latin_tokenizer, [p.sources[0] for p in pairs], cfg.max_positions)
    same = g_health(initial, [initial], latin_tokenizer, pairs, centre)
    assert same["verdict"] == "not above initialisation" and "an interval that holds 0" in same["warning"]
    assert same["p_at_1"] == same["p_at_1_at_init"] and same["difference_ci95"] == [0.0, 0.0]
    assert same["directions"] == 8 and same["pages"] == sum(len(p.sources) for p in pairs)  # each pair its own page
    collapsed = RelevanceEncoder.from_model(Marge(cfg)).eval()
    with torch.no_grad():  # every token the same vector: every document the same g
        collapsed.embed_tokens.weight.copy_(collapsed.embed_tokens.weight[5].expand_as(collapsed.embed_tokens.weight))
        collapsed.encoder_positions.weight.zero_()
    bad = g_health(collapsed, [initial], latin_tokenizer, pairs, centre)
    assert bad["verdict"] == "collapsed" and bad["variation"] < 1e-3 and "has collapsed" in bad["warning"]
    assert describe_g_health(bad).startswith("[g] collapsed | held-out P@1")
    # a g far above its baselines (here: a random init, P@1 0.52, against flat "initialisations", 0.19) is learning;
    # against the mean of a flat and a random baseline, the same g is above by half as much
    flat = RelevanceEncoder.from_model(Marge(cfg.with_overrides(relevance_centering=False))).eval()
    with torch.no_grad():  # uncentred and every document alike: every query ranks candidate 0 first
        flat.embed_tokens.weight.copy_(flat.embed_tokens.weight[5].expand_as(flat.embed_tokens.weight))
        flat.encoder_positions.weight.zero_()
    good = g_health(initial, [flat, flat], latin_tokenizer, pairs, centre)
    assert good["verdict"] == "learning" and good["warning"] is None and good["difference_ci95"][0] > 0
    assert good["initialisations"] == 2 and "mean of 2 random inits, g centred alike" in describe_g_health(good)
    half = g_health(initial, [flat, initial], latin_tokenizer, pairs, centre)
    assert half["difference"] == pytest.approx(good["difference"] / 2)
