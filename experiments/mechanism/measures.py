"""Held-out measures of a trained run that cannot flatter it, for every checkpoint of a single-process run.

**The held-out pool.** The held-out documents (`health.documents`: pages never trained on) become paragraph
documents as `marge prepare` makes them (one paragraph a document, cut at `data.max_chunk_tokens`, at least
`data.min_document_tokens` tokens, exact duplicates dropped), sharded by page as the training corpus is
(`data.docs_per_shard`, `services.prepare.core.assign_shards`): every page in every language in one shard.

**The five evidence conditions.** Targets are 256 held-out paragraphs (`PROBE_TARGETS`, drawn as the aligned probe
draws them, with one seed for every run) less any whose text also occurs in the training corpus. Each target's
absolute NLL per target token (text tokens and EOS) is measured with, as its evidence:

    none         an empty document (BOS, EOS): the decoder reads nothing
    retrieved    the documents the arm's own index would link to it in its held-out shard: the checkpoint's g (and
                 the arm's link source at that update: TF-IDF, cos(g) + lambda * tfidf, g, or the aligned oracle),
                 its link rule and budget (`services.indexer.links.version_links`); a target the rule leaves without
                 a link reads an empty document
    retrieved_g  the same budget ranked by cos(g) alone, whatever the arm's link source (g's own retrieval)
    gold         its aligned translations (up to `health.max_evidence` other languages)
    wrong_page   the aligned translations of a paragraph of another page
    self_copy    a 70%-intact copy of itself (30% of tokens deleted)

The headline is the retrieved-evidence gain NLL(none) - NLL(retrieved); the gold gain NLL(none) - NLL(gold) is
the decoder's use of perfect evidence, beside it.

**g's P@1** on the held-out pairs (`data.heldout_pairs`), every direction among the tokenizer's languages: g of
every model (trained or at initialisation) is centred the same way, on the mean g of a fixed sample of training
documents (`marge.eval.evaluation.fitted_centre`), then compared by cosine. Hits are kept per query, with the page each
pair comes from (the group `marge prepare` recorded in the pairs file, `marge.eval.evaluation.pair_pages`), so that
intervals resample pages; `heldout.pairs_own_page` counts the pairs whose page is unknown (each a page of its own).

Every number is stored per item (per target, per query) in DIR/measures.json, keyed by update, so that the study's
report can bootstrap over seeds and pages; a second call measures only checkpoints it has not measured.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from marge.contracts.batch import max_text_tokens
from marge.contracts.corpus import Corpus, ShardDocuments
from marge.eval.evaluation import fitted_centre, own_page_pairs, pair_pages, read_pairs, retrieval_hits
from marge.model.checkpoint import checkpoint_order, complete_checkpoints, load_model_weights
from marge.model.network import Marge, RelevanceEncoder
from marge.model.restore import load_model
from marge.util.files import atomic_write_text
from services.driver.config import PipelineConfig, load_config
from services.indexer.core import embed_documents
from services.indexer.links import version_links
from services.prepare.core import assign_shards
from services.trainer.health import (
    AlignedItem,
    aligned_batch,
    build_aligned_probe,
    centre_rows,
    read_aligned_paragraphs,
    token_losses,
    unrelated_partner,
)
from services.trainer.inputs import to_model_inputs
from services.trainer.objectives import noised

log = logging.getLogger("marge.mechanism")

MEASURES_FILE = "measures.json"
MEASURES_VERSION = 1
"""Bumped when a measure changes meaning: stored measures of another version are measured again."""
MEASURE_EVERY = 250
"""Checkpoints measured: update 0 (the initial weights), every multiple of this, and the run's last."""
PROBE_TARGETS = 256
"""Held-out targets drawn for the evidence conditions (before those whose text occurs in training are dropped)."""
PROBE_SEED = 0
"""The held-out draws (probe targets, pool shards, centring documents) are the same for every run and seed, so that
runs are compared item by item."""
CONDITIONS = ("none", "retrieved", "retrieved_g", "gold", "wrong_page", "self_copy")


# ----------------------------------------------------------------------------------------------------
# The held-out data
# ----------------------------------------------------------------------------------------------------


def training_documents(corpus: Corpus) -> frozenset[tuple[str, tuple[int, ...]]]:
    """(language, tokens) of every training document: what a held-out target must not be."""
    out = set()
    for s in range(corpus.num_shards):
        docs = corpus.read_shard(s, verify_checksum=False)
        out.update((lang, tuple(t.tolist())) for lang, t in zip(docs.langs.tolist(), docs.tokens))
    return frozenset(out)


