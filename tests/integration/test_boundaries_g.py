"""The boundaries the README promises: the library knows no stage and no tool, no stage knows the driver, the command
line or another stage, the batch contract needs no torch, and every consumer of g computes the same vectors.

These need a server or take long; the quick tests of this subject are in tests/unit/test_boundaries.py (no server)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "shared" / "marge"
STAGES = ("indexer", "batcher", "trainer", "retrieval")


def test_indexer_service_and_trainer_compute_the_same_unit_g(small_corpus, tmp_path):
    """For one snapshot and the same documents: the vectors the indexer stores in FAISS, the query vectors the
    retrieval service computes from the documents' text, and the trainer model's g agree (centring included)."""
    from marge.contracts.batch import as_encoder_input
    from marge.contracts.corpus import Corpus
    from marge.model.architecture import preset
    from marge.model.layers import pad_rows
    from marge.model.network import Marge
    from marge.model.snapshot import load_relevance_encoder, publish_snapshot
    from services.indexer.config import IndexerConfig
    from services.indexer.core import index_corpus
    from services.retrieval.version_index import LoadedIndex

    corpus = Corpus.open(small_corpus)
    tok = corpus.tokenizer()
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=tok.vocab_size, max_positions=128, relevance_pooling="mean",
                         relevance_centering=True))
    with torch.no_grad():  # a centre far from zero, so that a consumer which forgot it would disagree
        model.relevance_center.copy_(model.relevance_vectors(pad_rows(
            [as_encoder_input(t, tok.specials) for t in corpus.read_shard(0).tokens[:32]], tok.specials.pad_id)).mean(0))
    assert model.relevance_center.norm() > 0.1
    run = tmp_path / "run"
    snapshot = publish_snapshot(run / "snapshots", model, 7, tok.sha256)
    version = index_corpus(corpus, load_relevance_encoder(snapshot), tok.specials, run / "index", 0, 7, IndexerConfig())

    shard = corpus.read_shard(0)
    ids = shard.doc_ids[:20]
    stored = np.stack([version.read_faiss(0).reconstruct(int(i)) for i in ids])
    trainer = model.eval().unit_relevance_vectors(pad_rows([as_encoder_input(t, tok.specials) for t in shard.tokens[:20]],
                                                           tok.specials.pad_id)).detach().numpy()
    service = LoadedIndex(version, run, corpus, tok)
    queries = np.stack([service.embed(text) for text in shard.texts[:20]])
    same_tokens = [tok.encode(text) == list(t) for text, t in zip(shard.texts[:20], shard.tokens[:20])]
    np.testing.assert_allclose(stored, trainer, atol=1e-5)
    np.testing.assert_allclose(queries[same_tokens], trainer[same_tokens], atol=1e-5)
    assert sum(same_tokens) >= 15
