"""SentencePiece tokenizer trained on the corpus, with one language token per language.

Ids 0-3 are fixed: <pad>=0, <unk>=1, <s>=2 (BOS), </s>=3 (EOS). Language tokens `[en]`, `[de]`, ...
are SentencePiece *control* symbols: they never come out of tokenizing text (a literal "[en]" in a
document stays text), they can only be placed by id, as the decoder's first input. Byte fallback
keeps every character representable (no <unk> for rare CJK characters).

Saved as two files next to the data: `tokenizer.model` (SentencePiece) and `tokenizer.json`
(languages, special ids, the model's sha256).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from marge.contracts.batch import SpecialTokens
from marge.contracts.languages import normalize_language
from marge.util.files import atomic_write_bytes, atomic_write_text

log = logging.getLogger(__name__)

TOKENIZER_FORMAT_VERSION = 1
DEFAULT_VOCAB_SIZE = 8000
"""The vocabulary asked for when none is given (`marge prepare --vocab-size`, `data.vocab_size`): one that a corpus
of a few MB fills (prepare warns when the tokenizer ends far below what was asked). The paper's is 250k."""
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


def language_token(lang: str) -> str:
    return f"[{lang}]"


class MargeTokenizer:
    DEFAULT_INPUT_SENTENCES = 2_000_000

    def __init__(self, model_bytes: bytes, languages: list[str]):
        self.model_bytes = model_bytes
        self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        self.languages = sorted(languages)
        lang_ids = {lang: self.sp.piece_to_id(language_token(lang)) for lang in self.languages}
        broken = [lang for lang, i in lang_ids.items() if i == self.sp.unk_id()]
        if broken:
            raise ValueError(f"tokenizer model has no language token for {broken}")
        self.specials = SpecialTokens(pad_id=self.sp.pad_id(), bos_id=self.sp.bos_id(), eos_id=self.sp.eos_id(),
                                      lang_ids=lang_ids, mask_id=self.sp.unk_id())
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        specials = {self.specials.pad_id, self.specials.bos_id, self.specials.eos_id, *self.specials.lang_ids.values()}
        return self.sp.decode([int(i) for i in ids if int(i) not in specials])

    def lang_id(self, lang: str) -> int:
        return self.specials.lang_id(lang)

    # --- persistence ------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        atomic_write_bytes(directory / "tokenizer.model", self.model_bytes)
        meta = {"format_version": TOKENIZER_FORMAT_VERSION, "languages": self.languages, "vocab_size": self.vocab_size,
                "pad_id": self.specials.pad_id, "bos_id": self.specials.bos_id, "eos_id": self.specials.eos_id,
                "lang_ids": self.specials.lang_ids, "sha256": self.sha256}
        atomic_write_text(directory / "tokenizer.json", json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "MargeTokenizer":
        directory = Path(directory)
        model_path, meta_path = directory / "tokenizer.model", directory / "tokenizer.json"
        for p in (model_path, meta_path):
            if not p.exists():
                raise FileNotFoundError(f"{p} is missing: point at a folder written by `marge prepare`")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format_version") != TOKENIZER_FORMAT_VERSION:
            raise ValueError(f"{meta_path}: tokenizer format_version {meta.get('format_version')!r} is not "
                             f"{TOKENIZER_FORMAT_VERSION}; re-run `marge prepare` with this version of marge")
        model_bytes = model_path.read_bytes()
        tok = cls(model_bytes, meta["languages"])
        if tok.sha256 != meta["sha256"]:
            raise ValueError(f"{model_path} does not match the sha256 in {meta_path}: the files were changed "
                             "separately; re-run `marge prepare`")
        return tok

    # --- training ----------------------------------------------------------------------------

    @classmethod
    def train(cls, texts: Iterable[str], languages: Iterable[str], vocab_size: int,
              character_coverage: float = 0.9995, max_sentence_length: int = 16384,
              input_sentence_size: int = DEFAULT_INPUT_SENTENCES) -> "MargeTokenizer":
        """Train a unigram SentencePiece model on `texts` (deterministic for the same input order)."""
        langs = sorted({normalize_language(lang) for lang in languages})
        if not langs:
            raise ValueError("a tokenizer needs at least one language")
        model = io.BytesIO()
        lines = (line for text in texts for line in text.split("\n") if line.strip())
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=lines, model_writer=model, vocab_size=vocab_size, model_type="unigram",
                character_coverage=character_coverage, byte_fallback=True,
                pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                control_symbols=[language_token(lang) for lang in langs],
                max_sentence_length=max_sentence_length, input_sentence_size=input_sentence_size,
                shuffle_input_sentence=False, train_extremely_large_corpus=False, num_threads=2,
                minloglevel=2, hard_vocab_limit=False)
        except RuntimeError as e:
            if "Vocabulary size is smaller than required_chars" in str(e):
                raise ValueError(f"vocab_size {vocab_size} is too small for this corpus's characters plus the 256 "
                                 f"byte pieces and {len(langs)} language tokens ({str(e).split('.')[-3].strip()}); "
                                 "raise --vocab-size") from None
            raise
        tok = cls(model.getvalue(), langs)
        log.info("trained a %d-piece tokenizer for %s", tok.vocab_size, ", ".join(langs))
        return tok