def heldout_shards(documents_jsonl: Path, tokenizer, max_chunk_tokens: int, min_tokens: int, docs_per_shard: int,
                   seed: int = 0) -> list[ShardDocuments]:
    """The held-out pages as paragraph documents in shards of whole pages (see the module docstring)."""
    paragraphs = read_aligned_paragraphs(Path(documents_jsonl), set(tokenizer.languages))
    limit = max_text_tokens(max_chunk_tokens)
    docs: list[tuple[str, str, str, str, np.ndarray]] = []  # group, paragraph id, language, text, tokens
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for (group, pid), texts in sorted(paragraphs.items()):
        for lang in sorted(texts):
            tokens = np.asarray(tokenizer.encode(texts[lang])[:limit], dtype=np.int32)
            key = (lang, tuple(tokens.tolist()))
            if len(tokens) < min_tokens or key in seen:
                continue
            seen.add(key)
            docs.append((group, pid, lang, texts[lang], tokens))
    sizes: dict[str, int] = {}
    for group, *_ in docs:
        sizes[group] = sizes.get(group, 0) + 1
    num_shards = max(1, math.ceil(len(docs) / docs_per_shard))
    shard_of = assign_shards(sizes, num_shards, seed)
    shards = []
    for s in range(num_shards):
        rows = [d for d in docs if shard_of[d[0]] == s]
        if not rows:
            continue
        shards.append(ShardDocuments(
            shard=s, doc_ids=np.arange(len(rows), dtype=np.int64) + 1_000_000 * (s + 1),
            langs=np.array([r[2] for r in rows], dtype=object), groups=np.array([r[0] for r in rows], dtype=object),
            tokens=[r[4] for r in rows], texts=[r[3] for r in rows], paragraph_ids=[(r[1],) for r in rows]))
    return shards


@dataclass
class HeldOut:
    """Everything a run's checkpoints are measured on (built once per run config)."""

    shards: list[ShardDocuments]
    items: list[AlignedItem]
    """The probe targets, each found in the pool (`where`)."""
    where: list[tuple[int, int]]
    """(shard list index, position in the shard) of each item's target."""
    pairs: list
    pages: dict[str, np.ndarray]
    centre_rows: list[list[int]]
    excluded_targets: int
    """Probe targets dropped because their text occurs in the training corpus."""


def build_heldout(cfg: PipelineConfig, targets: int = PROBE_TARGETS) -> HeldOut:
    corpus = Corpus.open(Path(cfg.data.corpus), verify_checksums=False)
    tokenizer = corpus.tokenizer()
    h, d = cfg.health, cfg.data
    if not h.documents or not Path(h.documents).exists():
        raise FileNotFoundError(f"health.documents {h.documents!r}: the held-out documents the measures need")
    seen = training_documents(corpus)
    size = targets
    everything = build_aligned_probe(Path(h.documents), tokenizer, size, h.max_evidence, h.max_tokens,
                                     h.aligned_min_tokens, seed=PROBE_SEED)
    items = build_aligned_probe(Path(h.documents), tokenizer, size, h.max_evidence, h.max_tokens,
                                h.aligned_min_tokens, seed=PROBE_SEED, exclude=seen)
    shards = heldout_shards(Path(h.documents), tokenizer, d.max_chunk_tokens, d.min_document_tokens,
                            d.docs_per_shard, seed=PROBE_SEED)
    position = {(docs.groups[i], docs.langs[i], tuple(docs.tokens[i].tolist())): (k, i)
                for k, docs in enumerate(shards) for i in range(len(docs))}
    kept, where = [], []
    for item in items:
        at = position.get((item.group, item.target_lang, tuple(item.target.tolist())))
        if at is not None:
            kept.append(item)
            where.append(at)
    pairs = read_pairs(Path(h.pairs or d.heldout_pairs), tokenizer.languages)
    centre = centre_rows(corpus, seed=PROBE_SEED)
    log.info("held-out pool: %d documents in %d shards; %d probe targets (%d dropped: text also in training)",
             sum(len(s) for s in shards), len(shards), len(kept), len(everything) - len(items))
    return HeldOut(shards, kept, where, pairs, pair_pages(pairs, Path(h.documents)), centre,
                   len(everything) - len(items))


