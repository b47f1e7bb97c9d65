"""Retrieval health: is the model using its evidence, and is g learning to find it?

Measured on a fixed probe set at every snapshot (and by the experiment on every checkpoint):

* evidence gain (nats per target token): the loss of each probe target given its true evidence
  subtracted from its loss given another probe target's evidence (a derangement). Positive means the
  true evidence helps the reconstruction; until it is clearly positive, g gets no useful gradient;
* relevance cosines: f(target, its true evidence) vs f(target, other probe documents), and the spread
  of g (mean cosine between unrelated documents; near 1 means g has collapsed onto one direction);
* beta, and the index's own figures (mean cosine of kept links vs random in-shard pairs, the
  cross-lingual share of links and the share of cross-lingual links that join translations of the
  same page), which the indexer reports with every version.

A probe item is a held-out page in one language (the target) with the same page in up to
`max_evidence` other languages as its true evidence: never trained on, aligned by construction.

The aligned probe (`health.aligned_probe_size` targets, `AlignedProbe`) asks the same of single held-out
paragraphs, each with its aligned translations (the corpus's paragraph ids) in up to `max_evidence` other
languages, the unit the training batches of a paragraph-level corpus are made of. It reports the evidence
gain per target token and per target character (a vocabulary change cannot move the latter), each with a
bootstrap 95% interval over targets, and split into target tokens that occur verbatim in the evidence (what
copying can win) and the others (what only translating can win).
"""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from marge.contracts.batch import Batch, SpecialTokens, max_text_tokens
from marge.contracts.documents import read_documents
from marge.model.network import Marge
from services.trainer.config import HealthConfig
from services.trainer.inputs import to_model_inputs
from services.trainer.precision import full_precision

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeItem:
    target: np.ndarray
    target_lang: str
    evidence: tuple[np.ndarray, ...]
    evidence_langs: tuple[str, ...]


def build_probe(documents_jsonl: Path, tokenizer, size: int = 32, max_evidence: int = 3, max_tokens: int = 128,
                seed: int = 0) -> list[ProbeItem]:
    """A fixed probe set from a documents JSONL (one object per page and language, with `group`)."""
    groups = read_documents(Path(documents_jsonl), tokenizer.languages)
    rng = np.random.default_rng(seed)
    usable = sorted(g for g, langs in groups.items() if len(langs) >= 2)
    if len(usable) < 2:
        raise ValueError(f"{documents_jsonl}: needs at least 2 groups with 2 or more languages for a probe set")
    chosen = [usable[i] for i in rng.permutation(len(usable))[:size]]
    items = []
    for g in chosen:
        langs = sorted(groups[g])
        target_lang = langs[int(rng.integers(len(langs)))]
        others = [lang for lang in langs if lang != target_lang]
        rng.shuffle(others)
        others = others[:max_evidence]

        def tokens(text: str) -> np.ndarray:
            return np.asarray(tokenizer.encode(" ".join(text.split()))[: max_text_tokens(max_tokens)], dtype=np.int32)

        items.append(ProbeItem(tokens(groups[g][target_lang]), target_lang, tuple(tokens(groups[g][x]) for x in others),
                               tuple(others)))
    return items


def _batch(target: ProbeItem, evidence_from: ProbeItem) -> Batch:
    docs = (target.target, *evidence_from.evidence)
    langs = (target.target_lang, *evidence_from.evidence_langs)
    m = len(evidence_from.evidence)
    return Batch(batch_id="probe", index_version=-1, snapshot_step=-1, doc_ids=np.arange(1 + m, dtype=np.int64),
                 doc_langs=langs, doc_tokens=docs, targets=np.array([0], dtype=np.int32),
                 evidence=np.arange(1, 1 + m, dtype=np.int32), edges=np.array([[0, j] for j in range(m)], dtype=np.int32),
                 edge_weights=np.ones(m, dtype=np.float32))


def _self_copy(item: ProbeItem, rng: np.random.Generator) -> ProbeItem:
    """The item with a noised copy of its own target as its only evidence (30% of tokens deleted)."""
    from services.trainer.objectives import noised

    copy = noised(item.target, deletion=0.3, shuffle_window=1, rng=rng)
    return ProbeItem(item.target, item.target_lang, (copy,), (item.target_lang,))


