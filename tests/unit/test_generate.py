"""Generation: forced language token, n-gram blocking, KV cache = no cache, length limit.

The tests of this subject that need a server or take long are in tests/integration/test_generate_decoding.py."""

from __future__ import annotations

import torch

from marge.contracts.batch import SpecialTokens
from marge.model.architecture import preset
from marge.model.generate import GenerationConfig, banned_tokens, generate
from marge.model.network import Marge

SPECIALS = SpecialTokens(pad_id=0, bos_id=2, eos_id=3, lang_ids={"en": 10, "de": 11})


def test_banned_tokens_complete_repeated_ngrams():
    assert banned_tokens([5, 6, 7, 5, 6], 3) == {7}
    assert banned_tokens([5, 6, 7, 5, 6], 2) == {7}
    assert banned_tokens([5, 5, 5], 2) == {5}
    assert banned_tokens([1, 2, 3], 0) == set()
    assert banned_tokens([1, 2], 3) == set()


def test_forced_token_is_what_the_decoder_sees_first(monkeypatch):
    torch.manual_seed(2)
    model = Marge(preset("tiny", vocab_size=40)).eval()
    seen = []
    original = model.decode

    def spy(decoder_in, *args, **kwargs):
        seen.append(decoder_in[:, 0].tolist())
        return original(decoder_in, *args, **kwargs)

    monkeypatch.setattr(model, "decode", spy)
    generate(model, [[20, 21, 22]], SPECIALS.lang_ids["de"], SPECIALS, GenerationConfig(beam=2, max_len_b=3, max_len_a=0))
    assert seen[0] == [11, 11]