# ----------------------------------------------------------------------------------------------------
# One checkpoint
# ----------------------------------------------------------------------------------------------------


def linked_evidence(shards: list[ShardDocuments], where: list[tuple[int, int]], units: list[np.ndarray],
                    cfg, step: int, seed: int) -> tuple[list[list[int]], dict]:
    """For each target, the positions (in its shard) of the documents the index of `cfg` at update `step` links it
    to, and the share of those links that join aligned translations."""
    links_by_shard = {}
    for k in sorted({k for k, _ in where}):
        docs = shards[k]
        links = version_links(docs, units[k], cfg, step, seed=seed + docs.shard, search="torch")
        pos = {int(d): i for i, d in enumerate(docs.doc_ids)}
        by_target: dict[int, list[int]] = {}
        for t, e in zip(links["target_id"].tolist(), links["evidence_id"].tolist()):
            by_target.setdefault(pos[t], []).append(pos[e])
        links_by_shard[k] = by_target
    evidence, cross, parallel, with_translation = [], 0, 0, 0
    for k, i in where:
        docs = shards[k]
        linked = links_by_shard[k].get(i, [])
        evidence.append(linked)
        is_cross = [docs.langs[j] != docs.langs[i] for j in linked]
        is_parallel = [docs.translations(i, j) for j in linked]
        cross += sum(is_cross)
        parallel += sum(is_parallel)
        with_translation += any(is_parallel)
    return evidence, {"crosslingual_parallel_precision": parallel / max(1, cross),
                      "targets_with_a_translation": with_translation / max(1, len(where)),
                      "targets_without_links": sum(not e for e in evidence) / max(1, len(where)),
                      "links_per_target": float(np.mean([len(e) for e in evidence])) if evidence else 0.0}


@torch.no_grad()
def reading_prefers_gold(model: Marge, held: HeldOut, specials, device: str = "cpu",
                         batch_targets: int = 32) -> dict[str, list[int]]:
    """Per target, given its gold translations and another page's translations together as evidence: whether the
    decoder's unbiased cross-attention (`reading_NM`, what relevance distillation would teach f) puts the most mass
    on a gold document, and whether f ranks a gold document first. Equal numbers of each would make chance 1/2."""
    partner = unrelated_partner(held.items)
    reading, by_f = [], []
    for start in range(0, len(held.items), batch_targets):
        chunk = range(start, min(start + batch_targets, len(held.items)))
        pairs = [(held.items[i], (*held.items[i].evidence, *held.items[partner[i]].evidence),
                  (*held.items[i].evidence_langs, *held.items[partner[i]].evidence_langs)) for i in chunk]
        inputs = to_model_inputs(aligned_batch(pairs), specials, attend_to="linked").to(device)
        out = model(**inputs.as_kwargs(), reading=True)
        for row, i in enumerate(chunk):
            visible = inputs.allowed_NM[row].nonzero().flatten()  # its gold documents first, then the others
            gold = len(held.items[i].evidence)
            reading.append(int(int(out.reading_NM[row, visible].argmax()) < gold))
            by_f.append(int(int(out.relevance_NM[row, visible].argmax()) < gold))
    return {"reading_top_is_gold": reading, "f_top_is_gold": by_f}


