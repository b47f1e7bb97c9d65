"""Zero-shot generation (paper §4.2): beam search over the decoder, conditioned on evidence documents.

The target-language token is forced as the first decoder input (it selects the output language),
repeated n-grams are blocked (the paper: beam 6, n = 8), keys/values are cached between steps, and
the output is at most `max_len_a * source length + max_len_b` tokens. With no target to embed at
generation time, every evidence document gets the same relevance, which shifts all cross-attention
logits equally and so changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marge.contracts.batch import SpecialTokens, as_encoder_input, max_text_tokens
from marge.model.layers import pad_rows
from marge.model.network import Marge


@dataclass(frozen=True)
class GenerationConfig:
    beam: int = 6
    no_repeat_ngram: int = 8
    max_len_a: float = 1.5
    max_len_b: int = 10
    length_penalty: float = 1.0
    min_len: int = 1
    use_cache: bool = True

    def __post_init__(self) -> None:
        if self.beam < 1:
            raise ValueError(f"beam must be >= 1, got {self.beam}")
        if self.no_repeat_ngram < 0:
            raise ValueError(f"no_repeat_ngram must be >= 0, got {self.no_repeat_ngram}")


def banned_tokens(history: list[int], n: int) -> set[int]:
    """Tokens that would complete an n-gram already present in `history` (n-gram blocking)."""
    if n <= 0 or len(history) < n:
        return set()
    prefix = tuple(history[len(history) - n + 1:]) if n > 1 else ()
    banned = set()
    for i in range(len(history) - n + 1):
        if tuple(history[i:i + n - 1]) == prefix:
            banned.add(history[i + n - 1])
    return banned


@torch.no_grad()
def generate(model: Marge, evidence_docs: list[list[int]], tgt_lang_id: int, specials: SpecialTokens,
             cfg: GenerationConfig = GenerationConfig(), device: str = "cpu") -> list[int]:
    """The best hypothesis (text token ids, without the language token or EOS) for one output.

    `evidence_docs` are the source documents' token ids (no specials); all of them are evidence.
    """
    model.eval()
    enc_rows = [as_encoder_input(doc[: max_text_tokens(model.cfg.max_positions)], specials) for doc in evidence_docs]
    evidence = model.encode_evidence(pad_rows(enc_rows, specials.pad_id).to(device))
    source_len = sum(len(d) for d in evidence_docs)
    max_len = min(int(cfg.max_len_a * source_len + cfg.max_len_b), model.cfg.max_positions - 1)
    beam = cfg.beam
    every_document = torch.ones(beam, len(evidence_docs), dtype=torch.bool, device=device)
    cross = model.cross_memory(evidence, torch.ones(beam, len(evidence_docs), device=device), every_document)
    never = {specials.pad_id, specials.bos_id, *specials.lang_ids.values()}

    # hypotheses: decoder inputs so far (language token first), their summed log-probabilities
    tokens = torch.full((beam, 1), tgt_lang_id, dtype=torch.long, device=device)
    scores = torch.zeros(beam, device=device)
    scores[1:] = float("-inf")  # all beams start identical: keep one alive
    caches = model.new_caches() if cfg.use_cache else None
    finished: list[tuple[float, list[int]]] = []
    for step in range(max_len):
        if cfg.use_cache:
            states = model.decode(tokens[:, -1:], evidence.memory_1LD, cross, caches, step)
        else:
            states = model.decode(tokens, evidence.memory_1LD, cross)
        logprobs = torch.log_softmax(model.logits(states[:, -1]).float(), dim=-1)  # beam V
        for token in never:
            logprobs[:, token] = float("-inf")
        if step < cfg.min_len:
            logprobs[:, specials.eos_id] = float("-inf")
        for b in range(beam):
            for token in banned_tokens(tokens[b, 1:].tolist(), cfg.no_repeat_ngram):
                logprobs[b, token] = float("-inf")
        candidates = (scores[:, None] + logprobs).view(-1)
        top_scores, top_idx = candidates.topk(2 * beam)
        vocab = logprobs.shape[1]
        next_beams, next_tokens, next_scores = [], [], []
        for score, idx in zip(top_scores.tolist(), top_idx.tolist()):
            if score == float("-inf"):
                break
            origin, token = divmod(idx, vocab)
            if token == specials.eos_id:
                text = tokens[origin, 1:].tolist()
                finished.append((score / max(1, len(text) + 1) ** cfg.length_penalty, text))
                continue
            next_beams.append(origin)
            next_tokens.append(token)
            next_scores.append(score)
            if len(next_beams) == beam:
                break
        if not next_beams or len(finished) >= beam:  # as fairseq: stop once `beam` hypotheses have ended
            break
        while len(next_beams) < beam:  # keep the batch shape; padding beams can never win
            next_beams.append(next_beams[0])
            next_tokens.append(specials.pad_id)
            next_scores.append(float("-inf"))
        origin_t = torch.tensor(next_beams, device=device)
        if caches is not None:  # made when cfg.use_cache
            for cache in caches:
                cache.reorder(origin_t)
        tokens = torch.cat([tokens[origin_t], torch.tensor(next_tokens, device=device)[:, None]], dim=1)
        scores = torch.tensor(next_scores, device=device)
    if not finished:  # ran out of length: take the best alive hypothesis
        best = int(torch.argmax(scores))
        text = tokens[best, 1:].tolist()
        finished.append((float(scores[best]), text))
    return max(finished, key=lambda x: x[0])[1]


def translate(model: Marge, tokenizer, text: str, tgt_lang: str, cfg: GenerationConfig = GenerationConfig(),
              device: str = "cpu") -> str:
    """Translate a document: cut into chunks that fit the encoder, translate each, join (paper §4.2)."""
    ids = tokenizer.encode(text)
    chunk = max_text_tokens(model.cfg.max_positions)
    pieces = [ids[i:i + chunk] for i in range(0, len(ids), chunk)] or [[]]
    out = [tokenizer.decode(generate(model, [piece], tokenizer.lang_id(tgt_lang), tokenizer.specials, cfg, device))
           for piece in pieces]
    return " ".join(p for p in out if p)
