"""Is a language cut off from the cross-lingual links? Each language's share of the cross-lingual links it sends
(as a target) and receives (as evidence), beside the share its documents would give it, and the warning a run
prints when one falls far below.

The expected shares assume every document sends the same number of cross-lingual links, spread over the other
languages in proportion to their documents: language L sends its document share d_L, and receives
sum over X != L of sent_X * d_L / (1 - d_X). On a corpus with equal languages both are 1/languages; on a skewed
one (90% en, 10% fr) en receives only what fr sends, and is not flagged for it.

Where the counts come from: the batches built so far from the newest index version (the batcher's figures, in the
progress lines), or an index version's link graph (`marge report`, the run's last line): `index_link_counts`.
"""

from __future__ import annotations

from collections.abc import Mapping

LINK_SHARE_FLOOR = 0.25
"""A language is cut off when its share of the cross-lingual links it sends or receives is under this fraction of
its expected share. On 40 pages of the demo fixture indexed by the tiny model's g at initialisation
(`tests/unit/test_language_links.py`), the Latin-script languages' shares were 0.7 to 1.7 times the expected ones
and ru's, ja's and zh's 0.02 to 0.23 times."""
MIN_EXPECTED_LINKS = 20
"""A language is judged only when its expected number of links is at least this: 20 expected and fewer than 5
seen happens by chance less than once in 10,000 (Poisson), while a handful of links says nothing."""


def language_link_balance(links: Mapping[tuple[str, str], int], documents: Mapping[str, int]) -> dict[str, dict]:
    """Per language of `documents` (documents per language): its document share and, of the cross-lingual `links`
    ((target language, evidence language) -> count; same-language pairs are ignored), the share it sends and
    receives beside the expected ones, and the expected counts."""
    total_docs = sum(documents.values())
    cross = {(t, e): n for (t, e), n in links.items() if t != e and n}
    total = sum(cross.values())
    langs = sorted(set(documents) | {lang for pair in cross for lang in pair})
    share = {lang: documents.get(lang, 0) / total_docs if total_docs else 0.0 for lang in langs}
    sent = {lang: sum(n for (t, _), n in cross.items() if t == lang) / total if total else 0.0 for lang in langs}
    received = {lang: sum(n for (_, e), n in cross.items() if e == lang) / total if total else 0.0 for lang in langs}
    out = {}
    for lang in langs:
        expected_received = sum(sent[x] * share[lang] / (1.0 - share[x]) for x in langs if x != lang and share[x] < 1.0)
        out[lang] = {"documents": share[lang], "sent": sent[lang], "sent_expected": share[lang],
                     "received": received[lang], "received_expected": expected_received,
                     "links_expected_sent": share[lang] * total, "links_expected_received": expected_received * total}
    return out


def cut_off_languages(balance: Mapping[str, Mapping], floor: float = LINK_SHARE_FLOOR,
                      min_expected: float = MIN_EXPECTED_LINKS) -> list[dict]:
    """The languages that send or receive under `floor` x their expected share (where enough links are expected to
    tell): one entry per language and way ('sends' or 'receives'), with the two shares."""
    out = []
    for lang, b in sorted(balance.items()):
        for way, key in (("receives", "received"), ("sends", "sent")):
            if b[f"links_expected_{key}"] >= min_expected and b[key] < floor * b[f"{key}_expected"]:
                out.append({"language": lang, "way": way, "share": b[key], "expected": b[f"{key}_expected"]})
    return out


def describe_cut_off(cut: list[dict], where: str, lexical: bool, indexer=None) -> str | None:
    """The warning for `cut` (from `cut_off_languages`; None when empty): which language, its shares, where they were
    counted (`where`), and what to change: the lexical bootstrap's settings when it ranks the links (`lexical`), with
    their values when the run's `indexer` settings (an `IndexerConfig`) are given."""
    if not cut:
        return None
    shares = "; ".join(f"{c['language']} {c['way']} {100 * c['share']:.1f}% of them, "
                       f"{100 * c['expected']:.0f}% expected from its documents" for c in cut)
    langs = ", ".join(sorted({c["language"] for c in cut}))
    if lexical:
        schedule = ("" if indexer is None else f" (lambda {indexer.lexical_weight:g} falling to 0 at update "
                                               f"{indexer.lexical_until})")
        advice = ("char n-gram TF-IDF, which ranks these links under the lexical bootstrap (indexer.bootstrap=tfidf, "
                  f"cos(g) + lambda * tfidf{schedule}), cannot link texts written in different scripts: lower "
                  "indexer.lexical_until or indexer.lexical_weight so that g ranks alone sooner, train past "
                  "indexer.lexical_until (run.max_steps), or start without it (indexer.bootstrap=none "
                  "indexer.lexical_weight=0: g, which reads any script, ranks from update 0)")
    else:
        advice = ("g does not link this language to the others yet: train longer, or give every document its own "
                  "links (indexer.link_rule=document)")
    return (f"language(s) {langs} cut off from the cross-lingual links of {where}: {shares}. Retrieval into and "
            f"out of {langs} stays near chance while this lasts; {advice}")


def index_link_counts(index, corpus) -> dict[tuple[str, str], int]:
    """(target language, evidence language) -> links of a committed index version (`IndexVersion`). A link's
    evidence may sit in any shard of the version, so every shard's document languages are read first (ids and a
    language code each: the version's sample of shards, not the corpus); a link whose document is in none of them
    is not counted."""
    import numpy as np

    shards = [int(entry["shard"]) for entry in index.shards]
    ids_by_shard, langs_by_shard = [], []
    for shard in shards:
        table = corpus.read_table(shard, verify_checksum=False).select(["doc_id", "lang"])
        ids_by_shard.append(table.column("doc_id").to_numpy())
        langs_by_shard.append(np.asarray(table.column("lang").to_pylist(), dtype=object))
    if not shards:
        return {}
    ids, langs = np.concatenate(ids_by_shard), np.concatenate(langs_by_shard)
    order = np.argsort(ids, kind="stable")
    ids, langs = ids[order], langs[order]

    def languages_of(doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.minimum(np.searchsorted(ids, doc_ids), len(ids) - 1)
        return langs[at], ids[at] == doc_ids

    counts: dict[tuple[str, str], int] = {}
    for shard in shards:
        graph = index.read_graph(shard)
        if graph.num_rows == 0:
            continue
        target_langs, target_known = languages_of(graph.column("target_id").to_numpy())
        evidence_langs, evidence_known = languages_of(graph.column("evidence_id").to_numpy())
        known = target_known & evidence_known
        for t, e in zip(target_langs[known], evidence_langs[known]):
            counts[(t, e)] = counts.get((t, e), 0) + 1
    return counts


def index_language_warning(index_root, corpus, indexer=None) -> tuple[list[dict], str | None]:
    """`cut_off_languages` of the newest committed index version under `index_root`, and its warning (None when no
    language is cut off, or there is no index)."""
    from marge.contracts.index_store import latest_version

    index = latest_version(index_root)
    if index is None:
        return [], None
    cut = cut_off_languages(language_link_balance(index_link_counts(index, corpus), corpus.manifest["languages"]))
    lexical = indexer is not None and indexer.link_source(index.snapshot_step)[0] in ("tfidf", "hybrid")
    return cut, describe_cut_off(cut, f"index v{index.version} (snapshot step {index.snapshot_step})", lexical, indexer)