@torch.no_grad()
def measure_model(model: Marge, cfg: PipelineConfig, step: int, held: HeldOut, tokenizer,
                  device: str = "cpu") -> dict:
    """The five evidence conditions (and g-only retrieval) and g's P@1 hits of one model."""
    model = model.to(device).eval()
    specials = tokenizer.specials
    encoder = RelevanceEncoder.from_model(model).eval()
    units = [embed_documents(encoder, docs.tokens, specials, cfg.indexer.batch_tokens, device) for docs in held.shards]
    retrieved, retrieved_stats = linked_evidence(held.shards, held.where, units, cfg.indexer, step, cfg.run.seed)
    g_only = replace(cfg.indexer, links="g", bootstrap="none", lexical_weight=0.0, lexical_until=0)
    by_g, by_g_stats = linked_evidence(held.shards, held.where, units, g_only, step, cfg.run.seed)
    empty = np.zeros(0, dtype=np.int32)
    partner = unrelated_partner(held.items)
    rng = np.random.default_rng(0)

    def documents(positions: list[int], k: int, item: AlignedItem):
        docs = held.shards[k]
        if not positions:
            return (empty,), (item.target_lang,)
        return tuple(docs.tokens[j] for j in positions), tuple(docs.langs[j] for j in positions)

    evidence = {
        "none": [((empty,), (item.target_lang,)) for item in held.items],
        "retrieved": [documents(r, k, item) for r, (k, _), item in zip(retrieved, held.where, held.items)],
        "retrieved_g": [documents(r, k, item) for r, (k, _), item in zip(by_g, held.where, held.items)],
        "gold": [(item.evidence, item.evidence_langs) for item in held.items],
        "wrong_page": [(held.items[j].evidence, held.items[j].evidence_langs) for j in partner],
        "self_copy": [((noised(item.target, 0.3, 1, rng),), (item.target_lang,)) for item in held.items],
    }
    nll, tokens = {}, None
    for condition in CONDITIONS:
        per_token, _ = token_losses(model, [(item, docs, langs) for item, (docs, langs) in
                                            zip(held.items, evidence[condition])], specials, device)
        nll[condition] = [round(float(x.sum()), 5) for x in per_token]
        tokens = [len(x) for x in per_token]
    centre = fitted_centre(model, held.centre_rows, specials, device=device)
    hits = retrieval_hits(model, tokenizer, held.pairs, centre, device=device)
    return {"step": step, "nll_sum": nll, "tokens": tokens, "groups": [item.group for item in held.items],
            "retrieved_links": retrieved_stats, "retrieved_g_links": by_g_stats,
            "p_at_1_hits": {k: v.astype(int).tolist() for k, v in hits.items()},
            "p_at_1": float(np.mean([v.mean() for v in hits.values()])),
            "beta": float(model.beta.detach().float().mean()),
            **reading_prefers_gold(model, held, specials, device)}


# ----------------------------------------------------------------------------------------------------
# A run, a study
# ----------------------------------------------------------------------------------------------------


def measure_run(folder: Path, device: str = "auto", every: int = MEASURE_EVERY, targets: int = PROBE_TARGETS) -> dict:
    """Measure the checkpoints of the single-process run in `folder` at every `every` updates and its last (and its
    initial weights as update 0) that DIR/measures.json does not hold yet; returns the file's contents."""
    folder = Path(folder)
    device = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    path = folder / MEASURES_FILE
    stored = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    if stored.get("version") != MEASURES_VERSION:
        stored = {"version": MEASURES_VERSION, "steps": {}}
    cfg = load_config(folder / "config.yaml")
    paths = cfg.paths()
    checkpoints = {checkpoint_order(c)[0]: c for c in complete_checkpoints(Path(cfg.run.dir) / "checkpoints")}
    last = max(checkpoints, default=0)
    wanted = [0, *(s for s in sorted(checkpoints) if s % every == 0 or s == last)]
    missing = [s for s in wanted if str(s) not in stored["steps"]]
    if not missing:
        return stored
    held = build_heldout(cfg, targets)
    tokenizer = Corpus.open(Path(cfg.data.corpus), verify_checksums=False).tokenizer()
    stored["heldout"] = {"documents": sum(len(s) for s in held.shards), "shards": len(held.shards),
                         "targets": len(held.items), "targets_dropped_as_training_text": held.excluded_targets,
                         "pair_pages": len({p for v in held.pages.values() for p in v.tolist()}),
                         "pairs_own_page": own_page_pairs(held.pages)}
    stored["pair_pages"] = {k: v.tolist() for k, v in held.pages.items()}
    for step in missing:
        model = load_model_weights(paths.init_weights) if step == 0 else load_model(checkpoints[step])
        stored["steps"][str(step)] = measure_model(model, cfg, step, held, tokenizer, device)
        record = stored["steps"][str(step)]
        tok = sum(record["tokens"])
        log.info("%s update %d: P@1 %.3f | NLL none %.3f retrieved %.3f gold %.3f", folder, step, record["p_at_1"],
                 sum(record["nll_sum"]["none"]) / tok, sum(record["nll_sum"]["retrieved"]) / tok,
                 sum(record["nll_sum"]["gold"]) / tok)
        atomic_write_text(path, json.dumps(stored) + "\n")
    return stored


def measure_study(out: Path, device: str = "auto") -> None:
    """Measure every run of a study folder (`DIR/runs/<arm>/seed-<s>`) that has finished."""
    for folder in sorted(Path(out).glob("runs/*/seed-*")):
        if folder.is_dir() and (folder / "report.json").exists():
            measure_run(folder, device)
