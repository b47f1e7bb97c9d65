"""Does a pre-trained checkpoint already tell a translation from another paragraph, before any fine-tuning?

Two zero-shot scores of each pawsx pair (data/demo/tasks/pawsx), each thresholded at the value that is most
accurate on the en-de validation set, then scored on test per language pair:

    relevance      f(text, pair) = cos(g(text), g(pair)), MARGE's own retrieval score (as the index uses it)
    evidence gain  NLL(pair | no evidence) - NLL(pair | text), nats/token: how much reading the text helps the
                   decoder reconstruct the pair, MARGE's pre-training objective

If neither separates the classes, the checkpoint holds nothing a classifier could transfer to other languages
(experiments/finetune/README.md). Usage:

    python benchmarks/pawsx_probe.py --checkpoint runs/marge600/ray_train/marge600/step-00000600 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "shared")]

from marge.contracts.batch import as_decoder_input, as_encoder_input, as_labels  # noqa: E402
from marge.contracts.tokenizer import MargeTokenizer  # noqa: E402
from marge.model.finetuned import own_input_memory  # noqa: E402
from marge.model.layers import pad_rows  # noqa: E402
from marge.model.restore import load_model  # noqa: E402

MAX_TOKENS = 120
BATCH = 32


def read_rows(folder: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]


class Probe:
    def __init__(self, checkpoint: Path):
        self.model = load_model(checkpoint)
        self.tokenizer = MargeTokenizer.load(checkpoint)
        self.specials = self.tokenizer.specials

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)[:MAX_TOKENS]

    @torch.no_grad()
    def relevance(self, rows: list[dict]) -> np.ndarray:
        def vectors(texts: list[str]) -> torch.Tensor:
            return torch.cat([self.model.unit_relevance_vectors(pad_rows(
                [as_encoder_input(self.ids(t), self.specials) for t in texts[i:i + BATCH]], self.specials.pad_id))
                for i in range(0, len(texts), BATCH)])

        return (vectors([r["text"] for r in rows]) * vectors([r["text_pair"] for r in rows])).sum(-1).numpy()

    @torch.no_grad()
    def nll(self, evidence: list[str], targets: list[str], languages: list[str]) -> np.ndarray:
        """Mean per-token NLL of each target, the decoder reading its own evidence document."""
        out = []
        for i in range(0, len(targets), BATCH):
            enc = pad_rows([as_encoder_input(self.ids(t), self.specials) for t in evidence[i:i + BATCH]],
                           self.specials.pad_id)
            ids = [self.ids(t) for t in targets[i:i + BATCH]]
            dec = pad_rows([as_decoder_input(x, lang, self.specials) for x, lang in zip(ids, languages[i:i + BATCH])],
                           self.specials.pad_id)
            labels = pad_rows([as_labels(x, self.specials) for x in ids], self.specials.pad_id)
            evidence_docs, cross = own_input_memory(self.model, enc)
            logp = self.model.logits(self.model.decode(dec, evidence_docs.memory_1LD, cross)).log_softmax(-1)
            token_nll = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            real = labels != self.specials.pad_id
            out.append(((token_nll * real).sum(1) / real.sum(1)).numpy())
        return np.concatenate(out)

    def evidence_gain(self, rows: list[dict]) -> np.ndarray:
        pairs, languages = [r["text_pair"] for r in rows], [r["pair_language"] for r in rows]
        return self.nll([""] * len(rows), pairs, languages) - self.nll([r["text"] for r in rows], pairs, languages)


def thresholded(valid_scores: np.ndarray, valid_gold: np.ndarray, test_scores: np.ndarray, test_rows: list[dict]) -> dict:
    threshold = max(np.unique(valid_scores), key=lambda t: ((valid_scores >= t) == valid_gold).mean())
    correct = defaultdict(list)
    for row, score in zip(test_rows, test_scores):
        correct[f"{row['language']}-{row['pair_language']}"].append((score >= threshold) == (row["label"] == "translation"))
    by_language = {k: round(float(np.mean(v)), 3) for k, v in sorted(correct.items())}
    zero_shot = [v for k, v in by_language.items() if k != "en-de"]
    return {"threshold": float(threshold), "valid_accuracy": round(float(((valid_scores >= threshold) == valid_gold).mean()), 3),
            "median_translation": float(np.median(valid_scores[valid_gold])),
            "median_other": float(np.median(valid_scores[~valid_gold])),
            "valid_p10_p90": [float(np.percentile(valid_scores, 10)), float(np.percentile(valid_scores, 90))],
            "test_by_language": by_language, "zero_shot_mean": round(float(np.mean(zero_shot)), 3) if zero_shot else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--tasks", type=Path, default=REPO / "data" / "demo" / "tasks" / "pawsx")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    probe = Probe(args.checkpoint)
    valid, test = read_rows(args.tasks, "valid"), read_rows(args.tasks, "test")
    gold = np.array([r["label"] == "translation" for r in valid])
    result = {"checkpoint": str(args.checkpoint),
              "relevance": thresholded(probe.relevance(valid), gold, probe.relevance(test), test),
              "evidence_gain": thresholded(probe.evidence_gain(valid), gold, probe.evidence_gain(test), test)}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