@torch.no_grad()
def evidence_gain(model: Marge, probe: list[ProbeItem], specials: SpecialTokens, device: str | torch.device = "cpu") -> dict:
    """Per-token loss with true, shuffled and self-copy evidence, and the relevance cosines, on the probe set.

    evidence_gain = loss(shuffled) - loss(true evidence): what the translations are worth to the decoder.
    copy_gain = loss(shuffled) - loss(a noised copy of the target): whether the decoder can read at all.
    """
    was_training = model.training
    model.eval()
    device = torch.device(device)
    sums = {"true": [0.0, 0], "shuffled": [0.0, 0], "copy": [0.0, 0]}
    gold_cos: list[float] = []
    other_cos: list[float] = []
    rng = np.random.default_rng(0)
    for i, item in enumerate(probe):
        copy = _self_copy(item, rng)
        for kind, source in (("true", item), ("shuffled", probe[(i + 1) % len(probe)]), ("copy", copy)):
            out = model(**to_model_inputs(_batch(item, source), specials).to(device).as_kwargs())
            sums[kind][0] += float(out.nll_per_target_N.sum())
            sums[kind][1] += int(out.tokens_per_target_N.sum())
            if kind != "copy":
                (gold_cos if kind == "true" else other_cos).extend(out.relevance_NM.flatten().tolist())
    model.train(was_training)
    loss = {kind: total / count for kind, (total, count) in sums.items()}
    return {"loss_true_evidence": loss["true"], "loss_shuffled_evidence": loss["shuffled"],
            "loss_copy_evidence": loss["copy"], "copy_gain": loss["shuffled"] - loss["copy"],
            "evidence_gain": loss["shuffled"] - loss["true"],
            "relevance_cos_true": float(np.mean(gold_cos)), "relevance_cos_shuffled": float(np.mean(other_cos)),
            "relevance_gap": float(np.mean(gold_cos) - np.mean(other_cos))}


@torch.no_grad()
def g_spread(model: Marge, probe: list[ProbeItem], specials: SpecialTokens, device: str | torch.device = "cpu") -> float:
    """Mean cosine between g of unrelated probe documents (1.0: every document looks alike)."""
    from marge.contracts.batch import as_encoder_input
    from marge.model.layers import pad_rows

    rows = [as_encoder_input(item.target, specials) for item in probe]
    g = model.unit_relevance_vectors(pad_rows(rows, specials.pad_id).to(device))  # as the index compares them
    sims = g @ g.T
    n = len(rows)
    return float((sims.sum() - sims.diagonal().sum()) / max(1, n * (n - 1)))


def probe_health(model: Marge, probe: list[ProbeItem], specials: SpecialTokens, device="cpu") -> dict:
    out = evidence_gain(model, probe, specials, device)
    out["g_spread"] = g_spread(model, probe, specials, device)
    out["beta"] = full_precision(model.beta).detach().float().cpu().tolist()  # bf16 parameters: the optimizer's
    return out


# ----------------------------------------------------------------------------------------------------
# The aligned probe: held-out paragraphs with their aligned translations
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlignedItem:
    group: str
    target: np.ndarray
    target_lang: str
    target_chars: int
    evidence: tuple[np.ndarray, ...]
    evidence_langs: tuple[str, ...]


