"""A language cut off from the cross-lingual links: its shares beside its documents' (`services.driver.language_links`),
counted from an index's graph and from the batches built from it, and said in the progress and the last line."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from services.driver.language_links import (
    LINK_SHARE_FLOOR,
    cut_off_languages,
    describe_cut_off,
    index_link_counts,
    language_link_balance,
)

SIX = ("en", "es", "fr", "it", "ro", "ru")


def verse_links(ru_share_received: float, per_language: int = 400) -> dict[tuple[str, str], int]:
    """Cross-lingual links of a 6-language corpus with equal documents: every language sends `per_language`; the
    other languages send `ru_share_received` of theirs into ru and the rest evenly among themselves."""
    links = {}
    for t in SIX:
        others = [e for e in SIX if e != t]
        if t == "ru":
            for e in others:
                links[(t, e)] = per_language // len(others)
            continue
        into_ru = round(per_language * ru_share_received)
        links[(t, "ru")] = into_ru
        for e in others:
            if e != "ru":
                links[(t, e)] = (per_language - into_ru) // (len(others) - 1)
    return links


def test_a_language_the_others_do_not_link_to_is_cut_off_and_only_it():
    documents = {lang: 250 for lang in SIX}
    balance = language_link_balance({**verse_links(0.01), ("en", "en"): 5000}, documents)  # same-language: ignored
    assert balance["ru"]["received_expected"] == pytest.approx(1 / 6)
    cut = cut_off_languages(balance)
    assert [(c["language"], c["way"]) for c in cut] == [("ru", "receives")]
    assert cut[0]["share"] < LINK_SHARE_FLOOR * cut[0]["expected"]
    # every language linked to as its documents say: nobody is cut off
    assert cut_off_languages(language_link_balance(verse_links(1 / 5), documents)) == []


def test_a_skewed_corpus_is_judged_by_what_its_documents_would_give_each_language():
    # 90% en, 10% fr: en's cross-lingual links can only come from fr, so en receives 10% of them, as expected
    balance = language_link_balance({("en", "fr"): 3600, ("fr", "en"): 400}, {"en": 900, "fr": 100})
    assert balance["en"]["received"] == pytest.approx(0.1) and balance["en"]["received_expected"] == pytest.approx(0.1)
    assert cut_off_languages(balance) == []
    # a share far below the documents' would have flagged en under the naive rule (10% received, 90% of documents)
    assert balance["en"]["received"] < LINK_SHARE_FLOOR * balance["en"]["documents"]


def test_a_handful_of_links_says_nothing():
    few = {pair: n // 40 for pair, n in verse_links(0.0).items()}  # 10 links a language: 2 expected into ru
    assert cut_off_languages(language_link_balance(few, {lang: 250 for lang in SIX})) == []


def test_the_warning_names_the_language_its_shares_and_settings_the_indexer_has():
    from services.indexer.config import IndexerConfig

    cut = cut_off_languages(language_link_balance(verse_links(0.01), {lang: 250 for lang in SIX}))
    indexer = IndexerConfig(bootstrap="tfidf", lexical_weight=4.0, lexical_until=800)
    text = describe_cut_off(cut, "index v6 (snapshot step 600)", lexical=True, indexer=indexer)
    assert text.startswith("language(s) ru cut off from the cross-lingual links of index v6 (snapshot step 600): "
                           "ru receives 0.8% of them, 17% expected from its documents")
    assert "lambda 4 falling to 0 at update 800" in text
    fields = {f.name for f in dataclasses.fields(IndexerConfig)}
    named = set(re.findall(r"indexer\.([a-z_]+)", text))
    assert named == {"bootstrap", "lexical_weight", "lexical_until"} and named <= fields
    for setting in re.findall(r"(indexer\.[a-z_]+=\w+)", text):  # each value it suggests is one the config takes
        key, value = setting.split(".", 1)[1].split("=")
        IndexerConfig(**{"bootstrap": "none", "lexical_weight": 0.0, key: type(getattr(indexer, key))(value)})
    plain = describe_cut_off(cut, "index v6", lexical=False)
    assert "indexer.link_rule=document" in plain and "TF-IDF" not in plain
    assert describe_cut_off([], "index v6", lexical=True) is None


def test_the_demo_index_at_initialisation_cuts_off_the_non_latin_scripts(small_index, small_corpus):
    """What `LINK_SHARE_FLOOR`'s figures come from: the tiny model's g at initialisation links documents by their
    scripts' tokens, so ru, ja and zh get almost no cross-lingual links, while the Latin-script languages stay near
    their documents' share."""
    from marge.contracts.corpus import Corpus

    corpus = Corpus.open(small_corpus)
    balance = language_link_balance(index_link_counts(small_index, corpus), corpus.manifest["languages"])
    ratios = {lang: min(b["received"] / b["received_expected"], b["sent"] / b["sent_expected"])
              for lang, b in balance.items()}
    assert {c["language"] for c in cut_off_languages(balance)} == {"ru", "ja", "zh"}, ratios
    assert all(0.5 < ratios[lang] < 2 for lang in ("de", "en", "es", "fr", "it")), ratios
    assert all(ratios[lang] < 0.25 for lang in ("ru", "ja", "zh")), ratios
    graph = small_index.read_graph()
    assert sum(index_link_counts(small_index, corpus).values()) == graph.num_rows


