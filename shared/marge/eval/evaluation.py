"""Cross-lingual sentence retrieval without fine-tuning (paper §4.1), and a TF-IDF baseline.

A sentence's vector is the mean of encoder layer L's states over its text tokens (the paper tuned
L = 5 on BUCC). For every language pair in a TSV of translation pairs
(`src_lang<TAB>src_text<TAB>tgt_lang<TAB>tgt_text`, and optionally `<TAB>group`: the page the pair was drawn from,
which `marge prepare` records), each source is ranked against every target of that pair; P@1 is the share of
sources whose best target is their own translation, in both directions.
Scoring is cosine, or the ratio margin of Artetxe & Schwenk (2019) with `margin=True`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from marge.contracts.batch import SpecialTokens
from marge.contracts.languages import normalize_language
from marge.model.embedding import encode_texts, mean_layer_vectors, relevance_unit_vectors, resolve_layer
from marge.model.layers import pad_rows
from marge.model.network import Marge, RelevanceEncoder
from marge.util.progress import track

log = logging.getLogger(__name__)


class PairsError(ValueError):
    pass


@dataclass
class PairSet:
    """Aligned translation pairs of one language pair: sources[i] translates to targets[i]; groups[i], where the
    pairs file records it, is the page (document group) the pair was drawn from (None: not recorded)."""

    src_lang: str
    tgt_lang: str
    sources: list[str]
    targets: list[str]
    groups: list[str | None] | None = None


def read_pairs(path: Path, languages=None) -> list[PairSet]:
    """Read a pairs TSV (4 fields, or 5 with the pair's group); errors name the line and the field. With `languages`
    (a model's tokenizer's), only the pairs whose two languages it knows are kept: a model has nothing to say about a
    language it never saw."""
    groups: dict[tuple[str, str], PairSet] = {}
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\n").rstrip("\r")
            except UnicodeDecodeError as e:
                raise PairsError(f"{path}:{line_no}: invalid UTF-8 at byte {e.start}") from None
            if not line.strip():
                continue
            cells = line.split("\t")
            if len(cells) not in (4, 5):
                raise PairsError(f"{path}:{line_no}: expected 4 tab-separated fields (src_lang, src_text, tgt_lang, "
                                 f"tgt_text) or 5 (and the pair's group), found {len(cells)}")
            if len(cells) == 5 and not cells[4].strip():
                raise PairsError(f"{path}:{line_no}: empty group (field 5): name the page the pair comes from, "
                                 "or leave the field out")
            try:
                src_lang, tgt_lang = normalize_language(cells[0]), normalize_language(cells[2])
            except ValueError as e:
                raise PairsError(f"{path}:{line_no}: {e}") from None
            if not cells[1].strip() or not cells[3].strip():
                raise PairsError(f"{path}:{line_no}: empty text")
            key = (src_lang, tgt_lang)
            pair = groups.setdefault(key, PairSet(src_lang, tgt_lang, [], [], []))
            pair.sources.append(cells[1])
            pair.targets.append(cells[3])
            assert pair.groups is not None
            pair.groups.append(cells[4] if len(cells) == 5 else None)
    if not groups:
        raise PairsError(f"{path}: no pairs")
    if languages is not None:
        known = set(languages)
        kept = [p for key, p in groups.items() if set(key) <= known]
        if not kept:
            raise PairsError(f"{path}: no pairs between the model's languages {sorted(known)} (the file has "
                             f"{sorted({lang for key in groups for lang in key})})")
        return kept
    return list(groups.values())


def read_document_pairs(path: Path, src: str, tgt: str, limit: int | None = None) -> list[tuple[str, str]]:
    """(source text, reference text) for every group that has both languages in a documents JSONL
    (`marge.contracts.documents.read_documents`), in group order; the first `limit` of them."""
    from marge.contracts.documents import read_documents

    by_group = read_documents(Path(path), {src, tgt})
    pairs = [(langs[src], langs[tgt]) for _, langs in sorted(by_group.items()) if src in langs and tgt in langs]
    if not pairs:
        raise ValueError(f"{path}: no group has documents in both {src!r} and {tgt!r}")
    return pairs[:limit] if limit else pairs


def load_eval_model(checkpoint: str | Path | None = None, snapshot: str | Path | None = None,
                    corpus: str | Path | None = None, random_init: bool = False, seed: int = 0, model_config=None):
    """(model, tokenizer, label) to evaluate, from the first source given: a snapshot's relevance encoder (the
    tokenizer from `corpus`); a checkpoint's model (its manifest checked first), or with `random_init` an untrained
    model of the checkpoint's family and shape, with its tokenizer; an untrained model of `model_config(vocab_size=)`
    (a run config's `model_config`) with the prepared `corpus`'s tokenizer. Untrained weights are drawn with `seed`.
    The label says which: "snapshot step N", "trained" or "random init"."""
    from marge.contracts.tokenizer import MargeTokenizer
    from marge.model.checkpoint import build_model
    from marge.model.restore import load_model
    from marge.model.snapshot import load_relevance_encoder, read_snapshot

    if snapshot:
        info = read_snapshot(Path(snapshot))
        tokenizer = MargeTokenizer.load(Path(corpus)) if corpus else None
        if tokenizer is None:
            raise ValueError("--snapshot needs --corpus (the tokenizer lives with the corpus)")
        return load_relevance_encoder(info), tokenizer, f"snapshot step {info.step}"
    if checkpoint:
        model = load_model(Path(checkpoint))  # validates the checkpoint's manifest first
        tokenizer = MargeTokenizer.load(Path(checkpoint))
        if random_init:
            torch.manual_seed(seed)
            return build_model(model.cfg).eval(), tokenizer, "random init"  # the checkpoint's family and shape
        return model, tokenizer, "trained"
    if model_config is not None:
        from marge.contracts.corpus import Corpus

        if corpus is None:
            raise ValueError("--config --random-init needs --corpus (the tokenizer lives with the corpus)")
        tokenizer = Corpus.open(corpus).tokenizer()
        torch.manual_seed(seed)
        return build_model(model_config(vocab_size=tokenizer.vocab_size)).eval(), tokenizer, "random init"
    raise ValueError("give --checkpoint PATH (a folder printed as `checkpoint` by marge pretrain), "
                     "--snapshot PATH --corpus DIR, or --config YAML --random-init")


# --------------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------------


def cosine_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return a @ b.T


def margin_matrix(sim: np.ndarray, k: int = 4) -> np.ndarray:
    """Ratio margin: cos(x, y) over the mean cosine of x's and y's k nearest neighbours (Artetxe & Schwenk 2019)."""
    k_row, k_col = min(k, sim.shape[1]), min(k, sim.shape[0])
    row_nn = np.sort(sim, axis=1)[:, -k_row:].mean(axis=1)
    col_nn = np.sort(sim, axis=0)[-k_col:, :].mean(axis=0)
    return sim / ((row_nn[:, None] + col_nn[None, :]) / 2 + 1e-12)


def precision_at_1(scores: np.ndarray) -> float:
    """scores[i, j]: score of source i against target j; the right target of source i is target i."""
    if scores.shape[0] != scores.shape[1]:
        raise ValueError(f"need a square score matrix, got {scores.shape}")
    return float(np.mean(np.argmax(scores, axis=1) == np.arange(len(scores))))


def both_directions(sim: np.ndarray, pair: PairSet, margin: bool) -> dict[str, float]:
    forward = margin_matrix(sim) if margin else sim
    backward = margin_matrix(sim.T) if margin else sim.T
    return {f"{pair.src_lang}->{pair.tgt_lang}": precision_at_1(forward),
            f"{pair.tgt_lang}->{pair.src_lang}": precision_at_1(backward)}


# --------------------------------------------------------------------------------------------------
# Sentence vectors
# --------------------------------------------------------------------------------------------------


def evaluate_model(model: Marge | RelevanceEncoder, tokenizer, pairs: list[PairSet], layer: int | str | None = None,
                   margin: bool = False, device: str = "cpu") -> dict[str, float]:
    """P@1 of every direction: sentences as the mean of encoder layer `layer`'s text-token states (paper §4.1),
    or, with layer "g", as the relevance vectors the index searches."""
    layer = resolve_layer(model, layer)

    def vectors(texts: list[str]) -> np.ndarray:
        rows = encode_texts(tokenizer, texts, model.cfg.max_positions)
        if isinstance(layer, str):  # "g": resolve_layer gives no other string
            return relevance_unit_vectors(model, rows, tokenizer.specials, device=device)
        return mean_layer_vectors(model, rows, tokenizer.specials, layer, device=device)

    results = {}
    for pair in track(pairs, "retrieval P@1", unit="language pair"):
        results.update(both_directions(cosine_matrix(vectors(pair.sources), vectors(pair.targets)), pair, margin))
    return results


def char_tfidf(ngram_range: tuple[int, int] = (2, 4)):
    """The baselines' features: char n-gram TF-IDF within word boundaries, sublinear tf, rows L2-normalised."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    return TfidfVectorizer(analyzer="char_wb", ngram_range=ngram_range, sublinear_tf=True)


def evaluate_tfidf(pairs: list[PairSet], margin: bool = False, ngram_range: tuple[int, int] = (2, 4)) -> dict[str, float]:
    """The char n-gram TF-IDF baseline: lexical overlap alone (no learning, no model)."""
    results = {}
    for pair in pairs:
        vectorizer = char_tfidf(ngram_range)
        vectorizer.fit(pair.sources + pair.targets)
        src = vectorizer.transform(pair.sources)
        tgt = vectorizer.transform(pair.targets)
        sim = (src @ tgt.T).toarray()  # rows are L2-normalised: this is the cosine
        results.update(both_directions(sim, pair, margin))
    return results


def mean_score(results: dict[str, float]) -> float:
    return float(np.mean(list(results.values()))) if results else 0.0


# --------------------------------------------------------------------------------------------------
# g with one centring procedure for every model, hits per query, and a bootstrap over pages
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def raw_relevance_vectors(model: Marge | RelevanceEncoder, rows: list[list[int]], specials: SpecialTokens,
                          batch_size: int = 64, device: str = "cpu") -> np.ndarray:
    """g of each row before any centring (float64, R D)."""
    g = model.relevance_vectors if isinstance(model, Marge) else model
    order = np.argsort([len(r) for r in rows], kind="stable")
    out = np.zeros((len(rows), model.cfg.d_model), dtype=np.float64)
    for start in range(0, len(rows), batch_size):
        idx = order[start:start + batch_size]
        out[idx] = g(pad_rows([rows[i] for i in idx], specials.pad_id).to(device)).double().cpu().numpy()
    return out


def fitted_centre(model: Marge | RelevanceEncoder, centre_rows: list[list[int]], specials: SpecialTokens,
                  device: str = "cpu") -> np.ndarray | None:
    """The centre a model's g is compared around, fitted the same way for every model: the mean g over
    `centre_rows` (a fixed sample of training documents) when the model centres g (`model.relevance_centering`),
    else None. A trained model's running centre is a moving mean of g over its training batches; a model at
    initialisation has none (zeros), so scoring it with its own centre would compare it uncentred. Fitting both on
    the same documents compares like with like."""
    if not model.cfg.relevance_centering:
        return None
    return raw_relevance_vectors(model, centre_rows, specials, device=device).mean(0)


def centred_unit(vectors: np.ndarray, centre: np.ndarray | None) -> np.ndarray:
    v = vectors - centre if centre is not None else vectors
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def retrieval_hits(model: Marge | RelevanceEncoder, tokenizer, pairs: list[PairSet], centre: np.ndarray | None,
                   device: str = "cpu") -> dict[str, np.ndarray]:
    """For every direction, whether each query's nearest candidate by cos(g - centre) is its translation (a bool
    per query, in the pair set's order): the items P@1 averages, kept so that runs can be compared item by item."""
    def vectors(texts: list[str]) -> np.ndarray:
        rows = encode_texts(tokenizer, texts, model.cfg.max_positions)
        return centred_unit(raw_relevance_vectors(model, rows, tokenizer.specials, device=device), centre)

    out = {}
    for pair in pairs:
        sim = vectors(pair.sources) @ vectors(pair.targets).T
        out[f"{pair.src_lang}->{pair.tgt_lang}"] = np.argmax(sim, axis=1) == np.arange(len(sim))
        out[f"{pair.tgt_lang}->{pair.src_lang}"] = np.argmax(sim.T, axis=1) == np.arange(len(sim))
    return out


OWN_PAGE = "own page: "
"""How `pair_pages` labels a pair whose page is unknown (`OWN_PAGE` + "src-tgt#i"): a page of its own."""
_LEGACY_OWN_PAGE = re.compile(r"[a-z]{2}-[a-z]{2}#\d+")
"""The same label as measures files written before `OWN_PAGE` stored it (without the prefix)."""


def pair_pages(pairs: list[PairSet], documents_jsonl: Path | None) -> dict[str, np.ndarray]:
    """The page (document group) each pair of every language pair comes from: what a bootstrap must resample, since
    pairs of one page are not independent. The group the pairs file records (`marge prepare` writes it); else, for a
    pairs file without that field, the group whose paragraph or whole document (whitespace collapsed, cut at 1,000
    characters, as `prepare` pairs documents without paragraph ids) in `documents_jsonl` (the held-out documents the
    pairs were drawn from) has the pair's source or target text. A pair whose page is still unknown is a page of its
    own (labelled `OWN_PAGE`...), and a warning says how many: the interval is then narrower than a page-level one."""
    from marge.contracts.corpus import split_paragraphs
    from marge.contracts.documents import read_documents

    page_of: dict[tuple[str, str], str] = {}
    unrecorded = any(p.groups is None or None in p.groups for p in pairs)
    if unrecorded and documents_jsonl is not None and Path(documents_jsonl).exists():
        langs = {lang for p in pairs for lang in (p.src_lang, p.tgt_lang)}
        for group, texts in read_documents(Path(documents_jsonl), langs).items():
            for lang, text in texts.items():
                for para in split_paragraphs(text):
                    page_of.setdefault((lang, para), group)
                page_of.setdefault((lang, " ".join(" ".join(text.split())[:1000].split())), group)  # as prepare cut it
    out = {}
    for pair in pairs:
        pages = []
        recorded = pair.groups or [None] * len(pair.sources)
        for i, (src, tgt, recorded_group) in enumerate(zip(pair.sources, pair.targets, recorded)):
            pages.append(recorded_group or page_of.get((pair.src_lang, " ".join(src.split())))
                         or page_of.get((pair.tgt_lang, " ".join(tgt.split())))
                         or f"{OWN_PAGE}{pair.src_lang}-{pair.tgt_lang}#{i}")
        out[f"{pair.src_lang}->{pair.tgt_lang}"] = out[f"{pair.tgt_lang}->{pair.src_lang}"] = np.asarray(pages, dtype=object)
    own = own_page_pairs(out)
    if own:
        log.warning("%d of %d held-out pairs have no known page (a pairs file without its group field, and no "
                    "held-out document with their text): each is resampled as a page of its own, so the interval is "
                    "narrower than a page-level one; prepare the corpus again (it records each pair's group), or "
                    "give the pairs file a fifth field naming each pair's page", own, sum(len(p.sources) for p in pairs))
    return out


def own_page_pairs(pages_by_direction: dict[str, np.ndarray]) -> int:
    """How many pairs `pair_pages` left without a known page (each resampled as a page of its own)."""
    labels = {p for v in pages_by_direction.values() for p in np.asarray(v).tolist()}
    return sum(1 for p in labels if p.startswith(OWN_PAGE) or _LEGACY_OWN_PAGE.fullmatch(p))


def describe_pages(pages: int, own: int) -> str:
    """"N held-out pages", and how many of them are pairs of unknown page resampled as pages of their own."""
    if not own:
        return f"{pages} held-out pages"
    return (f"{pages} held-out pages ({own} of them a single pair whose page is unknown: the interval is narrower "
            "than over whole pages)")


def page_sums(values_by_direction: dict[str, np.ndarray], pages_by_direction: dict[str, np.ndarray],
              page_index: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """(sum of the values, number of items) per page, over every direction: what `clustered_bootstrap` resamples."""
    sums, counts = np.zeros(len(page_index)), np.zeros(len(page_index))
    for key, values in values_by_direction.items():
        idx = np.array([page_index[p] for p in pages_by_direction[key]], dtype=np.int64)
        np.add.at(sums, idx, np.asarray(values, dtype=np.float64))
        np.add.at(counts, idx, 1.0)
    return sums, counts


def clustered_bootstrap(sums_KP: np.ndarray, counts_KP: np.ndarray, resamples: int = 2000, seed: int = 0,
                        resample_rows: bool = True) -> dict:
    """Mean over rows (runs: seeds) of sum / count over pages, with a 95% bootstrap interval that resamples the
    pages (columns, the same draw for every row) and, with `resample_rows`, the rows too: a two-level bootstrap
    of runs and pages. (K P) arrays; a single row is a page bootstrap alone."""
    sums_KP, counts_KP = np.atleast_2d(sums_KP), np.atleast_2d(counts_KP)
    k, p = sums_KP.shape
    mean = float(np.mean(sums_KP.sum(1) / np.maximum(counts_KP.sum(1), 1e-12)))
    rng = np.random.default_rng(seed)
    draws = np.empty(resamples)
    for b in range(resamples):
        w = np.bincount(rng.integers(0, p, size=p), minlength=p).astype(np.float64)
        rows = rng.integers(0, k, size=k) if resample_rows and k > 1 else np.arange(k)
        draws[b] = np.mean((sums_KP[rows] @ w) / np.maximum(counts_KP[rows] @ w, 1e-12))
    return {"mean": mean, "ci95": [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))]}
