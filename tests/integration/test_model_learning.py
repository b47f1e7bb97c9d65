"""Properties of the MARGE model (tiny preset, CPU).

These need a server or take long; the quick tests of this subject are in tests/unit/test_model.py (no server)."""

from __future__ import annotations

import numpy as np
import torch
from model_inputs import SPECIALS, make_batch, tiny

from marge.contracts.batch import Batch
from marge.model.architecture import preset
from marge.model.network import Marge
from services.trainer.inputs import to_model_inputs

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_tiny_model_overfits_a_handful_of_pairs():
    torch.manual_seed(0)
    rng = np.random.default_rng(10)
    docs = [rng.integers(20, 200, size=int(n)).astype(np.int32) for n in rng.integers(8, 16, size=8)]
    # 4 targets, each with its own "translation" (a permuted copy) as evidence
    evidence = [np.roll(d, 1) for d in docs[:4]]
    tokens = tuple(docs[:4] + evidence)
    batch = Batch("overfit", 0, 0, np.arange(8, dtype=np.int64), ("en",) * 4 + ("de",) * 4, tokens,
                  np.arange(4, dtype=np.int32), np.arange(4, 8, dtype=np.int32),
                  np.array([[i, i] for i in range(4)], dtype=np.int32), np.full(4, 100.0, dtype=np.float32))
    model = Marge(preset("tiny", vocab_size=200)).train()
    inputs = to_model_inputs(batch, SPECIALS)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        loss = model(**inputs.as_kwargs()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] <= 0.1 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_denoising_contrastive_trains_g_with_fresh_negatives():
    from services.trainer.objectives import DenoisingContrastiveConfig, denoising_loss, denoising_views

    model = tiny(beta_init=0.0, relevance_pooling="mean").train()
    # 5 linked documents and 4 unlinked ones (the negatives the batcher adds: neither target nor evidence)
    batch = make_batch(np.random.default_rng(15), lengths=(20, 18, 25, 30, 22, 15, 15, 15, 15), targets=(0, 1),
                       evidence=(2, 3, 4))
    cfg = DenoisingContrastiveConfig(weight=1.0, deletion=0.5, temperature=0.05, extra_documents=4)

    def loss_at(seed: int):
        views = denoising_views(batch, cfg, SPECIALS, np.random.default_rng(seed))
        assert len(views[0]) == 5 + 4  # the batch's linked documents and its 4 negatives, two views each
        return denoising_loss(model, views, cfg.temperature)

    loss = loss_at(0)
    assert loss.item() > 0
    grads = torch.autograd.grad(loss, list(model.encoder_layers[0].parameters()))
    assert sum(g.abs().sum() for g in grads) > 0
    # a few steps on it alone make a document's two views easier to pair
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(30):
        opt.zero_grad()
        loss_at(step).backward()
        opt.step()
    assert loss_at(0).item() < loss.item()


def test_the_papers_g_does_not_start_collapsed_and_our_embedding_layernorm_would_collapse_it(paragraph_corpus):
    """The paper's g (the BOS state after 4 layers of its 1024-wide encoder) at initialisation: unrelated held-out
    paragraphs must not all look alike. With a LayerNorm on the embeddings (our choice elsewhere, not the paper's)
    they would (benchmarks/init_spread.py measures it on the held-out pairs)."""
    from marge.contracts.corpus import Corpus
    from marge.model.architecture import init_parameters
    from marge.model.network import RelevanceEncoder
    from services.trainer.health import COLLAPSED_SPREAD, relevance_spread

    tok = Corpus.open(paragraph_corpus).tokenizer()
    texts = [line.split("\t")[1] for line in (REPO / "data/demo/libreoffice-help/heldout_pairs.tsv")
             .read_text(encoding="utf-8").splitlines()[::40]][:24]
    spreads = {}
    for layernorm in (False, True):
        torch.manual_seed(0)
        cfg = preset("paper", vocab_size=tok.vocab_size, embedding_layernorm=layernorm) if layernorm else \
            preset("paper", vocab_size=tok.vocab_size)
        encoder = RelevanceEncoder(cfg)
        init_parameters(encoder, cfg.init_std, cfg.pad_id)  # as the whole model is initialised
        with torch.no_grad():
            spreads[layernorm] = relevance_spread(encoder.eval(), tok, texts)
    assert spreads[False] < 0.7 < COLLAPSED_SPREAD < spreads[True]