def test_the_progress_line_says_so_from_the_batches_and_warns_once_a_version(small_index, small_corpus, caplog):
    """The batch builders' figures (their batches' links by language) through `combined_stats` into the driver's
    progress: a `[links]` line at every report, the warning with what to change once per index version."""
    from marge.contracts.corpus import Corpus
    from services.batcher.config import BatcherConfig
    from services.batcher.core import DocumentStore, epoch_batches
    from services.batcher.stats import combined_stats, links_by_language
    from services.driver.progress import Progress

    corpus = Corpus.open(small_corpus)
    builders = []
    for group in range(2):
        links: dict[tuple[str, str], int] = {}
        for batch in epoch_batches(small_index, DocumentStore(corpus), BatcherConfig(max_tokens=400), 0, group=group,
                                   builders=2):
            for pair, n in links_by_language(batch).items():
                links[pair] = links.get(pair, 0) + n
        builders.append({"produced": 1, "produced_by_version": {0: 1}, "crosslingual_share": 0.5,
                         "mean_batch_tokens": 400.0, "next_slot": 0, "waiting_for_version": None, "time": 0.0,
                         "links_version": 0, "links_by_language": links,
                         "documents_by_language": corpus.manifest["languages"]})
    builders.append({**builders[0], "links_version": -1, "links_by_language": {("ru", "en"): 10**6}})  # no batch yet
    bat = combined_stats(builders)
    assert bat["links_version"] == 0 and ("ru", "en") in bat["links_by_language"]
    assert bat["links_by_language"][("ru", "en")] < 1000  # the builder without a batch of v0 counts for nothing
    progress = Progress(max_steps=10, queue=None, coordinator=None, batchers=[])
    caplog.set_level(logging.INFO, logger="marge.pipeline")
    first, again = progress.language_lines(bat, lexical=True), progress.language_lines(bat, lexical=True)
    assert first == again and len(first) == 1
    assert first[0].startswith("[links] cut off in the batches of index v0: ") and "ru receives" in first[0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and re.match(r"language\(s\) (\w+, )*ru(, \w+)* cut off from the cross-lingual links "
                                           r"of the batches of index v0: ", warnings[0]), warnings
    assert progress.language_lines({**bat, "links_by_language": {}}, lexical=True) == []


def test_the_last_line_names_the_snapshot_chance_tfidf_and_a_cut_off_language(small_index, small_corpus, few_pairs):
    from marge.contracts.corpus import Corpus
    from marge.eval.evaluation import evaluate_tfidf, mean_score, read_pairs
    from services.driver.verdict_context import add_verdict_context, chance_p_at_1
    from services.indexer.config import IndexerConfig
    from services.trainer.health import describe_g_health

    corpus = Corpus.open(small_corpus)
    pairs = read_pairs(few_pairs, corpus.languages)
    assert chance_p_at_1(pairs) == pytest.approx(1 / 6)  # 6 pairs a language pair: 6 candidates
    health = {"verdict": "not above initialisation", "warning": "g retrieves no better than at initialisation.",
              "p_at_1": 0.077, "p_at_1_at_init": 0.064, "initialisations": 3, "difference": 0.014,
              "difference_ci95": (-0.004, 0.033), "pages": 40, "spread": 0.1, "spread_at_init": 0.1,
              "snapshot_step": 100}
    add_verdict_context(health, pairs, corpus, small_index.path.parent, IndexerConfig(bootstrap="tfidf"))
    assert health["tfidf_p_at_1"] == pytest.approx(mean_score(evaluate_tfidf(pairs)))
    line = describe_g_health(health)
    assert line.startswith("[g] not above initialisation | held-out P@1 0.077 vs 0.064 at initialisation (mean of 3 "
                           "random inits, g centred alike; chance 0.167, char TF-IDF "
                           f"{health['tfidf_p_at_1']:.3f}): "), line
    assert " held-out pages | snapshot step 100 | spread 0.100 " in line, line
    assert line.endswith(" | cut off from cross-lingual links: ja, ru, zh"), line
    assert health["warning"].startswith("g retrieves no better than at initialisation. language(s) ja, ru, zh cut off "
                                        "from the cross-lingual links of index v0 (snapshot step 0)")
    assert "indexer.bootstrap=tfidf" in health["warning"]  # version 0 of a tfidf bootstrap is TF-IDF's
