"""Is g collapsed at initialisation? Spread and held-out P@1 of a fresh model's g, per architecture choice.

The paper takes g as the BOS state after 4 encoder layers and is silent on where LayerNorms go; our presets put a
LayerNorm on the token + position embeddings (as mBART does). A randomly initialised pre-LayerNorm encoder with
that norm starts its residual stream at unit scale while every layer adds only a small, document-averaged
correction (weights drawn at std 0.02), so the BOS state of every document is nearly the same vector. This
measures, for a preset's width and depth (its vocabulary cut to the tokenizer's: the rows are drawn alike):

* spread: the mean cosine of g between different held-out documents, as the index compares them (1: collapsed);
* P@1 of g on the held-out pairs (the directions the tokenizer knows), at initialisation;

for the embedding LayerNorm on and off, with BOS and with mean pooling, over a few seeds.

    python benchmarks/init_spread.py --corpus data/prepared/demo --presets paper,base,tiny --out benchmarks/results/init-spread.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shared"), str(ROOT)]

from marge.contracts.corpus import Corpus  # noqa: E402
from marge.eval.evaluation import PairSet, evaluate_model, mean_score, read_pairs  # noqa: E402
from marge.model.architecture import init_parameters, preset  # noqa: E402
from marge.model.network import RelevanceEncoder  # noqa: E402
from services.trainer.health import relevance_spread  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="a prepared corpus (its tokenizer is used)")
    p.add_argument("--pairs", type=Path, default=ROOT / "data/demo/libreoffice-help/heldout_pairs.tsv")
    p.add_argument("--presets", default="paper,base,tiny")
    p.add_argument("--pairs-per-direction", type=int, default=100)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    tok = Corpus.open(args.corpus).tokenizer()
    n = args.pairs_per_direction
    pairs = [PairSet(s.src_lang, s.tgt_lang, s.sources[:n], s.targets[:n]) for s in read_pairs(args.pairs, tok.languages)]
    texts = list(dict.fromkeys(t for s in pairs for t in s.sources))[:256]
    rows = []
    for name in args.presets.split(","):
        for layernorm in (True, False):
            for pooling in ("bos", "mean"):
                spreads, scores = [], []
                started = time.perf_counter()
                for seed in range(args.seeds):
                    torch.manual_seed(seed)
                    cfg = preset(name, vocab_size=tok.vocab_size, embedding_layernorm=layernorm, relevance_pooling=pooling)
                    encoder = RelevanceEncoder(cfg)
                    init_parameters(encoder, cfg.init_std, cfg.pad_id)  # the full model's initialisation
                    encoder.eval()
                    spreads.append(relevance_spread(encoder, tok, texts))
                    scores.append(mean_score(evaluate_model(encoder, tok, pairs, "g")))
                row = {"preset": name, "d_model": cfg.d_model, "relevance_layers": cfg.relevance_layers,
                       "embedding_layernorm": layernorm, "pooling": pooling,
                       "spread": float(np.mean(spreads)), "spread_by_seed": spreads,
                       "p_at_1_g": float(np.mean(scores)), "p_at_1_g_by_seed": scores,
                       "seconds": round(time.perf_counter() - started, 1)}
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("preset", "embedding_layernorm", "pooling", "spread", "p_at_1_g")}),
                      flush=True)
    chance = float(np.mean([1.0 / len(s.sources) for s in pairs]))
    report = {"question": "is g collapsed at initialisation?", "tokenizer_languages": tok.languages,
              "directions": 2 * len(pairs), "pairs_per_direction": n, "chance_p_at_1": chance, "seeds": args.seeds,
              "rows": rows,
              "command": f"python benchmarks/init_spread.py --corpus {args.corpus} --presets {args.presets} --out {args.out}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
