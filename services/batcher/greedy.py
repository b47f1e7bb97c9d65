"""Batches as subgraphs of the evidence/target graph, by the paper's greedy local search (§2.4).

The graph's edges go from a target to an evidence document; an edge weighs `crosslingual_weight` (the
paper: 100) when the two are in different languages and `monolingual_weight` (1) otherwise. A batch
is a set of targets T and evidence E whose cost (encoder tokens of E + decoder tokens of T) fits the
token budget; its value is the summed weight of the edges between T and E.

Greedy search, per shard:
  1. seed: the next unused target in a seeded random order, with its heaviest edge's evidence;
  2. repeat: add the evidence document or the (unused) target that adds the most edge weight and
     still fits; a target only ever joins when it has an edge into E, so every target has evidence;
  3. when no move adds weight, seed another component if one fits; stop when nothing fits.
Each target is used once per pass over the graph; evidence may serve many batches.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from marge.contracts.batch import decoder_cost, encoder_cost


@dataclass
class BatchPlan:
    """Which documents form one batch (doc ids), before tokens are attached."""

    targets: list[int] = field(default_factory=list)
    evidence: list[int] = field(default_factory=list)
    edges: list[tuple[int, int, float]] = field(default_factory=list)  # (target pos, evidence pos, weight)
    cost: int = 0
    negatives: list[int] = field(default_factory=list)  # unlinked documents of the shard (`add_negatives`)

    @property
    def weight(self) -> float:
        return float(sum(w for _, _, w in self.edges))


def plan_shard_batches(target_ids: np.ndarray, evidence_ids: np.ndarray, cross_lingual: np.ndarray,
                       scores: np.ndarray, lengths: dict[int, int], max_tokens: int, crosslingual_weight: float,
                       monolingual_weight: float, rng: np.random.Generator,
                       seed_lookahead: int = 16,
                       target_cost: Callable[[int], int] = decoder_cost) -> tuple[list[BatchPlan], dict[str, int]]:
    """Greedy batches over one shard's links. Returns the plans and counters (oversized seeds, ...).
    `target_cost(text tokens)`: a target's share of the budget (decoded once, by default)."""
    w = np.where(cross_lingual, crosslingual_weight, monolingual_weight).astype(np.float64)
    out_edges: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    in_edges: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for t, e, wt, sc in zip(target_ids.tolist(), evidence_ids.tolist(), w.tolist(), scores.tolist()):
        out_edges[t].append((e, wt, sc))
        in_edges[e].append((t, wt))
    for t in out_edges:  # heaviest, then most similar first: the seed's evidence is the head
        out_edges[t].sort(key=lambda x: (-x[1], -x[2], x[0]))
    t_cost = {t: target_cost(lengths[t]) for t in out_edges}
    e_cost = {e: encoder_cost(lengths[e]) for e in in_edges}
    order = [int(t) for t in rng.permutation(np.array(sorted(out_edges), dtype=np.int64))]
    position = {t: i for i, t in enumerate(order)}
    # next_free[i] leads to the first unused seed at or after position i (path-compressed), so finding
    # the next seed never walks over used targets again: the search stays linear in the edges
    next_free = list(range(len(order) + 1))
    used: set[int] = set()
    counters = {"oversized_seeds": 0}
    plans: list[BatchPlan] = []

    def first_unused(i: int) -> int:
        root = i
        while next_free[root] != root:
            root = next_free[root]
        while next_free[i] != root:
            next_free[i], i = root, next_free[i]
        return root

    def mark_used(t: int) -> None:
        used.add(t)
        i = position.get(t)
        if i is not None:
            next_free[i] = i + 1

    while True:
        plan = BatchPlan()
        in_t: set[int] = set()
        in_e: set[int] = set()
        gain_e: dict[int, float] = defaultdict(float)  # evidence outside E: weight of its edges from T
        gain_t: dict[int, float] = defaultdict(float)  # unused targets outside T: weight of edges into E

        def add_target(t: int) -> None:
            in_t.add(t)
            mark_used(t)
            gain_t.pop(t, None)
            plan.targets.append(t)
            plan.cost += t_cost[t]
            for e, wt, _ in out_edges[t]:
                if e not in in_e:
                    gain_e[e] += wt

        def add_evidence(e: int) -> None:
            in_e.add(e)
            gain_e.pop(e, None)
            plan.evidence.append(e)
            plan.cost += e_cost[e]
            for t, wt in in_edges.get(e, ()):
                if t not in in_t and t not in used:
                    gain_t[t] += wt

        def try_seed() -> bool:
            """Start a (new) component: the first unused seeds in order, the first that fits."""
            i = first_unused(0)
            for _ in range(seed_lookahead):
                if i >= len(order):
                    break
                t = order[i]
                i = first_unused(i + 1)
                e = next((e for e, _, _ in out_edges[t] if e not in in_e), None)
                need = t_cost[t] + (e_cost[e] if e is not None else 0)
                if need > max_tokens:
                    mark_used(t)  # can never fit any batch
                    counters["oversized_seeds"] += 1
                    continue
                if plan.cost + need <= max_tokens:
                    add_target(t)
                    if e is not None:
                        add_evidence(e)
                    return True
                if not plan.targets:
                    break
            return False

        if not try_seed():
            break
        while True:
            room = max_tokens - plan.cost
            best, best_gain, best_cost, is_target = None, 0.0, 0, False
            for e, g in gain_e.items():
                c = e_cost[e]
                if c <= room and (g > best_gain or (g == best_gain and best is not None and c < best_cost)):
                    best, best_gain, best_cost, is_target = e, g, c, False
            for t, g in gain_t.items():
                if t in used:
                    continue
                c = t_cost[t]
                if c <= room and (g > best_gain or (g == best_gain and best is not None and c < best_cost)):
                    best, best_gain, best_cost, is_target = t, g, c, True
            if best is not None and best_gain > 0:
                (add_target if is_target else add_evidence)(best)
            elif not try_seed():
                break
        e_pos = {e: j for j, e in enumerate(plan.evidence)}
        for i, t in enumerate(plan.targets):
            for e, wt, _ in out_edges[t]:
                if e in e_pos:
                    plan.edges.append((i, e_pos[e], wt))
        plans.append(plan)
    return plans, counters


