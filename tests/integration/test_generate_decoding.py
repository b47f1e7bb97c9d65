"""Generation: forced language token, n-gram blocking, KV cache = no cache, length limit.

These need a server or take long; the quick tests of this subject are in tests/unit/test_generate.py (no server)."""

from __future__ import annotations

import numpy as np
import torch

from marge.contracts.batch import SpecialTokens
from marge.model.architecture import preset
from marge.model.generate import GenerationConfig, generate
from marge.model.network import Marge

SPECIALS = SpecialTokens(pad_id=0, bos_id=2, eos_id=3, lang_ids={"en": 10, "de": 11})


def model_that_loves(token_ids: list[int], vocab: int = 60) -> Marge:
    """A tiny model whose output strongly prefers cycling through `token_ids` (EOS never wins)."""
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=vocab)).eval()
    with torch.no_grad():
        # a direction the final state always has (the final norm's bias), which the loved tokens' output
        # embeddings point along; the embedding LayerNorm removes any constant added to the inputs instead
        love = torch.nn.functional.normalize(torch.randn(model.cfg.d_model), dim=0) * 3.0
        model.decoder_norm.bias.copy_(love)
        model.embed_tokens.weight.mul_(0.01)
        for t in token_ids:
            model.embed_tokens.weight[t] += love
        model.embed_tokens.weight[3] -= love  # EOS unlikely
    return model


def test_ngram_blocking_and_the_length_limit():
    model = model_that_loves([20, 21])
    source = [[30, 31, 32, 33]]
    unblocked = generate(model, source, 11, SPECIALS, GenerationConfig(beam=2, no_repeat_ngram=0, max_len_a=0, max_len_b=12))
    assert len(unblocked) <= 12
    bigrams = list(zip(unblocked, unblocked[1:]))
    assert len(bigrams) != len(set(bigrams)), f"the test model should repeat without blocking: {unblocked}"
    for n in (2, 3):
        out = generate(model, source, 11, SPECIALS, GenerationConfig(beam=3, no_repeat_ngram=n, max_len_a=0, max_len_b=12))
        grams = [tuple(out[i:i + n]) for i in range(len(out) - n + 1)]
        assert len(grams) == len(set(grams)), f"repeated {n}-gram in {out}"


def test_forced_language_token_and_cached_equals_uncached():
    torch.manual_seed(1)
    model = Marge(preset("tiny", vocab_size=80)).eval()
    rng = np.random.default_rng(0)
    source = [rng.integers(20, 80, size=9).tolist(), rng.integers(20, 80, size=5).tolist()]
    outputs = {}
    for lang in ("en", "de"):
        for cached in (True, False):
            cfg = GenerationConfig(beam=4, no_repeat_ngram=3, max_len_a=1.0, max_len_b=4, use_cache=cached)
            outputs[lang, cached] = generate(model, source, SPECIALS.lang_ids[lang], SPECIALS, cfg)
        assert outputs[lang, True] == outputs[lang, False]
        out = outputs[lang, True]
        assert not set(out) & {0, 2, 10, 11}, "specials or language tokens in the text"
    # the language token is the decoder's first input: changing it changes what follows
    assert outputs["en", True] != outputs["de", True]
