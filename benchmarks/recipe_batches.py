"""Batches shaped like the learning recipe's, without a prepared corpus: for benchmarks/recipe_efficiency.py and
benchmarks/gpu_probe.py (which runs where there is no Ray, FAISS or Redis).

Documents are the demo corpus's paragraphs (data/demo/libreoffice-help, the five languages of learning-gpu.yaml), each
given `ceil(characters / 3.5)` random token ids (at most 126 text tokens: 128-position chunks). A shard holds 512 of
them in corpus order; each target is linked to its translations (the same paragraph of the same page in the other
languages) and to two random paragraphs of its own language, as the recipe's index links a document to its top
cross-lingual and monolingual neighbours (learning.yaml's links per document). The project's own greedy batcher
(`services.batcher.greedy.plan_shard_batches`) then cuts each shard into batches of `max_tokens`, and each batch carries
`negatives` unlinked documents of its shard (`add_negatives`, as the batcher adds the denoising loss's
`extra_documents`). Only the code under test comes from the tree on sys.path; this file needs only
`marge.contracts.batch.Batch` and the greedy planner from it.
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LANGUAGES = ("en", "de", "fr", "es", "it")
DEMO = Path(__file__).resolve().parents[1] / "data" / "demo" / "libreoffice-help" / "documents.jsonl.gz"
CHARS_PER_TOKEN = 3.5
MAX_TEXT_TOKENS = 126
DOCS_PER_SHARD = 512
RECIPE_NEGATIVES = 64
"""Unlinked documents each recipe batch carries: the learning recipe's `denoising_contrastive.extra_documents`."""


@dataclass
class RecipeBatches:
    batches: list  # marge.contracts.batch.Batch, each at least a quarter full (a shard's tail batch is dropped)
    corpus_tokens: list[np.ndarray]  # every document's tokens (`objectives_corpus`: for trees before batches carried
    # the denoising loss's negatives)
    plan_seconds_per_batch: float  # the greedy planner's time per batch it made


def demo_paragraphs(path: Path = DEMO) -> list[tuple[str, int, str, int]]:
    """(page group, paragraph number, language, text tokens) of every demo paragraph of >= 4 tokens."""
    docs = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["language"] not in LANGUAGES:
                continue
            for j, paragraph in enumerate(d["text"].split("\n\n")):
                n = min(MAX_TEXT_TOKENS, int(np.ceil(len(paragraph) / CHARS_PER_TOKEN)))
                if n >= 4:
                    docs.append((d["group"], j, d["language"], n))
    return docs


def objectives_corpus(objectives_class, made: RecipeBatches) -> dict:
    """`corpus_tokens=` for the `Objectives` of a tree whose denoising loss still drew its negatives from the whole
    corpus (before batches carried them); nothing for one whose batches carry them."""
    import inspect

    return ({"corpus_tokens": made.corpus_tokens}
            if "corpus_tokens" in inspect.signature(objectives_class).parameters else {})


def recipe_batches(count: int, max_tokens: int = 16384, seed: int = 0, vocab_size: int = 4000,
                   negatives: int = RECIPE_NEGATIVES) -> RecipeBatches:
    """`count` batches (fewer if the shards run out) from shards spread over the corpus."""
    from marge.contracts.batch import Batch
    from services.batcher import greedy
    from services.batcher.greedy import plan_shard_batches

    docs = demo_paragraphs()
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(10, vocab_size, size=d[3]).astype(np.int32) for d in docs]
    shards = [list(range(start, min(start + DOCS_PER_SHARD, len(docs)))) for start in range(0, len(docs), DOCS_PER_SHARD)]
    out, plan_seconds, planned = [], 0.0, 0
    stride = max(1, len(shards) // 8)  # shards spread over the corpus first (its languages and page lengths)
    spread = [k for start in range(stride) for k in range(start, len(shards), stride)]
    for s, ids in enumerate(shards[k] for k in spread):
        key = {(docs[i][0], docs[i][1], docs[i][2]): i for i in ids}
        by_language: dict[str, list[int]] = {}
        for i in ids:
            by_language.setdefault(docs[i][2], []).append(i)
        t, e, cross = [], [], []
        for i in ids:
            group, paragraph, language, _ = docs[i]
            links = [(key[(group, paragraph, other)], True) for other in LANGUAGES
                     if other != language and (group, paragraph, other) in key]
            pool = by_language[language]
            picks = rng.choice(len(pool), size=min(3, len(pool)), replace=False)
            links += [(pool[k], False) for k in picks if pool[k] != i][:2]
            for x, is_cross in links:
                t.append(i)
                e.append(x)
                cross.append(is_cross)
        t0 = time.perf_counter()
        plans, _ = plan_shard_batches(np.array(t), np.array(e), np.array(cross), rng.random(len(t)),
                                      {i: docs[i][3] for i in ids}, max_tokens, 100.0, 1.0, np.random.default_rng(s))
        plan_seconds += time.perf_counter() - t0
        planned += len(plans)
        if hasattr(greedy, "add_negatives"):  # a tree whose batches carry them
            greedy.add_negatives(plans, np.array(ids), negatives, np.random.default_rng([seed, s, 1]))
        for n, plan in enumerate(plans):
            if sum(docs[x][3] for x in plan.targets) < max_tokens // 4:
                continue  # a shard's tail batch
            used = list(dict.fromkeys(plan.targets + plan.evidence)) + list(getattr(plan, "negatives", []))
            position = {d: k for k, d in enumerate(used)}
            out.append(Batch(f"b{s}-{n}", 0, 0, np.array(used, dtype=np.int64), tuple(docs[d][2] for d in used),
                             tuple(tokens[d] for d in used), np.array([position[x] for x in plan.targets], dtype=np.int32),
                             np.array([position[x] for x in plan.evidence], dtype=np.int32),
                             np.array([(a, b) for a, b, _ in plan.edges], dtype=np.int32).reshape(-1, 2),
                             np.array([w for *_, w in plan.edges], dtype=np.float32)))
            if len(out) == count:
                return RecipeBatches(out, tokens, plan_seconds / max(1, planned))
    return RecipeBatches(out, tokens, plan_seconds / max(1, planned))
