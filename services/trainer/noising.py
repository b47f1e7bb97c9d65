"""BART's noising functions (Lewis et al. 2019, "BART: Denoising Sequence-to-Sequence Pre-training", §2.2).

Each function takes one document as a 1-D array of text token ids (no BOS/EOS: the framing adds them
later) and returns a new int32 array; the input is never changed, and all randomness comes from the
`np.random.Generator` passed in, so a seeded generator gives the same noise every time.

* **token masking** — tokens replaced by the mask token at random (BERT without its 80/10/10 split).
* **token deletion** — tokens deleted at random; the model must find where text is missing.
* **text infilling** — spans with Poisson(lambda) lengths replaced by ONE mask token each, so the model
  must also tell how much is missing; a 0-length span inserts a mask where nothing was taken.
* **sentence permutation** — the document's sentences shuffled.
* **document rotation** — the document rotated so that a random token starts it.

`BartNoise` combines them in fairseq's order (`fairseq/data/denoising_dataset.py`). Our defaults are the
paper's best combination, text infilling (30% of tokens, lambda = 3) plus sentence permutation. Where
fairseq's defaults or behaviour differ:

* fairseq's `replace_length` default 0 deletes a span without a trace; ours always puts one mask token
  in its place (`replace_length=1`, the paper's text infilling).
* fairseq's `rotate` default is 0.5; ours is 0 (the paper found rotation weak, and BART-large went without).
* fairseq lets spans overlap and stops a span at the end of the document, so it masks fewer tokens than
  its budget; ours places non-overlapping spans (two may touch), and masks exactly the budget.
* fairseq splits sentences at one full-stop id; ours at every piece ending in sentence-final punctuation
  (`sentence_end_ids`), a run of them ('?', '!') closing one sentence.
* fairseq turns a `mask_random` share of spans into random tokens, drawn from the whole vocabulary
  (specials included); ours draws each mask's replacement from a range the caller chooses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from marge.contracts.config import positive, within

SENTENCE_END_CHARACTERS = ".!?。！？…" + "｡‼⁇⁈⁉" + "؟۔।॥։።။"
"""Characters that end a sentence: Latin and CJK punctuation (full-width and half-width), the paired
exclamation/question marks, and the stops of scripts the corpus may hold: Arabic question mark, Urdu full
stop, Devanagari danda and double danda, Armenian full stop, Ethiopic full stop, Myanmar section mark."""


def sentence_end_ids(pieces: list[str]) -> np.ndarray:
    """Ids (int32, sorted) of tokenizer pieces whose text ends with a sentence-final character.

    `pieces[i]` is the text of id i, e.g. a SentencePiece piece like '▁end.' or '.'. A heuristic: an
    abbreviation piece ('▁Mr.') or a decimal number's first half ('▁3.') ends a sentence too.
    """
    endings = tuple(SENTENCE_END_CHARACTERS)
    return np.array([i for i, piece in enumerate(pieces) if piece.endswith(endings)], dtype=np.int32)


def _share_of(count: int, share: float) -> int:
    """How many of `count` items a `share` noises: rounded up, as fairseq does, so that any share above 0
    noises a short document; rounded to 9 decimals first so that a product such as 0.3 * 10 =
    3.0000000000000004 counts 3 items, not 4."""
    return math.ceil(round(share * count, 9))


def token_masking(tokens: np.ndarray, share: float, mask_id: int, rng: np.random.Generator) -> np.ndarray:
    """`tokens` with each one replaced by `mask_id` with probability `share`."""
    masked = tokens.astype(np.int32)
    masked[rng.random(len(tokens)) < share] = mask_id
    return masked


def token_deletion(tokens: np.ndarray, share: float, rng: np.random.Generator) -> np.ndarray:
    """`tokens` with each one deleted with probability `share`; a non-empty document keeps at least one."""
    keep = rng.random(len(tokens)) >= share
    if len(tokens) and not keep.any():
        # a random survivor rather than the first token, which would always give away the document's start
        keep[rng.integers(len(tokens))] = True
    return tokens[keep].astype(np.int32, copy=False)


def _span_lengths(num_to_mask: int, poisson_lambda: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson span lengths drawn until they cover `num_to_mask` tokens, the last one cut to fit exactly."""
    draws, covered = [], 0
    while covered < num_to_mask:
        draw = rng.poisson(poisson_lambda, size=num_to_mask)
        draws.append(draw)
        covered += int(draw.sum())
    lengths = np.concatenate(draws)
    running = np.cumsum(lengths)
    last = int(np.searchsorted(running, num_to_mask))  # the first span that reaches the budget
    lengths = lengths[: last + 1]
    lengths[last] -= running[last] - num_to_mask
    return lengths


