"""BART's noising functions do what the paper describes, measured over many random documents."""

from __future__ import annotations

import math

import numpy as np
import pytest

from marge.contracts.config import FieldError
from services.trainer.noising import (
    BartNoise,
    bart_noise,
    document_rotation,
    sentence_end_ids,
    sentence_permutation,
    text_infilling,
    token_deletion,
    token_masking,
)

MASK = 1
FIRST_TEXT_ID = 10  # documents use ids from here on, so the mask never occurs in them


def documents(seed: int, count: int = 2000, low: int = 50, high: int = 400) -> list[np.ndarray]:
    """Documents of distinct token ids, so that every output token tells which input token it is."""
    rng = np.random.default_rng(seed)
    return [(rng.permutation(5000)[: rng.integers(low, high + 1)] + FIRST_TEXT_ID).astype(np.int32)
            for _ in range(count)]


def kept_positions(document: np.ndarray, noised: np.ndarray) -> np.ndarray:
    """Input positions of the output's unmasked tokens, asserting they keep their order."""
    kept = noised[noised != MASK]
    position_of = {int(token): i for i, token in enumerate(document)}
    positions = np.array([position_of[int(token)] for token in kept], dtype=np.int64)
    assert np.all(np.diff(positions) > 0), "unmasked tokens must keep their original order"
    return positions


# --- text infilling -----------------------------------------------------------------------------------


def test_text_infilling_hides_the_share_in_spans_of_mean_lambda():
    rng = np.random.default_rng(1)
    hidden = total = masks = 0
    for document in documents(seed=0):
        noised = text_infilling(document, 0.3, 3.0, MASK, rng)
        positions = kept_positions(document, noised)
        doc_hidden = len(document) - len(positions)
        assert abs(doc_hidden - 0.3 * len(document)) < 1  # the budget, rounded up
        # every run of hidden tokens left at least one mask behind in its place
        gaps = np.diff(np.concatenate(([-1], positions, [len(document)]))) - 1
        masks_per_gap = np.diff(np.flatnonzero(np.concatenate(([True], noised != MASK, [True])))) - 1
        assert np.all(masks_per_gap[gaps > 0] >= 1)
        hidden, total, masks = hidden + doc_hidden, total + len(document), masks + int((noised == MASK).sum())
    assert abs(hidden / total - 0.3) < 0.02
    # one mask per span, 0-length spans included: the mean span length is lambda (2 masks a span would halve it)
    assert abs(hidden / masks - 3.0) < 0.15


def test_each_span_becomes_one_mask_in_its_place():
    rng = np.random.default_rng(2)
    for document in documents(seed=1, count=200, low=50, high=120):
        # lambda far above the budget: the first span covers it all, so there is exactly one span
        noised = text_infilling(document, 0.3, 100.0, MASK, rng)
        budget = math.ceil(round(0.3 * len(document), 9))
        assert (noised == MASK).sum() == 1
        start = int(np.flatnonzero(noised == MASK)[0])
        expected = np.concatenate((document[:start], [MASK], document[start + budget:]))
        np.testing.assert_array_equal(noised, expected)


