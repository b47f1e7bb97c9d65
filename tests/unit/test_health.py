"""Retrieval-health probes (services.trainer.health) on constructed cases where the right answer is known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from marge.contracts.corpus import Corpus
from marge.model.architecture import preset
from marge.model.network import Marge
from services.trainer.health import build_probe, g_spread, probe_health


@pytest.fixture(scope="module")
def tokenizer(small_corpus):
    return Corpus.open(small_corpus).tokenizer()


@pytest.fixture(scope="module")
def probe(tokenizer, demo_raw):
    return build_probe(demo_raw / "heldout_documents.jsonl.gz", tokenizer, size=6, max_evidence=3, max_tokens=64)


def model_for(tokenizer, **overrides) -> Marge:
    torch.manual_seed(0)
    return Marge(preset("tiny", vocab_size=tokenizer.vocab_size, max_positions=64, **overrides)).eval()


def test_probe_items_are_one_page_in_other_languages_and_fixed_by_seed(tokenizer, probe, demo_raw):
    assert len(probe) == 6
    for item in probe:
        assert 1 <= len(item.evidence) <= 3 and item.target_lang not in item.evidence_langs
        assert len(set(item.evidence_langs)) == len(item.evidence_langs)
        assert all(len(e) <= 62 for e in (item.target, *item.evidence))
    again = build_probe(demo_raw / "heldout_documents.jsonl.gz", tokenizer, size=6, max_evidence=3, max_tokens=64)
    assert all(np.array_equal(a.target, b.target) for a, b in zip(probe, again))


def test_evidence_gain_is_zero_when_the_decoder_cannot_see_evidence(tokenizer, probe):
    model = model_for(tokenizer)
    with torch.no_grad():  # cross-attention contributes nothing: the evidence cannot change the loss
        for layer in model.decoder_layers:
            if layer.cross_attn is not None:
                layer.cross_attn.out_proj.weight.zero_()
                layer.cross_attn.out_proj.bias.zero_()
    health = probe_health(model, probe, tokenizer.specials)
    assert health["evidence_gain"] == pytest.approx(0.0, abs=1e-5)
    assert health["copy_gain"] == pytest.approx(0.0, abs=1e-5)
    assert health["evidence_gain"] == pytest.approx(health["loss_shuffled_evidence"] - health["loss_true_evidence"])
    assert health["relevance_gap"] == pytest.approx(health["relevance_cos_true"] - health["relevance_cos_shuffled"])
    assert -1 <= health["relevance_cos_true"] <= 1 and health["beta"] == [1.0]


def test_evidence_gain_sees_evidence_the_decoder_uses(tokenizer, probe):
    model = model_for(tokenizer)
    health = probe_health(model, probe, tokenizer.specials)
    # a random decoder reads its evidence: changing it changes the loss (the metric is not blind)
    assert abs(health["loss_true_evidence"] - health["loss_shuffled_evidence"]) > 1e-5
    assert abs(health["loss_copy_evidence"] - health["loss_shuffled_evidence"]) > 1e-5


def test_g_spread_is_one_for_identical_documents_and_lower_for_different_ones(tokenizer, probe):
    from dataclasses import replace

    model = model_for(tokenizer, relevance_pooling="mean")
    same = [replace(item, target=probe[0].target) for item in probe]
    assert g_spread(model, same, tokenizer.specials) == pytest.approx(1.0, abs=1e-5)
    assert g_spread(model, probe, tokenizer.specials) < 0.999
