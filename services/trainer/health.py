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
"""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from marge.batch import Batch, SpecialTokens, max_text_tokens
from marge.model import Marge
from services.trainer.config import HealthConfig
from services.trainer.inputs import to_model_inputs

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
    opener = gzip.open if str(documents_jsonl).endswith(".gz") else open
    groups: dict[str, dict[str, str]] = {}
    with opener(documents_jsonl, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["language"] in tokenizer.languages:
                groups.setdefault(row.get("group", row.get("id")), {})[row["language"]] = row["text"]
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
    gold_cos, other_cos = [], []
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
    from marge.batch import as_encoder_input
    from marge.model import pad_rows

    rows = [as_encoder_input(item.target, specials) for item in probe]
    g = model.unit_relevance_vectors(pad_rows(rows, specials.pad_id).to(device))  # as the index compares them
    sims = g @ g.T
    n = len(rows)
    return float((sims.sum() - sims.diagonal().sum()) / max(1, n * (n - 1)))


def probe_health(model: Marge, probe: list[ProbeItem], specials: SpecialTokens, device="cpu") -> dict:
    out = evidence_gain(model, probe, specials, device)
    out["g_spread"] = g_spread(model, probe, specials, device)
    out["beta"] = model.beta.detach().float().cpu().tolist()
    return out


class HealthMonitor:
    """The probe set and held-out pairs of a run's `health` settings, measured on demand (no Ray here).

    Trainer rank 0 (which also exports the figures as Ray gauges) and the single-process experiment both
    measure through this, so the figures of the two modes are the same computation.
    """

    def __init__(self, health_cfg: HealthConfig, heldout_pairs: str | None, tokenizer, seed: int = 0):
        from marge.evaluation import PairSet, read_pairs

        self.cfg, self.tokenizer = health_cfg, tokenizer
        h = health_cfg
        self.probe: list[ProbeItem] | None = None
        if h.documents and Path(h.documents).exists():
            self.probe = build_probe(Path(h.documents), tokenizer, h.probe_size, h.max_evidence, h.max_tokens, seed=seed)
        elif h.documents:
            log.warning("health.documents %s not found: no evidence-gain probe", h.documents)
        pairs_path = h.pairs or heldout_pairs
        self.pairs = None
        if h.pairs_per_language and pairs_path and Path(pairs_path).exists():
            n = h.pairs_per_language
            self.pairs = [PairSet(p.src_lang, p.tgt_lang, p.sources[:n], p.targets[:n]) for p in read_pairs(Path(pairs_path))]

    def measure(self, model: Marge, device: str | torch.device = "cpu") -> dict:
        """Probe health (evidence gain, cosines, spread of g, beta) and held-out P@1 at `health.eval_layer`."""
        from marge.evaluation import evaluate_model, mean_score

        out: dict = {}
        if self.probe:
            out.update(probe_health(model, self.probe, self.tokenizer.specials, device))
        if self.pairs:
            was_training = model.training
            model.eval()
            p_at_1 = evaluate_model(model, self.tokenizer, self.pairs, self.cfg.eval_layer, device=str(device))
            model.train(was_training)
            out["p_at_1"] = p_at_1
            out["heldout_p_at_1"] = mean_score(p_at_1)
        return out