def read_aligned_paragraphs(documents_jsonl: Path, languages) -> dict[tuple[str, str], dict[str, str]]:
    """{(group, paragraph id): {lang: paragraph text}} of a documents JSONL with `paragraph_ids`."""
    from marge.contracts.corpus import split_paragraphs

    opener = gzip.open if str(documents_jsonl).endswith(".gz") else open
    out: dict[tuple[str, str], dict[str, str]] = {}
    with opener(documents_jsonl, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["language"] not in languages or not row.get("paragraph_ids"):
                continue
            group = row.get("group", row.get("id"))
            for pid, text in zip(row["paragraph_ids"], split_paragraphs(row["text"])):
                out.setdefault((group, pid), {})[row["language"]] = text
    return out


def build_aligned_probe(documents_jsonl: Path, tokenizer, size: int = 256, max_evidence: int = 3,
                        max_tokens: int = 128, min_tokens: int = 4, seed: int = 0,
                        exclude: frozenset[tuple[str, tuple[int, ...]]] = frozenset()) -> list[AlignedItem]:
    """`size` held-out paragraphs (a seeded draw; a target language drawn per paragraph) with their translations.

    Only paragraphs with at least `min_tokens` text tokens in the target language and a translation in another
    language of the tokenizer qualify; texts longer than `max_tokens` positions are cut. A target whose
    (language, tokens) is in `exclude` (e.g. every document of the training corpus: boilerplate that held-out pages
    share with training pages) is skipped."""
    paragraphs = read_aligned_paragraphs(documents_jsonl, set(tokenizer.languages))
    keys = sorted(k for k, langs in paragraphs.items() if len(langs) >= 2)
    if len(keys) < 2:
        raise ValueError(f"{documents_jsonl}: needs held-out documents with `paragraph_ids` and translations in at "
                         f"least 2 of the tokenizer's languages {tokenizer.languages} for the aligned probe "
                         "(rebuild it with `scripts/build_demo_corpus.sh`, or set health.aligned_probe_size: 0)")
    rng = np.random.default_rng(seed)
    limit = max_text_tokens(max_tokens)
    items: list[AlignedItem] = []
    for i in rng.permutation(len(keys)):
        group, _ = keys[i]
        texts = paragraphs[keys[i]]
        langs = sorted(texts)
        target_lang = langs[int(rng.integers(len(langs)))]
        target = np.asarray(tokenizer.encode(texts[target_lang])[:limit], dtype=np.int32)
        if len(target) < min_tokens or (target_lang, tuple(target.tolist())) in exclude:
            continue
        others = [lang for lang in langs if lang != target_lang]
        rng.shuffle(others)
        evidence = tuple(np.asarray(tokenizer.encode(texts[x])[:limit], dtype=np.int32) for x in others[:max_evidence])
        items.append(AlignedItem(group, target, target_lang, len(tokenizer.decode(target.tolist())), evidence,
                                 tuple(others[:max_evidence])))
        if len(items) == size:
            break
    if len(items) < 2:
        raise ValueError(f"{documents_jsonl}: only {len(items)} aligned paragraphs of >= {min_tokens} tokens")
    return items


def unrelated_partner(items: list[AlignedItem]) -> list[int]:
    """For each item, the next item (cyclically) from another page: whose evidence is its shuffled evidence."""
    n = len(items)
    out = []
    for i in range(n):
        j = next(((i + d) % n for d in range(1, n) if items[(i + d) % n].group != items[i].group), (i + 1) % n)
        out.append(j)
    return out


def aligned_batch(pairs: list[tuple[AlignedItem, tuple[np.ndarray, ...], tuple[str, ...]]]) -> Batch:
    """One batch of targets, each linked to its own evidence documents only (read with attend_to 'linked')."""
    tokens: list[np.ndarray] = []
    evidence: list[int] = []
    langs, targets, edges = [], [], []
    for t, (item, docs, doc_langs) in enumerate(pairs):
        targets.append(len(tokens))
        tokens.append(item.target)
        langs.append(item.target_lang)
        for doc, lang in zip(docs, doc_langs):
            edges.append((t, len(evidence)))
            evidence.append(len(tokens))
            tokens.append(doc)
            langs.append(lang)
    return Batch(batch_id="aligned-probe", index_version=-1, snapshot_step=-1,
                 doc_ids=np.arange(len(tokens), dtype=np.int64), doc_langs=tuple(langs), doc_tokens=tuple(tokens),
                 targets=np.array(targets, dtype=np.int32), evidence=np.array(evidence, dtype=np.int32),
                 edges=np.array(edges, dtype=np.int32).reshape(-1, 2), edge_weights=np.ones(len(edges), dtype=np.float32))


@torch.no_grad()
def token_losses(model: Marge, pairs, specials: SpecialTokens, device, batch_targets: int = 32):
    """Per target: the NLL of each label token (text tokens, then EOS) given its evidence, and f to that evidence."""
    import torch.nn.functional as F

    nll, cos = [], []
    for start in range(0, len(pairs), batch_targets):
        chunk = pairs[start:start + batch_targets]
        inputs = to_model_inputs(aligned_batch(chunk), specials, attend_to="linked").to(device)
        out = model(**inputs.as_kwargs(), return_logits=True)
        labels = inputs.labels_NT
        per_token = F.cross_entropy(out.logits_NTV.float().transpose(1, 2), labels, ignore_index=specials.pad_id,
                                    reduction="none")
        for i in range(len(chunk)):
            n = int((labels[i] != specials.pad_id).sum())
            nll.append(per_token[i, :n].double().cpu().numpy())
        linked = inputs.linked_NM
        cos.extend(out.relevance_NM[linked].float().cpu().tolist())
    return nll, cos


def ratio_ci(numerators: np.ndarray, denominators: np.ndarray, resamples: int = 1000, seed: int = 0) -> list[float]:
    """Bootstrap 95% interval of sum(numerators) / sum(denominators), resampling items with replacement."""
    rng = np.random.default_rng(seed)
    n = len(numerators)
    draws = rng.integers(0, n, size=(resamples, n))
    ratios = numerators[draws].sum(1) / np.maximum(denominators[draws].sum(1), 1e-12)
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def aligned_evidence_gain(model: Marge, items: list[AlignedItem], specials: SpecialTokens,
                          device: str | torch.device = "cpu") -> dict:
    """The aligned probe's figures (keys prefixed `aligned_`): evidence gain per token and per character with
    bootstrap 95% intervals, split into verbatim and other target tokens, the copy gain, and f to true and to
    unrelated evidence."""
    was_training = model.training
    model.eval()
    partner = unrelated_partner(items)
    true_pairs = [(item, item.evidence, item.evidence_langs) for item in items]
    shuffled_pairs = [(item, items[j].evidence, items[j].evidence_langs) for item, j in zip(items, partner)]
    rng = np.random.default_rng(0)
    from services.trainer.objectives import noised

    copy_pairs = [(item, (noised(item.target, 0.3, 1, rng),), (item.target_lang,)) for item in items]
    nll_true, cos_true = token_losses(model, true_pairs, specials, device)
    nll_shuffled, cos_other = token_losses(model, shuffled_pairs, specials, device)
    nll_copy, _ = token_losses(model, copy_pairs, specials, device)
    model.train(was_training)
    gain = np.array([s.sum() - t.sum() for s, t in zip(nll_shuffled, nll_true)])
    tokens = np.array([len(t) for t in nll_true], dtype=np.float64)
    chars = np.array([item.target_chars for item in items], dtype=np.float64)
    verbatim_gain, other_gain, verbatim_tokens = 0.0, 0.0, 0
    for item, s, t in zip(items, nll_shuffled, nll_true):
        seen = set(np.concatenate(item.evidence).tolist()) if item.evidence else set()
        verbatim = np.array([tok in seen for tok in item.target.tolist()] + [False])  # the EOS label is never verbatim
        verbatim_gain += float((s - t)[verbatim].sum())
        other_gain += float((s - t)[~verbatim].sum())
        verbatim_tokens += int(verbatim.sum())
    total_tokens = float(tokens.sum())
    other_tokens = total_tokens - verbatim_tokens
    copy_gain = sum(s.sum() - c.sum() for s, c in zip(nll_shuffled, nll_copy)) / total_tokens
    return {
        "aligned_evidence_gain": float(gain.sum() / total_tokens),
        "aligned_evidence_gain_ci95": ratio_ci(gain, tokens),
        "aligned_evidence_gain_per_char": float(gain.sum() / chars.sum()),
        "aligned_evidence_gain_per_char_ci95": ratio_ci(gain, chars),
        "aligned_gain_verbatim_tokens": verbatim_gain / max(1, verbatim_tokens),
        "aligned_gain_other_tokens": other_gain / max(1.0, other_tokens),
        "aligned_verbatim_share": verbatim_tokens / total_tokens,
        "aligned_copy_gain": float(copy_gain),
        "aligned_loss_true_evidence": float(sum(t.sum() for t in nll_true) / total_tokens),
        "aligned_loss_shuffled_evidence": float(sum(s.sum() for s in nll_shuffled) / total_tokens),
        "aligned_relevance_cos_true": float(np.mean(cos_true)), "aligned_relevance_cos_shuffled": float(np.mean(cos_other)),
        "aligned_targets": len(items), "aligned_target_tokens": int(total_tokens), "aligned_target_chars": int(chars.sum()),
        "aligned_item_gains": [round(float(x), 5) for x in gain],  # per target, nats: paired comparisons of runs
    }


# ----------------------------------------------------------------------------------------------------
# g's health at the end of a run: trained against the same model at initialisation
# ----------------------------------------------------------------------------------------------------

COLLAPSED_SPREAD = 0.9
"""Mean cosine of g between unrelated documents at or above which g counts as collapsed (every document alike)."""
COLLAPSED_VARIATION = 0.01
"""Centred g: its mean distance from the centre, as a share of its mean length, below which g counts as collapsed
(the documents differ by rounding noise, whose directions the spread cannot see)."""


INIT_BASELINES = 3
"""Random initialisations g's held-out P@1 is compared with (the run's own and more, drawn with other seeds)."""
CENTRE_DOCUMENTS = 2048
"""Training documents every g is centred on before it is scored (`centre_rows`)."""


def centre_rows(corpus, size: int = CENTRE_DOCUMENTS, seed: int = 0) -> list[list[int]]:
    """A fixed, seeded sample of training documents (as encoder rows) from up to 8 shards: what `fitted_centre`
    centres every g on, trained or initial, so that they are scored alike."""
    from marge.contracts.batch import as_encoder_input

    rng = np.random.default_rng(seed)
    shards = rng.choice(corpus.num_shards, size=min(8, corpus.num_shards), replace=False)
    pool = [t for s in shards for t in corpus.read_shard(int(s), verify_checksum=False).tokens if len(t)]
    chosen = rng.choice(len(pool), size=min(size, len(pool)), replace=False)
    specials = corpus.tokenizer().specials  # loaded once: each load reads and checks the tokenizer model
    return [as_encoder_input(pool[i], specials) for i in chosen]


def random_encoders(model_cfg, seeds: list[int]):
    """g of freshly initialised models of `model_cfg`, one per seed (the initialisation baselines)."""
    from marge.model.checkpoint import build_model
    from marge.model.network import Marge, RelevanceEncoder

    out = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = build_model(model_cfg)
        if not isinstance(model, Marge):
            raise ValueError(f"g's initialisations need a MARGE config, got {type(model_cfg).__name__}")
        out.append(RelevanceEncoder.from_model(model).eval())
    return out


@torch.no_grad()
def spread_of(vectors: np.ndarray) -> float:
    """Mean cosine between different rows of unit vectors (1.0: every document alike)."""
    sims = vectors @ vectors.T
    n = len(vectors)
    return float((sims.sum() - np.trace(sims)) / max(1, n * (n - 1)))


@torch.no_grad()
def relevance_spread(encoder, tokenizer, texts: list[str], device: str | torch.device = "cpu") -> float:
    """Mean cosine between g of different documents among `texts`, as the index compares them (1.0: collapsed)."""
    from marge.model.embedding import encode_texts, relevance_unit_vectors

    rows = encode_texts(tokenizer, texts, encoder.cfg.max_positions)
    return spread_of(relevance_unit_vectors(encoder, rows, tokenizer.specials, device=str(device)).astype(np.float64))


def g_health(trained, initials: list, tokenizer, pairs, centre: list[list[int]], pages: dict | None = None,
             device: str | torch.device = "cpu", spread_texts: int = 256, resamples: int = 2000) -> dict:
    """Held-out P@1 of the trained g against the mean of random initialisations (`initials`: relevance encoders or
    models), every one centred alike (`marge.eval.evaluation.fitted_centre` on the `centre` documents), and a verdict:

    * 'collapsed': unrelated documents have a mean cosine >= COLLAPSED_SPREAD under the trained g;
    * 'learning': the trained g's P@1 is above the initialisations' mean by more than its 95% interval (a paired
      bootstrap over held-out pages, `pages` from `marge.eval.evaluation.pair_pages`; None: the pairs' recorded
      groups, else each pair its own page; `pairs_own_page` counts the pairs resampled as a page of their own);
    * 'below initialisation': below it by more than the interval;
    * 'not above initialisation': within the interval.

    A warning says what the verdict means when it is not 'learning'."""
    from marge.eval.evaluation import (
        centred_unit,
        clustered_bootstrap,
        fitted_centre,
        own_page_pairs,
        page_sums,
        pair_pages,
        raw_relevance_vectors,
        retrieval_hits,
    )
    from marge.model.embedding import encode_texts

    device = str(device)

    def scored(model) -> tuple[dict, np.ndarray | None]:
        c = fitted_centre(model, centre, tokenizer.specials, device=device)
        return retrieval_hits(model, tokenizer, pairs, c, device=device), c

    trained_hits, trained_centre = scored(trained)
    initial = [scored(m) for m in initials]
    init_hits = {k: np.mean([h[k] for h, _ in initial], axis=0) for k in trained_hits}
    if pages is None:
        pages = pair_pages(pairs, None)
    index = {p: i for i, p in enumerate(sorted({p for v in pages.values() for p in v.tolist()}))}
    diff = clustered_bootstrap(*page_sums({k: trained_hits[k].astype(np.float64) - init_hits[k] for k in trained_hits},
                                          pages, index), resamples=resamples)
    texts = list(dict.fromkeys(text for p in pairs for text in p.sources))[:spread_texts]
    rows = encode_texts(tokenizer, texts, trained.cfg.max_positions)
    raw = raw_relevance_vectors(trained, rows, tokenizer.specials, device=device)
    spread = spread_of(centred_unit(raw, trained_centre))
    variation = 1.0 if trained_centre is None else float(
        np.linalg.norm(raw - trained_centre, axis=1).mean() / max(np.linalg.norm(raw, axis=1).mean(), 1e-12))
    spread_init = float(np.mean([spread_of(centred_unit(raw_relevance_vectors(m, rows, tokenizer.specials, device=device), c))
                                 for m, (_, c) in zip(initials, initial)]))
    p = float(np.mean([v.mean() for v in trained_hits.values()]))
    p0 = float(np.mean([v.mean() for v in init_hits.values()]))
    lo, hi = diff["ci95"]
    interval = f"{diff['mean']:+.3f} (95% CI {lo:+.3f} to {hi:+.3f}, held-out pages resampled)"
    if spread >= COLLAPSED_SPREAD or variation < COLLAPSED_VARIATION:
        verdict = "collapsed"
        warning = (f"g has collapsed: unrelated documents have a mean cosine of {spread:.3f} (at initialisation "
                   f"{spread_init:.3f}), so the index links documents at random; held-out P@1 {p:.3f} vs {p0:.3f} at "
                   "initialisation. This recipe does not learn to retrieve at this scale: start from "
                   "deploy/configs/learning.yaml (experiments/mechanism/README.md).")
    elif lo > 0:
        verdict, warning = "learning", None
    elif hi < 0:
        verdict = "below initialisation"
        warning = (f"g retrieves worse than at initialisation: held-out P@1 {p:.3f} vs {p0:.3f}, {interval}; the "
                   "index is getting worse. Train longer, or start from deploy/configs/learning.yaml "
                   "(experiments/mechanism/README.md).")
    else:
        verdict = "not above initialisation"
        warning = (f"g retrieves no better than at initialisation: held-out P@1 {p:.3f} vs {p0:.3f}, {interval}, "
                   "an interval that holds 0. Train longer, or start from deploy/configs/learning.yaml "
                   "(experiments/mechanism/README.md).")
    directions = {k: float(v.mean()) for k, v in trained_hits.items()}
    directions_init = {k: float(v.mean()) for k, v in init_hits.items()}
    return {"verdict": verdict, "warning": warning, "spread": spread, "spread_at_init": spread_init,
            "variation": variation,
            "p_at_1": p, "p_at_1_at_init": p0, "difference": diff["mean"], "difference_ci95": diff["ci95"],
            "initialisations": len(initials), "pages": len(index), "pairs_own_page": own_page_pairs(pages),
            "directions_above_init": sum(directions[k] > directions_init[k] for k in directions),
            "directions": len(directions), "p_at_1_by_direction": directions,
            "p_at_1_at_init_by_direction": directions_init}


def describe_g_health(health: dict) -> str:
    """The one-line report of `g_health` for a progress log."""
    from marge.eval.evaluation import describe_pages

    lo, hi = health["difference_ci95"]
    pages = describe_pages(health["pages"], health.get("pairs_own_page", 0))
    scored, baselines, cut_off = verdict_context(health)
    return (f"[g] {health['verdict']} | held-out P@1 {health['p_at_1']:.3f} vs {health['p_at_1_at_init']:.3f} at "
            f"initialisation (mean of {health['initialisations']} random inits, g centred alike{baselines}): "
            f"{health['difference']:+.3f}, 95% CI {lo:+.3f} to {hi:+.3f} over {pages} | {scored}"
            f"spread {health['spread']:.3f} (at initialisation {health['spread_at_init']:.3f}){cut_off}")


def verdict_context(health: dict) -> tuple[str, str, str]:
    """What the verdict line adds when `health` has it: the snapshot scored (`snapshot_step`), chance and char
    n-gram TF-IDF on the same pairs (`chance`, `tfidf_p_at_1`), the languages cut off from cross-lingual links
    (`languages_cut_off`)."""
    step = health.get("snapshot_step")
    scored = "" if step is None else f"snapshot step {step} | "
    known = [f"{name} {health[key]:.3f}" for name, key in (("chance", "chance"), ("char TF-IDF", "tfidf_p_at_1"))
             if health.get(key) is not None]
    langs = sorted({c["language"] for c in health.get("languages_cut_off") or []})
    return (scored, f"; {', '.join(known)}" if known else "",
            f" | cut off from cross-lingual links: {', '.join(langs)}" if langs else "")


def loggable(health: dict) -> dict:
    """A health record's scalar figures, rounded, for a log line (no per-direction or per-item lists)."""
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in health.items()
            if not isinstance(v, (list, dict))}


