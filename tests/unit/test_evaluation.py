"""Retrieval metrics on constructed cases, the pairs reader, and the TF-IDF baseline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from marge.eval.evaluation import (
    PairsError,
    PairSet,
    cosine_matrix,
    evaluate_model,
    evaluate_tfidf,
    margin_matrix,
    precision_at_1,
    read_pairs,
)
from marge.model.embedding import mean_layer_vectors


def test_identity_encoder_gives_p_at_1_of_one_and_shuffled_pairs_give_chance():
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(200, 32))
    assert precision_at_1(cosine_matrix(vectors, vectors)) == 1.0
    assert precision_at_1(margin_matrix(cosine_matrix(vectors, vectors))) == 1.0
    shuffled = vectors[rng.permutation(200)]
    p = precision_at_1(cosine_matrix(vectors, shuffled))
    assert p <= 0.03  # chance is 1/200 (plus the few fixed points of the permutation)
    noise = [precision_at_1(cosine_matrix(rng.normal(size=(200, 32)), rng.normal(size=(200, 32)))) for _ in range(5)]
    assert np.mean(noise) < 0.02


def test_margin_corrects_a_hub():
    # target 0 is a hub: similar to every source; cosine picks it for everyone, margin does not
    sim = np.full((4, 4), 0.1) + np.eye(4) * 0.5
    sim[:, 0] += 0.55
    assert precision_at_1(sim) == 0.25
    assert precision_at_1(margin_matrix(sim, k=2)) == 1.0


def test_tfidf_on_identical_and_shuffled_texts():
    texts = [f"document number {i} talks about topic {i * 7 % 13} and cells {i}" for i in range(50)]
    same = [PairSet("en", "de", texts, texts)]
    assert evaluate_tfidf(same) == {"en->de": 1.0, "de->en": 1.0}
    shuffled = [PairSet("en", "de", texts, list(reversed(texts)))]
    assert evaluate_tfidf(shuffled)["en->de"] <= 0.06


def test_read_pairs_groups_by_language_pair_and_names_bad_lines(tmp_path, demo_raw):
    pairs = read_pairs(demo_raw / "heldout_pairs.tsv")
    assert {(p.src_lang, p.tgt_lang) for p in pairs} >= {("en", "de"), ("en", "zh"), ("en", "ru")}
    assert all(len(p.sources) == len(p.targets) >= 100 for p in pairs)
    bad = tmp_path / "bad.tsv"
    bad.write_text("en\thello world\tde\tHallo Welt\nen\tonly three\tde\n", encoding="utf-8")
    with pytest.raises(PairsError, match=r"bad\.tsv:2: expected 4 tab-separated fields"):
        read_pairs(bad)
    bad.write_text("english\thello\tde\tHallo\n", encoding="utf-8")
    with pytest.raises(PairsError, match=r"bad\.tsv:1: unknown language code 'english'"):
        read_pairs(bad)


def test_mean_pooling_ignores_padding_and_specials(small_corpus):
    from marge.contracts.corpus import Corpus
    from marge.model.architecture import preset
    from marge.model.network import Marge

    tok = Corpus.open(small_corpus).tokenizer()
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=tok.vocab_size)).eval()
    rows = [[2, 50, 60, 70, 3], [2, 50, 60, 70, 3, 0, 0, 0]]
    v = mean_layer_vectors(model, rows, tok.specials, layer=2)
    np.testing.assert_allclose(v[0], v[1], rtol=1e-5, atol=1e-6)
    pairs = [PairSet("en", "de", ["The cell is selected.", "Open the file."], ["Die Zelle ist markiert.", "Öffnen Sie die Datei."])]
    result = evaluate_model(model, tok, pairs)  # default layer: min(5, 3 encoder layers)
    assert set(result) == {"en->de", "de->en"} and all(0.0 <= x <= 1.0 for x in result.values())
    with pytest.raises(ValueError, match="encoder layers 1..3"):
        evaluate_model(model, tok, pairs, layer=5)