def text_infilling(tokens: np.ndarray, share: float, poisson_lambda: float, mask_id: int,
                   rng: np.random.Generator, random_token_share: float = 0.0, vocab_low: int = 0,
                   vocab_high: int | None = None) -> np.ndarray:
    """`tokens` with a `share` of them hidden in spans of Poisson(`poisson_lambda`) lengths, one mask each.

    The spans do not overlap and sit at uniformly random places; a span of length 0 inserts a mask
    between two tokens. A `random_token_share` of the masks is a random id in [vocab_low, vocab_high)
    instead (fairseq's `mask_random`), so the model cannot trust every token it sees.
    """
    if poisson_lambda <= 0:
        raise ValueError(f"poisson_lambda must be > 0, got {poisson_lambda!r}")  # 0 would draw spans forever
    if random_token_share > 0 and vocab_high is None:
        raise ValueError("random_token_share > 0 needs vocab_high, the end of the random token ids' range")
    num_to_mask = _share_of(len(tokens), share)
    if num_to_mask == 0:
        return tokens.astype(np.int32)
    span_lengths = rng.permutation(_span_lengths(num_to_mask, poisson_lambda, rng))  # the cut span anywhere

    # The output is the kept tokens and one mask per span, interleaved in a uniformly random order; walking
    # it with each span's length tells which input token every kept output token is.
    num_spans = len(span_lengths)
    num_items = len(tokens) - num_to_mask + num_spans
    is_span = np.zeros(num_items, dtype=bool)
    is_span[rng.choice(num_items, size=num_spans, replace=False)] = True
    item_lengths = np.ones(num_items, dtype=np.int64)
    item_lengths[is_span] = span_lengths
    item_starts = np.cumsum(item_lengths) - item_lengths

    infilled = np.empty(num_items, dtype=np.int32)
    infilled[~is_span] = tokens[item_starts[~is_span]]
    fill = np.full(num_spans, mask_id, dtype=np.int32)
    if random_token_share > 0:
        becomes_random = rng.random(num_spans) < random_token_share
        fill[becomes_random] = rng.integers(vocab_low, vocab_high, size=int(becomes_random.sum()))
    infilled[is_span] = fill
    return infilled


def sentence_permutation(tokens: np.ndarray, sentence_ends: np.ndarray, share: float,
                         rng: np.random.Generator) -> np.ndarray:
    """`tokens` with a `share` of its sentences permuted among themselves (1.0 shuffles them all).

    A sentence ends after a token in `sentence_ends` (after the last of a run, so '?!' stays with its
    sentence); the tail after the last end is a sentence too. Sentences are moved whole.
    """
    is_end = np.isin(tokens, sentence_ends)
    closes = is_end[:-1] & ~is_end[1:]
    stops = np.flatnonzero(closes) + 1
    starts = np.concatenate(([0], stops))
    lengths = np.diff(np.concatenate((starts, [len(tokens)])))
    num_sentences = len(starts)
    num_to_permute = _share_of(num_sentences, share)
    if num_to_permute < 2:
        return tokens.astype(np.int32)
    chosen = rng.permutation(num_sentences)[:num_to_permute]
    order = np.arange(num_sentences)
    order[chosen] = chosen[rng.permutation(num_to_permute)]

    # Each output position reads from its sentence's old start plus its offset within the sentence.
    new_lengths = lengths[order]
    new_starts = np.cumsum(new_lengths) - new_lengths
    source = np.arange(len(tokens)) + np.repeat(starts[order] - new_starts, new_lengths)
    return tokens[source].astype(np.int32, copy=False)


def document_rotation(tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`tokens` rotated so that a uniformly random one of them starts the document (the first one too)."""
    if len(tokens) == 0:
        return tokens.astype(np.int32)
    start = int(rng.integers(len(tokens)))
    return np.concatenate((tokens[start:], tokens[:start])).astype(np.int32, copy=False)


@dataclass(frozen=True, kw_only=True)
class BartNoise:
    """Which of BART's noising functions a document goes through, and how hard (0 turns one off)."""

    text_infilling: float = 0.3
    """Share of tokens hidden by span infilling (the paper's best: 0.3)."""
    poisson_lambda: float = 3.0
    """Mean span length of text infilling."""
    sentence_permutation: float = 1.0
    """Share of sentences permuted (the paper's best pair: text infilling plus sentence permutation)."""
    token_masking: float = 0.0
    """Share of tokens replaced by the mask token one by one."""
    token_deletion: float = 0.0
    """Share of tokens deleted (below 1: a document keeps some text)."""
    document_rotation: float = 0.0
    """Probability that a document is rotated (fairseq's default 0.5; BART-large went without)."""
    random_token_share: float = 0.0
    """Share of text infilling's masks that are a random token instead."""

    def __post_init__(self) -> None:
        for name in ("text_infilling", "sentence_permutation", "token_masking", "document_rotation",
                     "random_token_share"):
            within(self, name, 0.0, 1.0)
        within(self, "token_deletion", 0.0, 1.0, high_open=True)
        positive(self, "poisson_lambda")


def bart_noise(tokens: np.ndarray, noise: BartNoise, mask_id: int, sentence_ends: np.ndarray,
               rng: np.random.Generator, vocab_size: int | None = None, vocab_low: int = 0) -> np.ndarray:
    """`tokens` noised as `noise` says, in fairseq's order: sentence permutation, token masking, token
    deletion, text infilling, then rotation. A non-empty document stays non-empty.

    Random tokens (`noise.random_token_share`) are ids in [vocab_low, vocab_size): pass the first ordinary
    piece's id as `vocab_low` to keep padding, BOS/EOS and language tokens out of the text.
    """
    if noise.random_token_share > 0 and vocab_size is None:
        raise ValueError("random_token_share > 0 needs vocab_size, the end of the random token ids' range")
    noised = tokens.astype(np.int32)
    if noise.sentence_permutation > 0:
        noised = sentence_permutation(noised, sentence_ends, noise.sentence_permutation, rng)
    if noise.token_masking > 0:
        noised = token_masking(noised, noise.token_masking, mask_id, rng)
    if noise.token_deletion > 0:
        noised = token_deletion(noised, noise.token_deletion, rng)
    if noise.text_infilling > 0:
        noised = text_infilling(noised, noise.text_infilling, noise.poisson_lambda, mask_id, rng,
                                noise.random_token_share, vocab_low, vocab_size)
    if noise.document_rotation > 0 and rng.random() < noise.document_rotation:
        noised = document_rotation(noised, rng)
    return noised