class HealthMonitor:
    """The probe set and held-out pairs of a run's `health` settings, measured on demand (no Ray here).

    Trainer rank 0 (which also exports the figures as Ray gauges) and the single-process experiment both
    measure through this, so the figures of the two modes are the same computation.
    """

    def __init__(self, health_cfg: HealthConfig, heldout_pairs: str | None, tokenizer, seed: int = 0):
        from marge.eval.evaluation import PairSet, read_pairs

        self.cfg, self.tokenizer = health_cfg, tokenizer
        h = health_cfg
        self.probe: list[ProbeItem] | None = None
        self.aligned: list[AlignedItem] | None = None
        if h.documents and Path(h.documents).exists():
            self.probe = build_probe(Path(h.documents), tokenizer, h.probe_size, h.max_evidence, h.max_tokens, seed=seed)
            if h.aligned_probe_size:
                self.aligned = build_aligned_probe(Path(h.documents), tokenizer, h.aligned_probe_size, h.max_evidence,
                                                   h.max_tokens, h.aligned_min_tokens, seed=seed)
        elif h.documents:
            log.warning("health.documents %s not found: no evidence-gain probe", h.documents)
        pairs_path = h.pairs or heldout_pairs
        self.pairs = None
        if h.pairs_per_language and pairs_path and Path(pairs_path).exists():
            n = h.pairs_per_language
            self.pairs = [PairSet(p.src_lang, p.tgt_lang, p.sources[:n], p.targets[:n], p.groups and p.groups[:n])
                          for p in read_pairs(Path(pairs_path), tokenizer.languages)]

    def measure(self, model: Marge, device: str | torch.device = "cpu") -> dict:
        """Probe health (evidence gain, cosines, spread of g, beta) and held-out P@1 at `health.eval_layer`."""
        from marge.eval.evaluation import evaluate_model, mean_score

        out: dict = {}
        if self.probe:
            out.update(probe_health(model, self.probe, self.tokenizer.specials, device))
        if self.aligned:
            out.update(aligned_evidence_gain(model, self.aligned, self.tokenizer.specials, device))
        if self.pairs:
            was_training = model.training
            model.eval()
            p_at_1 = evaluate_model(model, self.tokenizer, self.pairs, self.cfg.eval_layer, device=str(device))
            model.train(was_training)
            out["p_at_1"] = p_at_1
            out["heldout_p_at_1"] = mean_score(p_at_1)
        return out
