"""Which vocabulary size for the CPU learning recipe? An offline comparison, no training.

For each size, a SentencePiece tokenizer is trained exactly as `marge prepare` trains it (on the training pages of
the chosen languages), then measured on the held-out pages' aligned paragraphs (the demo corpus's paragraph ids):

* chars per token: how much text a target token carries (a per-token gain means more per character when it is
  larger);
* verbatim share: the share of a paragraph's tokens that also occur in its aligned translation, i.e. what a
  decoder could copy from the evidence (mean over every ordered pair of translations), and that share times
  chars per token (copyable characters per token: what copying offers, whatever the vocabulary);
* piece TF-IDF P@1: held-out retrieval (the pairs TSV) with TF-IDF over the tokenizer's pieces (unigrams and
  bigrams): how much lexical signal the pieces themselves carry, which is what g starts from;
* the char n-gram TF-IDF P@1 of the same pairs (independent of the tokenizer, for scale).

    python benchmarks/vocab_choice.py --sizes 2000,4000,8000 --out experiments/ceiling/results/vocab.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shared"), str(ROOT)]

from marge.contracts.corpus import split_paragraphs  # noqa: E402
from marge.contracts.tokenizer import MargeTokenizer  # noqa: E402
from marge.eval.evaluation import both_directions, evaluate_tfidf, mean_score, read_pairs  # noqa: E402

LATIN = ("en", "de", "fr", "es", "it")


def read_rows(path: Path, languages: tuple[str, ...]) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [row for row in map(json.loads, f) if row["language"] in languages]


def aligned_paragraphs(rows: list[dict]) -> list[dict[str, str]]:
    by_key: dict[tuple[str, str], dict[str, str]] = {}
    for row in rows:
        for pid, text in zip(row.get("paragraph_ids") or [], split_paragraphs(row["text"])):
            by_key.setdefault((row["group"], pid), {})[row["language"]] = text
    return [texts for texts in by_key.values() if len(texts) >= 2]


def verbatim_share(tok: MargeTokenizer, aligned: list[dict[str, str]]) -> dict[str, float]:
    shares, per_direction = [], {}
    for texts in aligned:
        pieces = {lang: tok.encode(text) for lang, text in texts.items()}
        for a, target in pieces.items():
            for b, evidence in pieces.items():
                if a == b or not target:
                    continue
                seen = set(evidence)
                share = float(np.mean([p in seen for p in target]))
                shares.append(share)
                per_direction.setdefault(f"{b}->{a}", []).append(share)
    return {"mean": float(np.mean(shares)), **{k: float(np.mean(v)) for k, v in sorted(per_direction.items())}}


def piece_tfidf(tok: MargeTokenizer, pairs) -> dict[str, float]:
    from sklearn.feature_extraction.text import TfidfVectorizer

    results = {}
    for pair in pairs:
        def pieces(texts: list[str]) -> list[str]:
            return [" ".join(f"p{i}" for i in tok.encode(t)) for t in texts]

        vectorizer = TfidfVectorizer(analyzer="word", token_pattern=r"\S+", ngram_range=(1, 2), sublinear_tf=True)
        vectorizer.fit(pieces(pair.sources) + pieces(pair.targets))
        sim = (vectorizer.transform(pieces(pair.sources)) @ vectorizer.transform(pieces(pair.targets)).T).toarray()
        results.update(both_directions(sim, pair, margin=False))
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", type=Path, default=ROOT / "data/demo/libreoffice-help")
    p.add_argument("--sizes", default="2000,4000,8000")
    p.add_argument("--languages", default=",".join(LATIN))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    languages = tuple(args.languages.split(","))
    train = read_rows(args.raw / "documents.jsonl.gz", languages)
    heldout = read_rows(args.raw / "heldout_documents.jsonl.gz", languages)
    aligned = aligned_paragraphs(heldout)
    pairs = read_pairs(args.raw / "heldout_pairs.tsv", languages)
    char_tfidf = evaluate_tfidf(pairs)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        started = time.perf_counter()
        tok = MargeTokenizer.train((r["text"] for r in train), languages, size)
        texts = [t for texts in aligned for t in texts.values()]
        tokens = sum(len(tok.encode(t)) for t in texts)
        piece = piece_tfidf(tok, pairs)
        verbatim = verbatim_share(tok, aligned)
        chars_per_token = sum(len(t) for t in texts) / tokens
        rows.append({"vocab_size": size, "chars_per_token": chars_per_token, "verbatim_share": verbatim,
                     "copyable_chars_per_token": verbatim["mean"] * chars_per_token,
                     "piece_tfidf_p_at_1": mean_score(piece),
                     "piece_tfidf_p_at_1_by_direction": piece, "seconds": round(time.perf_counter() - started, 1)})
        print(json.dumps({k: rows[-1][k] for k in ("vocab_size", "chars_per_token", "copyable_chars_per_token",
                                                    "piece_tfidf_p_at_1")}
                         | {"verbatim_share": rows[-1]["verbatim_share"]["mean"]}), flush=True)
    report = {"question": "which vocabulary size for the CPU learning recipe (no training)",
              "languages": list(languages), "training_documents": len(train), "aligned_paragraph_sets": len(aligned),
              "pairs": sum(len(p.sources) for p in pairs), "char_tfidf_p_at_1": mean_score(char_tfidf), "sizes": rows,
              "command": f"python benchmarks/vocab_choice.py --sizes {args.sizes} --out {args.out}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
