"""The denoising loss's extra negatives travel in the batch: the batcher adds `BatchShape.negatives` unlinked
documents of each batch's shard from its bounded store (`add_negatives`), so no trainer reads the corpus. The batches
are otherwise those it builds without them, deterministic (the same ids when built again), and the denoising loss
reads the negatives as more documents of the batch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from marge.contracts.corpus import Corpus
from marge.model.network import Marge, RelevanceEncoder
from services.batcher.config import BatchShape
from services.batcher.core import DocumentStore, epoch_batches
from services.batcher.greedy import BatchPlan, add_negatives
from services.driver.config import load_config
from services.indexer.core import index_corpus
from services.trainer.objectives import objectives_for

REPO = Path(__file__).resolve().parents[2]
DENOISING = "objectives.denoising_contrastive={weight: 0.3, extra_documents: 3}"


def test_each_plan_gets_distinct_documents_it_does_not_hold():
    plans = [BatchPlan(targets=[1, 2], evidence=[3]), BatchPlan(targets=[4], evidence=[1, 5]), BatchPlan(targets=[9])]
    shard = np.arange(1, 11)
    add_negatives(plans, shard, 4, np.random.default_rng(0))
    for plan in plans:
        assert len(plan.negatives) == 4 == len(set(plan.negatives))
        assert not set(plan.negatives) & set(plan.targets + plan.evidence) and set(plan.negatives) <= set(shard)
    again = [BatchPlan(targets=[1, 2], evidence=[3]), BatchPlan(targets=[4], evidence=[1, 5]), BatchPlan(targets=[9])]
    add_negatives(again, shard, 4, np.random.default_rng(0))
    assert [p.negatives for p in again] == [p.negatives for p in plans]
    small = [BatchPlan(targets=[1, 2], evidence=[3])]
    add_negatives(small, np.arange(1, 6), 10, np.random.default_rng(0))
    assert sorted(small[0].negatives) == [4, 5]  # all the shard has besides the plan's own


def test_only_retrieval_batches_carry_negatives():
    with pytest.raises(ValueError, match="only retrieval batches carry them"):
        BatchShape("documents", negatives=2)


def test_the_run_config_asks_the_batcher_for_the_denoising_loss_negatives(paragraph_corpus):
    base = [f"data.corpus={paragraph_corpus}"]
    assert load_config(REPO / "deploy/configs/tiny.yaml", base).batch_shape().negatives == 0
    assert load_config(REPO / "deploy/configs/tiny.yaml", [*base, DENOISING]).batch_shape().negatives == 3


def test_batches_carry_unlinked_negatives_of_their_shard_and_are_otherwise_unchanged(paragraph_corpus, tmp_path):
    cfg = load_config(REPO / "deploy/configs/tiny.yaml", [f"data.corpus={paragraph_corpus}", "data.max_chunk_tokens=64",
                                                          "model.max_positions=64", "batcher.max_tokens=512", DENOISING])
    corpus = Corpus.open(paragraph_corpus)
    tokenizer = corpus.tokenizer()
    torch.manual_seed(0)
    model = Marge(cfg.model_config(vocab_size=tokenizer.vocab_size))
    index = index_corpus(corpus, RelevanceEncoder.from_model(model).eval(), tokenizer.specials, tmp_path / "index", 0,
                         0, cfg.indexer, seed=0, search="torch")

    def built(shape: BatchShape) -> list:
        return list(epoch_batches(index, DocumentStore(corpus), cfg.batcher, 0, 0, shape=shape))

    plain, carrying, again = built(BatchShape()), built(cfg.batch_shape()), built(cfg.batch_shape())
    assert len(plain) == len(carrying) > 3
    assert [b.batch_id for b in again] == [b.batch_id for b in carrying]  # deterministic: the same batches again
    shard_ids = {s: set(corpus.read_shard(s).doc_ids.tolist()) for s in range(corpus.num_shards)}
    for p, c in zip(plain, carrying):
        linked = len(p.doc_ids)
        assert np.array_equal(c.doc_ids[:linked], p.doc_ids)
        assert all(np.array_equal(a, b) for a, b in zip(c.doc_tokens[:linked], p.doc_tokens))
        for part in ("targets", "evidence", "edges", "edge_weights"):
            assert np.array_equal(getattr(c, part), getattr(p, part))
        assert c.cost_tokens() == p.cost_tokens()  # the negatives pass through g alone, outside the token budget
        negatives = c.doc_ids[linked:].tolist()
        assert len(negatives) == 3 and not set(negatives) & set(p.doc_ids.tolist())
        assert any(set(negatives) <= ids and set(p.doc_ids.tolist()) <= ids for ids in shard_ids.values())

    run = objectives_for(dataclasses.replace(cfg.objectives, self_evidence=None), tokenizer)  # no added copies
    views = run.prepare(carrying[0], (0, 0, 0)).parts["denoising_contrastive"]
    assert len(views["first"]) == sum(len(t) > 1 for t in carrying[0].doc_tokens)  # negatives included
