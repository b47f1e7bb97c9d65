"""Golden numbers: the first 20 losses of the demo recipe (`deploy/configs/tiny.yaml`: its model, objectives and
trainer settings) on a small paragraph corpus at seed 0, against the committed file. Every other parity test
compares two paths through the same code; this one catches a change that moves both (the model's maths, the
objectives, the batcher, the optimizer). Regenerate it only on purpose:

    MARGE_REGENERATE_GOLDEN=1 python -m pytest tests/unit/test_golden.py
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "tiny_losses.json"
UPDATES = 20


def first_losses(corpus_dir: Path, index_root: Path) -> dict:
    from marge.contracts.corpus import Corpus
    from marge.contracts.slots import Slots
    from marge.model.network import Marge, RelevanceEncoder
    from services.batcher.core import DocumentStore, epoch_batches
    from services.driver.config import load_config
    from services.indexer.core import index_corpus
    from services.trainer.objectives import objectives_for
    from services.trainer.step import reference_train

    cfg = load_config(REPO / "deploy/configs/tiny.yaml", [f"data.corpus={corpus_dir}", "data.max_chunk_tokens=64",
                                                          "model.max_positions=64", "batcher.max_tokens=512",
                                                          "trainer.warmup_steps=5"])  # past warm-up within 20
    corpus = Corpus.open(corpus_dir)
    tokenizer = corpus.tokenizer()
    torch.manual_seed(cfg.run.seed)
    model = Marge(cfg.model_config(vocab_size=tokenizer.vocab_size))
    index = index_corpus(corpus, RelevanceEncoder.from_model(model).eval(), tokenizer.specials, index_root, 0, 0,
                         cfg.indexer, seed=cfg.run.seed, search="torch")  # version 0: the TF-IDF bootstrap
    store = DocumentStore(corpus)
    slots = Slots(cfg.trainer.num_workers, cfg.trainer.grad_accum)
    stream = (b for epoch in range(100) for b in epoch_batches(index, store, cfg.batcher, epoch, cfg.run.seed))
    steps = [[next(stream) for _ in range(slots.per_step)] for _ in range(UPDATES)]
    objectives = objectives_for(cfg.objectives, tokenizer)
    trainer = dataclasses.replace(cfg.trainer, total_steps=cfg.run.max_steps)
    torch.manual_seed(cfg.run.seed)
    records = reference_train(model, steps, objectives, trainer, cfg.run.max_steps, seed=cfg.run.seed)
    return {"losses": [r.loss for r in records], "objectives": [r.objectives for r in records],
            "batch_ids": [r.batch_ids for r in records], "torch": torch.__version__}


def test_the_first_losses_of_the_demo_recipe_are_the_golden_ones(paragraph_corpus, tmp_path):
    torch.set_num_threads(1)  # a fixed reduction order
    measured = first_losses(paragraph_corpus, tmp_path / "index")
    if os.environ.get("MARGE_REGENERATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(measured, indent=2) + "\n", encoding="utf-8")
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert measured["batch_ids"] == golden["batch_ids"]  # the same batches: the index, the batcher, the schedule
    assert measured["losses"] == pytest.approx(golden["losses"], rel=2e-4, abs=2e-4)
    for got, want in zip(measured["objectives"], golden["objectives"]):
        assert got == pytest.approx(want, rel=2e-4, abs=2e-4)
    assert golden["losses"][-1] < golden["losses"][0] - 0.3  # the recipe learns from its first updates (0.36 nats in 20)