def plan_document_batches(doc_ids: np.ndarray, lengths: dict[int, int], max_tokens: int, rng: np.random.Generator,
                          document_cost: Callable[[int], int]) -> tuple[list[BatchPlan], dict[str, int]]:
    """Batches of documents without an index (BART, VECO's halves): the shard's documents in a seeded order,
    each batch filled in that order while the next document fits. Every document is a target and its own
    source (a self-edge of weight 1); one that fits no batch is skipped and counted."""
    plans: list[BatchPlan] = []
    counters = {"oversized_seeds": 0}
    plan = BatchPlan()
    for d in rng.permutation(np.asarray(doc_ids, dtype=np.int64)).tolist():
        cost = document_cost(lengths[d])
        if cost > max_tokens:
            counters["oversized_seeds"] += 1
            continue
        if plan.cost + cost > max_tokens:
            plans.append(plan)
            plan = BatchPlan()
        plan.edges.append((len(plan.targets), len(plan.evidence), 1.0))
        plan.targets.append(d)
        plan.evidence.append(d)
        plan.cost += cost
    if plan.targets:
        plans.append(plan)
    return plans, counters


def add_negatives(plans: list[BatchPlan], doc_ids: np.ndarray, count: int, rng: np.random.Generator) -> None:
    """Gives each plan `count` distinct documents of its shard that it does not already hold (fewer when the shard
    has fewer): unlinked documents that travel in the batch as a contrastive loss's negatives (the denoising loss's
    `extra_documents`), so that no trainer reads the corpus for them. Drawn in plan order from `rng`: the same
    plans and generator always give the same negatives (batches are deterministic)."""
    if count <= 0:
        return
    pool = np.asarray(doc_ids, dtype=np.int64)
    for plan in plans:
        held = set(plan.targets) | set(plan.evidence)
        # count + |held| distinct draws leave at least `count` the plan does not hold: work in the draws, not the shard
        drawn = pool[rng.choice(len(pool), size=min(len(pool), count + len(held)), replace=False)].tolist()
        plan.negatives = [d for d in drawn if d not in held][:count]
