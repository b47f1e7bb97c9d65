"""Self-evidence warm-up (a deviation from the paper, off unless `trainer.self_evidence_prob` > 0).

Early in training the decoder has no reason to read its evidence: retrieved documents are translations
or paraphrases it cannot yet use, so the reconstruction loss ignores them and g gets no signal. Here a
share of targets also receives a *noised copy of itself* as an extra evidence document (tokens
deleted, neighbours shuffled), which the decoder learns to read and copy from within tens of updates,
as in a denoising autoencoder. The share anneals linearly to zero, leaving MARGE's own objective.
The copy is linked to its target, so the relevance path and the auxiliary losses on f see it as
relevant evidence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from marge.batch import Batch


@dataclass(frozen=True)
class SelfEvidence:
    prob: float = 0.0
    """Share of targets given a noised copy of themselves at step 0."""
    until: int = 0
    """The share falls linearly to 0 at this step."""
    deletion: float = 0.3
    """Share of the copy's tokens deleted."""
    shuffle_window: int = 3
    """Tokens move at most this far (local shuffling)."""

    def prob_at(self, step: int) -> float:
        if self.prob <= 0 or self.until <= 0 or step >= self.until:
            return 0.0
        return self.prob * (1.0 - step / self.until)


def noised(tokens: np.ndarray, cfg: SelfEvidence, rng: np.random.Generator) -> np.ndarray:
    keep = rng.random(len(tokens)) >= cfg.deletion
    kept = tokens[keep] if keep.any() else tokens[:1]
    if cfg.shuffle_window > 1 and len(kept) > 1:
        order = np.argsort(np.arange(len(kept)) + rng.uniform(0, cfg.shuffle_window, size=len(kept)), kind="stable")
        kept = kept[order]
    return kept.astype(np.int32)


def with_self_evidence(batch: Batch, cfg: SelfEvidence, step: int, rng: np.random.Generator) -> Batch:
    """The batch with noised self-copies added as evidence for a `prob_at(step)` share of its targets."""
    p = cfg.prob_at(step)
    if p <= 0:
        return batch
    chosen = [i for i in range(batch.num_targets) if rng.random() < p]
    if not chosen:
        return batch
    doc_ids, langs, tokens = list(batch.doc_ids), list(batch.doc_langs), list(batch.doc_tokens)
    evidence, edges, weights = list(batch.evidence), [tuple(e) for e in batch.edges], list(batch.edge_weights)
    fresh = -1 - int(max(0, -min(doc_ids))) if min(doc_ids) < 0 else -1
    for t in chosen:
        target_doc = int(batch.targets[t])
        doc_ids.append(fresh)
        fresh -= 1
        langs.append(batch.doc_langs[target_doc])
        tokens.append(noised(np.asarray(batch.doc_tokens[target_doc]), cfg, rng))
        evidence.append(len(doc_ids) - 1)
        edges.append((t, len(evidence) - 1))
        weights.append(1.0)
    return Batch(batch.batch_id, batch.index_version, batch.snapshot_step, np.array(doc_ids, dtype=np.int64),
                 tuple(langs), tuple(tokens), batch.targets, np.array(evidence, dtype=np.int32),
                 np.array(edges, dtype=np.int32).reshape(-1, 2), np.array(weights, dtype=np.float32))
