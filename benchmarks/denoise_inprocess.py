"""Diagnostic: does the denoising contrastive loss on g survive joint training with reconstruction?

One process, no Ray or Redis: a tiny model (g = mean of layer 1, untied encoder embeddings) trains on
batches built once from its random-init index of the 128-token demo corpus, with the reconstruction
loss plus the denoising loss (`recon=1`), or the denoising loss alone (`recon=0`); `detach=1` keeps
the reconstruction gradient out of g's layers (model.relevance_layers_from_reconstruction=false).
Prints held-out P@1 at layers 0 and 1 after `minutes` of training.

    python benchmarks/denoise_inprocess.py minutes=3 w=0.3 recon=1 detach=0 [extra=32]
"""

from __future__ import annotations

import itertools
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from marge.batcher.core import BatcherConfig, DocumentStore, epoch_batches
from marge.corpus import Corpus
from marge.evaluation import evaluate_model, mean_score, read_pairs
from marge.indexer.core import LinkConfig, index_corpus
from marge.model import Marge, RelevanceEncoder, preset, relevance_state_dict
from marge.training import DenoisingContrastive, OptimConfig, build_optimizer, build_scheduler, forward_backward, optimizer_step

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("denoise_inprocess")


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = dict(a.split("=", 1) for a in argv)
    minutes, weight = float(args.get("minutes", 3)), float(args.get("w", 0.3))
    recon, detach = args.get("recon", "1") == "1", args.get("detach", "0") == "1"
    torch.manual_seed(0)
    torch.set_num_threads(2)
    corpus = Corpus.open(args.get("corpus", str(REPO / "data/prepared/demo-128")))
    tokenizer = corpus.tokenizer()
    specials = tokenizer.specials
    pairs = read_pairs(REPO / "data/demo/libreoffice-help/heldout_pairs.tsv")
    model = Marge(preset("tiny", vocab_size=tokenizer.vocab_size, max_positions=128, relevance_pooling="mean",
                         relevance_layers=1, tie_encoder_embeddings=False,
                         relevance_layers_from_reconstruction=not detach)).train()
    encoder = RelevanceEncoder(model.cfg)
    encoder.load_state_dict(relevance_state_dict(model))
    version = index_corpus(corpus, encoder.eval(), specials, Path(tempfile.mkdtemp()), 0, 0, LinkConfig(rule="document"))
    store = DocumentStore(corpus)
    batches = itertools.cycle(list(epoch_batches(version, store, BatcherConfig(max_tokens=1024), 0)))
    optim = OptimConfig(lr=1e-3, warmup_steps=50, total_steps=100000)
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim)
    denoising = DenoisingContrastive(weight, 0.6, 0.05, int(args.get("extra", 32)), list(store.tokens.values()))
    started, step = time.time(), 0
    while time.time() - started < 60 * minutes:
        batch = next(batches)
        if recon:
            forward_backward(model, batch, specials, 1.0, torch.device("cpu"), attend_to="all", seed_key=(0, step, 0),
                             denoising=denoising)
        else:
            (weight * denoising.loss(model, batch, specials, torch.device("cpu"), np.random.default_rng(step))).backward()
        optimizer_step(model, optimizer, scheduler, 1.0)
        step += 1
    model.eval()
    for layer in (0, 1):
        result = evaluate_model(model, tokenizer, pairs, layer)
        log.info("recon=%s detach=%s w=%s updates=%d layer %d: held-out P@1 %.3f", recon, detach, weight, step, layer,
                 mean_score(result))


if __name__ == "__main__":
    main(sys.argv[1:])
