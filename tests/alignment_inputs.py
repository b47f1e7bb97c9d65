"""Paragraph-aligned documents and an encoder the alignment tests share."""

from __future__ import annotations

import torch

from marge.contracts.corpus import Corpus
from marge.model.architecture import preset
from marge.model.network import Marge, RelevanceEncoder

LATIN = ("en", "de", "fr", "es", "it")

PAGE = [
    {"id": "en:p", "group": "p", "language": "en", "paragraph_ids": ["a", "b", "c"],
     "text": "Insert a table into the current document.\n\nChoose Table - Insert Table.\n\nOK"},
    {"id": "de:p", "group": "p", "language": "de", "paragraph_ids": ["a", "c"],
     "text": "Fügt eine Tabelle in das aktuelle Dokument ein.\n\nOK"},
]


def encoder_for(corpus: Corpus, seed: int = 0) -> RelevanceEncoder:
    torch.manual_seed(seed)
    tok = corpus.tokenizer()
    model = Marge(preset("tiny", vocab_size=tok.vocab_size, max_positions=64, relevance_pooling="mean",
                         relevance_layers=1))
    return RelevanceEncoder.from_model(model).eval()


def pairs_of(links: dict) -> set[tuple[int, int]]:
    return set(zip(links["target_id"].tolist(), links["evidence_id"].tolist()))
