"""Diagnostic: how fast can a model learn to use evidence when the evidence is known to be right?

Trains in one process on "oracle" batches, whose evidence for each target is the same page in other
languages (from the corpus's group metadata, i.e. translations), and tracks the probe's evidence gain.
This is not MARGE (nothing is retrieved): it bounds what the retrieval loop can reach in the same time.

    python benchmarks/oracle_evidence.py --minutes 20 --out runs/oracle [config overrides]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

from marge.batch import Batch
from marge.corpus import Corpus

log = logging.getLogger("oracle")


def oracle_batches(corpus: Corpus, max_tokens: int, evidence_per_target: int, rng: np.random.Generator):
    """Endless batches: a few targets, each with translations of its page as its only linked evidence."""
    docs = []
    for s in range(corpus.num_shards):
        d = corpus.read_shard(s)
        docs += list(zip(d.doc_ids.tolist(), d.langs, d.groups, d.tokens))
    by_group: dict[str, list] = {}
    for doc in docs:
        by_group.setdefault(doc[2], []).append(doc)
    groups = [g for g, members in by_group.items() if len({m[1] for m in members}) >= 2]
    n = 0
    while True:
        chosen, cost = [], 0
        for g in rng.permutation(groups):
            members = by_group[g]
            target = members[int(rng.integers(len(members)))]
            others = [m for m in members if m[1] != target[1]]
            evidence = [others[i] for i in rng.permutation(len(others))[:evidence_per_target]]
            need = len(target[3]) + 1 + sum(len(e[3]) + 2 for e in evidence)
            if cost + need > max_tokens:
                if chosen:
                    break
                continue
            chosen.append((target, evidence))
            cost += need
        uniq, langs, toks = {}, [], []
        for target, evidence in chosen:
            for doc in (target, *evidence):
                if doc[0] not in uniq:
                    uniq[doc[0]] = len(uniq)
                    langs.append(doc[1])
                    toks.append(doc[3])
        targets = [uniq[t[0]] for t, _ in chosen]
        evidence_docs = list(dict.fromkeys(uniq[e[0]] for _, ev in chosen for e in ev))
        e_pos = {d: j for j, d in enumerate(evidence_docs)}
        edges = [(i, e_pos[uniq[e[0]]]) for i, (_, ev) in enumerate(chosen) for e in ev]
        yield Batch(f"oracle-{n}", 0, 0, np.array(list(uniq), dtype=np.int64), tuple(langs), tuple(toks),
                    np.array(targets, dtype=np.int32), np.array(evidence_docs, dtype=np.int32),
                    np.array(edges, dtype=np.int32).reshape(-1, 2), np.ones(len(edges), dtype=np.float32))
        n += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--steps", type=int, default=2400, help="batches prepared per rank (the run stops on time)")
    p.add_argument("--config", default="deploy/configs/learning.yaml")
    p.add_argument("--max-tokens", type=int, default=2048, help="token budget of one rank's batch")
    p.add_argument("--evidence", type=int, default=2, help="translations per target")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import dataclasses

    from services.driver.config import load_config, with_absolute_paths
    from services.driver.pipeline import make_trainer, trainer_job
    from services.driver.resources import ray_for
    from services.trainer.init import ensure_initial_model

    cfg = load_config(args.config, [f"run.dir={args.out}", "run.name=oracle", f"run.max_minutes={args.minutes}",
                                    "objectives.marge.attend_to=linked", *args.overrides])
    cfg = with_absolute_paths(cfg)
    corpus = Corpus.open(cfg.data.corpus)
    ensure_initial_model(cfg.model_config(corpus.tokenizer().vocab_size), cfg.paths(), corpus, cfg.run.seed)
    rng = np.random.default_rng(cfg.run.seed)
    stream = oracle_batches(corpus, args.max_tokens, args.evidence, rng)
    world = cfg.trainer.num_workers
    memory = [[next(stream) for _ in range(args.steps)] for _ in range(world)]
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, max_steps=args.steps))
    deadline = time.time() + 60 * args.minutes
    with ray_for(cfg):
        make_trainer(cfg, trainer_job(cfg, None, deadline, memory_batches=memory)).fit()
    for line in (Path(cfg.run.dir) / "train_log.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "health" in r:
            h = r["health"]
            log.info("step %d loss %.3f gain %.3f gap %.4f spread %.4f P@1 %.3f", r["step"], r["loss"],
                     h.get("evidence_gain", float("nan")), h.get("relevance_gap", float("nan")),
                     h.get("g_spread", float("nan")), h.get("heldout_p_at_1", float("nan")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