def test_zero_length_spans_insert_one_mask_each():
    # A budget of one token: Poisson(lambda) draws until the first non-zero one, which hides that token; the
    # zeros before it are 0-length spans, on average 1 / (1 - exp(-lambda)) - 1 of them per document.
    rng = np.random.default_rng(3)
    poisson_lambda = 0.1
    inserted, mask_places = [], set()
    for document in documents(seed=2, count=2000, low=100, high=100):
        noised = text_infilling(document, 0.01, poisson_lambda, MASK, rng)
        assert len(kept_positions(document, noised)) == len(document) - 1
        inserted.append(len(noised) - len(document))  # one mask replaced the hidden token; the rest are inserts
        mask_places |= set((np.flatnonzero(noised == MASK) * 100 // len(noised)).tolist())
    assert abs(np.mean(inserted) - (1 / (1 - math.exp(-poisson_lambda)) - 1)) < 0.9  # 9.5, 4 standard errors
    assert len(mask_places) == 100  # inserts land all over the document, not in one place


def test_random_token_share_turns_masks_into_random_tokens():
    rng = np.random.default_rng(4)
    replaced = masks = 0
    for document in documents(seed=3, count=300):
        noised = text_infilling(document, 0.3, 3.0, MASK, rng, random_token_share=0.4, vocab_low=6000,
                                vocab_high=7000)
        random_tokens = int(((noised >= 6000) & (noised < 7000)).sum())
        replaced, masks = replaced + random_tokens, masks + random_tokens + int((noised == MASK).sum())
    assert abs(replaced / masks - 0.4) < 0.03
    with pytest.raises(ValueError, match="vocab_high"):
        text_infilling(np.arange(10, 20, dtype=np.int32), 0.3, 3.0, MASK, rng, random_token_share=0.1)
    with pytest.raises(ValueError, match="poisson_lambda"):
        text_infilling(np.arange(10, 20, dtype=np.int32), 0.3, 0.0, MASK, rng)


# --- the other noising functions ----------------------------------------------------------------------


def test_sentence_permutation_moves_whole_sentences():
    rng = np.random.default_rng(5)
    question, exclamation = 7, 8
    changed = 0
    for _ in range(200):
        body = rng.permutation(np.arange(FIRST_TEXT_ID, FIRST_TEXT_ID + 100))
        cuts = np.sort(rng.choice(np.arange(1, 60), size=9, replace=False))
        # sentence 3 ends in a run of end tokens ('?!'), which stays with it; the last one has no end at all
        endings = [[question]] * 3 + [[question, exclamation]] + [[exclamation]] * 5 + [[]]
        originals = [tuple(part.tolist()) + tuple(end) for part, end in zip(np.split(body[:60], cuts), endings)]
        document = np.array(sum(originals, ()), dtype=np.int32)
        noised = sentence_permutation(document, np.array([question, exclamation], dtype=np.int32), 1.0, rng)

        # every sentence starts with a body token of its own: walk the output sentence by sentence
        by_first_token = {sentence[0]: sentence for sentence in originals}
        found, start = [], 0
        while start < len(noised):
            sentence = by_first_token[int(noised[start])]
            assert tuple(noised[start:start + len(sentence)].tolist()) == sentence
            found.append(sentence)
            start += len(sentence)
        assert sorted(found) == sorted(originals)
        changed += found != originals
    assert changed >= 190  # a full shuffle of 10 sentences gives the original order back 1 time in 10!


def test_sentence_permutation_share_moves_only_some_sentences():
    rng = np.random.default_rng(6)
    full_stop = 5
    document = np.array(sum(([t, full_stop] for t in range(FIRST_TEXT_ID, FIRST_TEXT_ID + 20)), []), dtype=np.int32)
    moved = 0
    for _ in range(100):
        noised = sentence_permutation(document, np.array([full_stop], dtype=np.int32), 0.25, rng)
        assert np.all(noised[1::2] == full_stop)  # sentences stay whole: (word, full stop) pairs
        assert sorted(noised[0::2].tolist()) == sorted(document[0::2].tolist())
        displaced = int((noised[0::2] != document[0::2]).sum())
        assert displaced <= 5  # a quarter of the 20 sentences take part
        moved += displaced
    assert moved > 250  # ... and they do move (5 chosen, about 4 of them off their place)


def test_token_deletion_deletes_the_share_and_keeps_one():
    rng = np.random.default_rng(7)
    deleted = total = 0
    for document in documents(seed=4, count=500):
        noised = token_deletion(document, 0.2, rng)
        kept_positions(document, noised)
        deleted, total = deleted + len(document) - len(noised), total + len(document)
    assert abs(deleted / total - 0.2) < 0.01
    assert all(len(token_deletion(np.array([42], dtype=np.int32), 0.999, rng)) == 1 for _ in range(100))


def test_token_masking_masks_the_share_in_place():
    rng = np.random.default_rng(8)
    masked = total = 0
    for document in documents(seed=5, count=500):
        noised = token_masking(document, 0.15, MASK, rng)
        unmasked = noised != MASK
        np.testing.assert_array_equal(noised[unmasked], document[unmasked])
        masked, total = masked + int((~unmasked).sum()), total + len(document)
    assert abs(masked / total - 0.15) < 0.01


def test_document_rotation_is_a_uniform_cyclic_shift():
    rng = np.random.default_rng(9)
    document = np.arange(FIRST_TEXT_ID, FIRST_TEXT_ID + 5, dtype=np.int32)
    starts = []
    for _ in range(1000):
        noised = document_rotation(document, rng)
        start = int(np.flatnonzero(document == noised[0])[0])
        np.testing.assert_array_equal(noised, np.roll(document, -start))
        starts.append(start)
    counts = np.bincount(starts, minlength=5)
    assert counts.min() > 150  # each of the 5 tokens starts about 200 times


# --- the combination ----------------------------------------------------------------------------------


def test_bart_noise_is_deterministic_for_a_seed():
    document = documents(seed=6, count=1)[0]
    ends = np.arange(FIRST_TEXT_ID, FIRST_TEXT_ID + 5000, 17, dtype=np.int32)
    original = document.copy()
    first = bart_noise(document, BartNoise(), MASK, ends, np.random.default_rng(11))
    again = bart_noise(document, BartNoise(), MASK, ends, np.random.default_rng(11))
    other = bart_noise(document, BartNoise(), MASK, ends, np.random.default_rng(12))
    assert first.dtype == np.int32
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    np.testing.assert_array_equal(document, original)


def test_bart_noise_with_everything_on_keeps_a_document():
    noise = BartNoise(text_infilling=1.0, token_masking=0.5, token_deletion=0.9, document_rotation=1.0,
                      random_token_share=0.5)
    rng = np.random.default_rng(13)
    for length in (1, 2, 5, 50):
        document = np.arange(FIRST_TEXT_ID, FIRST_TEXT_ID + length, dtype=np.int32)
        noised = bart_noise(document, noise, MASK, np.array([FIRST_TEXT_ID], dtype=np.int32), rng, vocab_size=100)
        assert noised.dtype == np.int32 and len(noised) >= 1 and noised.max() < 100
    with pytest.raises(ValueError, match="vocab_size"):
        bart_noise(np.arange(10, dtype=np.int32), noise, MASK, np.array([], dtype=np.int32), rng)


NOISERS = {
    "token_masking": lambda t, rng: token_masking(t, 0.5, MASK, rng),
    "token_deletion": lambda t, rng: token_deletion(t, 0.5, rng),
    "text_infilling": lambda t, rng: text_infilling(t, 0.5, 3.0, MASK, rng, 0.5, 10, 20),
    "sentence_permutation": lambda t, rng: sentence_permutation(t, np.array([11], dtype=np.int32), 1.0, rng),
    "document_rotation": lambda t, rng: document_rotation(t, rng),
    "bart_noise": lambda t, rng: bart_noise(t, BartNoise(token_masking=0.2, token_deletion=0.2,
                                                         document_rotation=1.0), MASK,
                                            np.array([11], dtype=np.int32), rng),
}


@pytest.mark.parametrize("name", sorted(NOISERS))
@pytest.mark.parametrize("length", [0, 1, 3])
def test_short_documents_give_new_int32_arrays(name, length):
    document = np.arange(FIRST_TEXT_ID, FIRST_TEXT_ID + length, dtype=np.int64)  # any int dtype comes in
    original = document.copy()
    noised = NOISERS[name](document, np.random.default_rng(14))
    assert noised.dtype == np.int32 and noised is not document
    np.testing.assert_array_equal(document, original)
    assert (len(noised) == 0) == (length == 0)


@pytest.mark.parametrize("field, value, message", [
    ("text_infilling", 1.5, "text_infilling must be in [0.0, 1.0], got 1.5"),
    ("sentence_permutation", -0.1, "sentence_permutation must be in [0.0, 1.0], got -0.1"),
    ("token_deletion", 1.0, "token_deletion must be in [0.0, 1.0), got 1.0"),
    ("poisson_lambda", 0.0, "poisson_lambda must be > 0, got 0.0"),
    ("random_token_share", 2.0, "random_token_share must be in [0.0, 1.0], got 2.0"),
])
def test_bart_noise_settings_are_checked(field, value, message):
    with pytest.raises(FieldError) as caught:
        BartNoise(**{field: value})
    assert str(caught.value) == message


def test_sentence_end_ids_pick_pieces_ending_a_sentence():
    pieces = ["<pad>", "<unk>", "▁end.", ".", "▁Mr", "▁why?", "。", "▁hello", "…", "▁x!"]
    np.testing.assert_array_equal(sentence_end_ids(pieces), [2, 3, 5, 6, 8, 9])
    assert sentence_end_ids(pieces).dtype == np.int32
