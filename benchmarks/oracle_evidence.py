"""Diagnostic: how fast can a model learn to use evidence when the evidence is known to be right?

Trains in one process on "oracle" batches, whose evidence for each target is the same page in other
languages (from the corpus's group metadata, i.e. translations), and tracks the probe's evidence gain.
This is not MARGE (nothing is retrieved): it bounds what the retrieval loop can reach in the same time.

    python benchmarks/oracle_evidence.py --minutes 10 [--preset tiny] [--set d_model=128] [--chunk-corpus DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from marge.batch import Batch
from marge.cli import parse_override
from marge.corpus import Corpus
from marge.health import build_probe, probe_health
from marge.model import Marge, preset
from marge.training import OptimConfig, build_optimizer, build_scheduler, forward_backward, optimizer_step

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
    p.add_argument("--corpus", default="data/prepared/demo")
    p.add_argument("--documents", default="data/demo/libreoffice-help/heldout_documents.jsonl.gz")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--evidence", type=int, default=2)
    p.add_argument("--attend-to", default="linked")
    p.add_argument("--probe-every", type=int, default=100)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    corpus = Corpus.open(args.corpus)
    tok = corpus.tokenizer()
    model = Marge(preset(args.preset, vocab_size=tok.vocab_size, **dict(parse_override(s) for s in args.set))).train()
    probe = build_probe(Path(args.documents), tok, 32, 3, 128)
    cfg = OptimConfig(lr=args.lr, warmup_steps=50, total_steps=100000)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg)
    batches = oracle_batches(corpus, args.max_tokens, args.evidence, np.random.default_rng(0))
    started, step, history, losses = time.time(), 0, [], []
    while time.time() - started < 60 * args.minutes:
        loss, _ = forward_backward(model, next(batches), tok.specials, 1.0, torch.device("cpu"), attend_to=args.attend_to)
        optimizer_step(model, opt, sched, 1.0)
        losses.append(loss)
        step += 1
        if step % args.probe_every == 0:
            h = probe_health(model, probe, tok.specials)
            history.append({"step": step, "minutes": (time.time() - started) / 60, "loss": float(np.mean(losses[-50:])),
                            **{k: h[k] for k in ("evidence_gain", "loss_true_evidence", "relevance_gap", "g_spread")}})
            log.info("%s", {k: round(v, 4) if isinstance(v, float) else v for k, v in history[-1].items()})
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "history": history}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
