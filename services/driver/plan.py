"""`marge plan`: does the indexer pool keep up with the trainers? A capacity model of one run's refresh loop.

The loop (paper §2.4): every `indexer.reindex_every` (R) updates the trainers publish g, the indexer pool embeds
the whole corpus with it and links it, and `batcher.index_lag` (L) updates after the snapshot the batches switch
to the new graph (a fixed step: `marge.contracts.slots.VersionPlan`). What a run needs to know before it starts is
whether a refresh is built within those L updates (else the trainers wait for it), and what the queue costs
in Redis; the staleness of the batches is fixed by the schedule.

Costs come from throughput measured on real hardware (`marge plan --measure`: one indexer worker embedding
corpus documents, one trainer worker training on corpus batches, the config's model, this machine), kept as
achieved FLOP/s so that they carry over to another model size by FLOP counts (the assumption the plan rests
on: at a given device and batch shape, time scales with FLOPs):

    embedding a document     2 x (4 d^2 + 2 d ffn) x relevance_layers x (tokens + 2)         forward only
    linking a shard          2 x n_shard x n_language x d per language                          exact top-k
    one update               target tokens x `training_flops_per_token`                          fwd + bwd

and from them

    tokens per update        trainer workers x grad_accum x the batch's target tokens (a batch holds evidence
                             and targets: batcher.max_tokens / (1 + evidence per target token)); on GPUs an
                             update below GPU_TARGET_TOKENS_PER_WORKER target tokens per worker is launch- and
                             optimizer-bound, and the plan says how many micro-batches to accumulate instead
    seconds per update       update FLOPs / (trainer workers x trainer FLOP/s)
    refresh interval         R x seconds per update
    build time               corpus embedding + linking FLOPs / (indexer workers x indexer FLOP/s)
    trainer wait             per refresh: build time - L x seconds per update, when positive
    staleness (updates)      a batch's trainer step minus the snapshot its index came from: L to L + R - 1
    Redis memory (peak)      the streams: the slots of the update being trained and the look-ahead
                             (`queue.max_depth`), (look-ahead + 1) x B messages of 4 bytes a token + header; the
                             ledger, one commit record a rank and checkpoint; the last STEP_RECORDS_KEPT step records
                             (`redis_footprint`; per-entry costs measured with MEMORY USAGE by
                             benchmarks/redis_soak.py and benchmarks/checkpoint_records_scale.py)
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from marge.model.architecture import MargeConfig
from marge.model.sizes import training_flops_per_token
from marge.model.veco import VecoConfig
from services.driver.config import PipelineConfig
from services.driver.scale_costs import LEDGER_BYTES_PER_RECORD, describe_costs, over_budget, scale_costs

log = logging.getLogger("marge.plan")

HEADER_BYTES_PER_DOCUMENT = 48  # doc id, language, offsets in the message header (JSON), measured on demo batches
GPU_TARGET_TOKENS_PER_WORKER = 8192
"""Target tokens one GPU should train per update: below it, the fixed cost of an update (the optimizer over every
parameter, clipping, kernel launches) outweighs the work (docs/gpu.md, "Sized for a GPU")."""


UPDATE_TIME_FLOOR = (
    "a floor, not a forecast: the update's FLOPs at the rate of a 512 x 512 matrix product on this machine, which a "
    "training step reaches only in part (small matrices, attention, normalisation, the optimizer), with nothing for "
    "waiting for batches, the all-reduce or a CPU shared with the indexer; `marge plan --measure --out FILE`, then "
    "`--measured FILE`, times real training steps")
"""What `seconds_per_update` is when the throughput is estimated (docs/benchmarks.md, "Capacity": how far below
a measured update it lies)."""
UPDATE_TIME_MEASURED = (
    "one trainer worker's measured training step on its own: waiting for batches, the all-reduce and a CPU shared "
    "with the indexer come on top (the progress lines' wait share shows the waiting)")
"""What `seconds_per_update` is when the throughput was measured (`marge plan --measure`)."""


STREAM_ENTRY_OVERHEAD_BYTES = 160
"""A stream entry's cost beyond its message: field names, entry id, listpack and radix-tree nodes."""
STEP_RECORD_BYTES = 900
"""One trainer step record (JSON) in the capped list."""

BUILDER_BATCHES_PER_S = 1070.0
"""Batches one batch builder plans a second: 149,489 batches of <= 2,048 tokens in 139.7 s on one core of a 2-core
CPU (benchmarks/results/batcher-scale-cpu-2core.json, 10M links)."""
BUILDER_HEADROOM = 2.0
"""Batch builders are sized for this multiple of what the trainers need: `batch_builders_needed` is the count that
supplies twice the trainers' batches a second (a margin chosen, not measured)."""
OFFER_REDIS_CPU_US = 28.3
"""Redis CPU per batch offered, flat in the world size: 23.8-28.3 us from 8 to 2,048 ranks, the largest taken
(benchmarks/results/offer-scale-cpu-2core.json; the layout before it cost 24 us at 8 ranks and 665 us at 2,048)."""
CHECKPOINT_BYTES_PER_PARAMETER = 12
"""A checkpoint's fp32 weights (4 bytes a parameter) and AdamW's two moments (8), written sharded (format 2,
`marge.model.checkpoint`): a resuming rank reads its 1/world share of the parts and gets the rest from the other ranks
over the process group, and does not read the init weights; the driver, choosing the checkpoint to resume from,
hashes every part once (benchmarks/results/checkpoint-scale-cpu-2core.json: 961 MB for 80M parameters)."""


def message_bytes(max_tokens: int, mean_document_tokens: float, negatives: int = 0) -> float:
    """A queue message for a full batch: 4 bytes a token plus the JSON header's share per document, and the
    `negatives` unlinked documents it carries besides its budget (`BatchShape.negatives`)."""
    linked = 4 * max_tokens + HEADER_BYTES_PER_DOCUMENT * max_tokens / max(mean_document_tokens, 1)
    return linked + negatives * (4 * mean_document_tokens + HEADER_BYTES_PER_DOCUMENT)


def redis_footprint(cfg: PipelineConfig, mean_document_tokens: float, message: float | None = None,
                    steps: int | None = None) -> dict:
    """The run's peak Redis memory, part by part (bytes): it grows with the run only by one commit record a rank and
    checkpoint.

    Each rank's stream holds the update it trains and the builders' look-ahead (a rank's progress drops what it
    has trained); the ledger holds one `CommitRecord` a rank and checkpoint (`marge.contracts.protocol`)."""
    from marge.contracts.protocol import STEP_RECORDS_KEPT

    t = cfg.trainer
    per_step = t.num_workers * t.grad_accum
    lookahead_steps = math.ceil(cfg.queue.max_depth / per_step)
    message = message if message is not None else message_bytes(cfg.batcher.max_tokens, mean_document_tokens,
                                                                 cfg.batch_shape().negatives)
    steps = cfg.run.max_steps if steps is None else steps
    checkpoints = max(1, steps // t.checkpoint_every)
    parts = {
        "streams": (lookahead_steps + 1) * per_step * (message + STREAM_ENTRY_OVERHEAD_BYTES),
        "ledger": checkpoints * t.num_workers * LEDGER_BYTES_PER_RECORD,
        "step_records": min(STEP_RECORDS_KEPT, steps) * STEP_RECORD_BYTES,
    }
    return {"parts": parts, "peak_bytes": sum(parts.values()), "message_bytes": message,
            "batches_per_update": per_step, "lookahead_updates": lookahead_steps, "steps": steps}


@dataclass(frozen=True)
class Throughput:
    """Achieved FLOP/s of one indexer worker (embedding) and one trainer worker (training), and their origin."""

    embed_flops_per_s: float
    train_flops_per_s: float
    source: str
    measured: bool = False
    """Measured on the workers' hardware (`marge plan --measure`), not estimated from a matrix product here."""


def encoder_layer_macs(cfg: MargeConfig) -> float:
    """Multiply-adds per token of one encoder layer (projections and FFN; attention scores left out)."""
    return 4 * cfg.d_model ** 2 + 2 * cfg.d_model * cfg.encoder_ffn


def embed_flops_per_document(cfg: MargeConfig, tokens: float) -> float:
    return 2.0 * encoder_layer_macs(cfg) * cfg.relevance_layers * (tokens + 2)


def link_flops(documents: float, docs_per_shard: float, languages: int, d_model: int) -> float:
    """Exact top-k within each shard: every document against every document of each language of its shard."""
    return 2.0 * documents * docs_per_shard * d_model  # summed over languages: n_shard x sum(n_lang) = n_shard^2


def plan_capacity(cfg: PipelineConfig, model_cfg: MargeConfig, documents: int, mean_document_tokens: float,
                  languages: int, rates: Throughput, evidence_per_target_tokens: float = 1.0) -> dict:
    """The refresh loop's figures for `cfg` at this corpus size and these throughputs."""
    from marge.model.sizes import build_on_meta, count_parameters
    from services.indexer.core import shard_coverage

    t = cfg.trainer
    batches_per_update = t.num_workers * t.grad_accum
    target_tokens_per_batch = cfg.batcher.max_tokens / (1 + evidence_per_target_tokens)
    update_flops_per_worker = (t.grad_accum * target_tokens_per_batch
                               * training_flops_per_token(model_cfg, evidence_per_target_tokens))
    seconds_per_update = update_flops_per_worker / rates.train_flops_per_s
    refresh_interval_s = cfg.indexer.reindex_every * seconds_per_update
    version_plan = cfg.version_plan()
    head_start_s = version_plan.lag * seconds_per_update
    docs_per_shard = min(documents, cfg.data.docs_per_shard)
    num_shards = max(1, math.ceil(documents / cfg.data.docs_per_shard))
    sampled = cfg.indexer.shards_per_version or cfg.indexer.shards_per_refresh
    shards_per_build = min(num_shards, sampled) if sampled else num_shards
    documents_per_build = documents * shards_per_build / num_shards  # a sampled (or rotating) refresh embeds k shards
    build_flops = (documents_per_build * embed_flops_per_document(model_cfg, mean_document_tokens)
                   + link_flops(documents_per_build, docs_per_shard, languages, model_cfg.d_model))
    one_worker_build_s = build_flops / rates.embed_flops_per_s
    build_s = one_worker_build_s / cfg.indexer.num_workers
    wait_s = max(0.0, build_s - head_start_s)
    queue_updates = cfg.queue.max_depth / batches_per_update
    per_worker = t.grad_accum * target_tokens_per_batch
    accumulate = max(t.grad_accum, math.ceil(GPU_TARGET_TOKENS_PER_WORKER / max(target_tokens_per_batch, 1)))
    versions = 1 + cfg.run.max_steps // cfg.indexer.reindex_every
    parameters = count_parameters(build_on_meta(model_cfg))
    checkpoint_bytes = parameters * CHECKPOINT_BYTES_PER_PARAMETER
    restart_read = checkpoint_bytes / t.num_workers
    needed = batches_per_update / seconds_per_update
    builders = min(BUILDER_BATCHES_PER_S * cfg.batcher.builders, 1e6 / OFFER_REDIS_CPU_US)
    redis = redis_footprint(cfg, mean_document_tokens)
    at_scale = scale_costs(cfg, parameters, checkpoint_bytes, redis["peak_bytes"], documents, model_cfg.d_model)
    return {
        "documents": documents, "mean_document_tokens": round(mean_document_tokens, 1),
        "throughput": asdict(rates),
        "seconds_per_update": seconds_per_update,
        "seconds_per_update_is": UPDATE_TIME_MEASURED if rates.measured else UPDATE_TIME_FLOOR,
        "refresh_interval_s": refresh_interval_s,
        "index_lag_updates": version_plan.lag,
        "build_s": build_s,
        "build_s_one_worker": one_worker_build_s,
        "keeps_up": wait_s == 0.0,
        "trainer_wait_per_refresh_s": wait_s,
        "trainer_wait_share": wait_s / (refresh_interval_s + wait_s),
        "indexer_workers_needed": max(1, math.ceil(one_worker_build_s / max(head_start_s, 1e-9))),
        "share_of_corpus_refreshable": min(1.0, head_start_s / build_s) if build_s else 1.0,
        "staleness_updates": {"min": version_plan.lag, "mean": version_plan.lag + (cfg.indexer.reindex_every - 1) / 2,
                              "max": version_plan.lag + cfg.indexer.reindex_every - 1},
        "target_tokens_per_batch": target_tokens_per_batch,
        "target_tokens_per_worker_update": per_worker,
        "target_tokens_per_update": t.num_workers * per_worker,
        "gpu_sized": (per_worker >= GPU_TARGET_TOKENS_PER_WORKER) if t.use_gpu else None,
        "grad_accum_for_gpu": accumulate,
        "queue_depth_updates": queue_updates,
        "redis_queue_bytes": cfg.queue.max_depth * message_bytes(cfg.batcher.max_tokens, mean_document_tokens,
                                                                 cfg.batch_shape().negatives),
        "redis": redis,
        "redis_peak_bytes": redis["peak_bytes"],
        "shards": num_shards, "shards_per_build": shards_per_build, "documents_per_build": documents_per_build,
        "index_versions": versions,
        "shard_sampling": cfg.indexer.shard_sampling if cfg.indexer.shards_per_version else None,
        "shard_coverage_first_phase": (shard_coverage(num_shards, cfg.indexer.shards_per_version, versions,
                                                      cfg.indexer.shard_sampling)
                                       if cfg.indexer.shards_per_version else 1.0),
        "shard_coverage_first_phase_cycle": (shard_coverage(num_shards, cfg.indexer.shards_per_version, versions,
                                                            "cycle") if cfg.indexer.shards_per_version else 1.0),
        "batches_per_s_needed": needed,
        "batches_per_s_builders": builders,
        "batch_builders": cfg.batcher.builders,
        "batch_builders_needed": max(1, math.ceil(BUILDER_HEADROOM * needed / BUILDER_BATCHES_PER_S)),
        "builders_keep_up": builders >= needed,
        "builders_headroom": builders / needed if needed else math.inf,
        "redis_cpu_share_offers": needed * OFFER_REDIS_CPU_US / 1e6,
        "parameters": parameters,
        "checkpoint_bytes": checkpoint_bytes,
        "restart_read_bytes_per_rank": restart_read,
        "restart_read_bytes_all_ranks": 2 * checkpoint_bytes,  # the ranks' shares, and the driver's verification
        "at_scale": at_scale,
        "over_budget_at_scale": over_budget(at_scale),
        **{name: cost["value"] for name, cost in at_scale.items()},
    }


def describe(plan: dict, cfg: PipelineConfig) -> list[str]:
    s, redis = plan["staleness_updates"], plan["redis"]
    lines = [
        f"{plan['documents']:,} documents of {plan['mean_document_tokens']:.0f} tokens; {plan['throughput']['source']}",
        f"one update: {'' if plan['throughput']['measured'] else 'at least '}{plan['seconds_per_update']:.3g} s "
        f"({plan['seconds_per_update_is']}) -> refresh interval {cfg.indexer.reindex_every} updates = "
        f"{'' if plan['throughput']['measured'] else 'at least '}{plan['refresh_interval_s']:.3g} s",
        f"one refresh with {cfg.indexer.num_workers} indexer worker(s): {plan['build_s']:.3g} s, due "
        f"{plan['index_lag_updates']} updates after its snapshot "
        f"({'keeps up' if plan['keeps_up'] else 'does NOT keep up: the trainers wait %.3g s per refresh, %.0f%% of their time' % (plan['trainer_wait_per_refresh_s'], 100 * plan['trainer_wait_share'])}; "
        f"{plan['indexer_workers_needed']} worker(s) needed, or refresh {100 * plan['share_of_corpus_refreshable']:.0f}% "
        "of the corpus)",
        f"an update: {plan['target_tokens_per_update']:,.0f} target tokens, {plan['target_tokens_per_worker_update']:,.0f} "
        f"per trainer worker in {cfg.trainer.grad_accum} batch(es) of {plan['target_tokens_per_batch']:,.0f}"
        + ("" if plan["gpu_sized"] is None else " (sized for a GPU)" if plan["gpu_sized"] else
           f" -- too few for a GPU (at least {GPU_TARGET_TOKENS_PER_WORKER:,} a worker): set trainer.grad_accum="
           f"{plan['grad_accum_for_gpu']}, or fewer trainer workers with more accumulation for the same update"),
        f"batch staleness: {s['min']:.0f} to {s['max']:.0f} updates (mean {s['mean']:.0f}); the batcher writes "
        f"{plan['queue_depth_updates']:.1f} updates ahead",
        f"Redis memory at its peak: {redis['peak_bytes'] / 2**20:,.1f} MiB = "
        + ", ".join(f"{name.replace('_', ' ')} {size / 2**20:,.1f}" for name, size in redis["parts"].items())
        + f" MiB (streams: {redis['lookahead_updates'] + 1} updates of {redis['batches_per_update']} batches; "
        f"ledger: a record a rank every trainer.checkpoint_every={cfg.trainer.checkpoint_every} updates; size Redis's "
        "maxmemory above it)",
        f"batches: the trainers need {plan['batches_per_s_needed']:,.0f}/s; {plan['batch_builders']} batch "
        f"builder(s) plan {plan['batches_per_s_builders']:,.0f}/s ({BUILDER_BATCHES_PER_S:,.0f}/s each) and each "
        f"offer costs Redis {OFFER_REDIS_CPU_US:.0f} us of CPU ({100 * plan['redis_cpu_share_offers']:.1f}% of a "
        "core at that rate): "
        + ("keeps up" if plan["builders_keep_up"] else "does NOT keep up: the trainers wait for batches")
        + (f"; batcher.builders={plan['batch_builders_needed']} gives {BUILDER_HEADROOM:g}x the need"
           if plan["builders_headroom"] < BUILDER_HEADROOM else ""),
        f"a restart: each rank reads its 1/{cfg.trainer.num_workers} share of the sharded checkpoint "
        f"({plan['parameters'] / 1e6:,.0f}M parameters, {plan['checkpoint_bytes'] / 1e9:,.1f} GB) and gets the rest "
        f"from the others: {plan['restart_read_bytes_per_rank'] / 1e9:,.2f} GB a rank; "
        f"{plan['restart_read_bytes_all_ranks'] / 1e9:,.1f} GB in all with the driver's verification",
        describe_costs(plan["at_scale"], cfg.trainer.num_workers),
    ]
    if plan["shard_sampling"] is not None:
        lines.insert(3, f"a refresh embeds {plan['shards_per_build']:,} of {plan['shards']:,} shards "
                        f"({plan['documents_per_build']:,.0f} documents); over the run's {plan['index_versions']} "
                        f"versions {100 * plan['shard_coverage_first_phase']:.0f}% of the shards are held at least "
                        f"once ({plan['shard_sampling']} draws"
                        + ("" if plan["shard_sampling"] == "cycle" else
                           f"; indexer.shard_sampling=cycle: {100 * plan['shard_coverage_first_phase_cycle']:.0f}%")
                        + ")")
    return lines


def indexed_architecture(cfg: PipelineConfig, model_cfg: MargeConfig | VecoConfig) -> MargeConfig:
    """The architecture the plan sizes: MARGE's (its g is what the indexer embeds); VECO builds no index."""
    if not isinstance(model_cfg, MargeConfig):
        raise ValueError(f"the capacity plan sizes an index, and objectives.model_family "
                         f"{cfg.objectives.model_family!r} builds none: plan a MARGE config")
    return model_cfg


def warn_if_behind(cfg: PipelineConfig, model_cfg: MargeConfig | VecoConfig, corpus,
                   rates: Throughput | None) -> dict | None:
    """The driver's start-up check: a warning naming the settings to change when the pool cannot keep up."""
    if rates is None:
        log.info("no capacity estimate: the workers use GPUs this machine lacks (`marge plan --measured FILE` "
                 "with throughput measured on a worker node)")
        return None
    m = corpus.manifest
    plan = plan_capacity(cfg, indexed_architecture(cfg, model_cfg), m["num_documents"],
                         m["num_tokens"] / max(1, m["num_documents"]),
                         len(m["languages"]), rates)
    if not plan["keeps_up"]:
        # A warning only from measured throughputs: the start-up estimate (one matrix product's FLOP/s for both
        # stages) has been several times off for the small models the demo trains, and a false warning on every
        # demo run teaches users to ignore warnings.
        say = log.warning if rates.measured else log.info
        say("%sthe indexer pool may not keep up: one refresh takes about %.0f s but is due %d updates (about "
            "%.0f s) after its snapshot (%s); raise indexer.num_workers to %d, or batcher.index_lag, or expect "
            "the trainers to wait about %.0f s per refresh%s", "" if rates.measured else "rough estimate: ",
            plan["build_s"], plan["index_lag_updates"], plan["index_lag_updates"] * plan["seconds_per_update"],
            plan["throughput"]["source"], plan["indexer_workers_needed"], plan["trainer_wait_per_refresh_s"],
            "" if rates.measured else " (the progress lines show the real wait share; `marge plan --measure` "
            "measures the throughputs)")
    return plan


# ----------------------------------------------------------------------------------------------------
# Measuring the throughputs on this machine
# ----------------------------------------------------------------------------------------------------


def matmul_flops_per_s(device: torch.device, threads: int, size: int = 512, seconds: float = 0.3) -> float:
    """Achieved fp32 matrix-product FLOP/s with `threads` threads: the quick estimate the driver starts with."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a = torch.randn(size, size, device=device)
        b = torch.randn(size, size, device=device)
        a @ b
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return 2.0 * size ** 3 * n / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)


def corpus_batches(corpus, max_tokens: int, count: int, seed: int = 0, negatives: int = 0) -> list:
    """Batches of corpus documents filling `max_tokens`: each target linked to one evidence document, and
    `negatives` unlinked documents of the shard besides (`BatchShape.negatives`)."""
    from marge.contracts.batch import Batch
    from services.batcher.greedy import BatchPlan, add_negatives

    rng = np.random.default_rng(seed)
    shard = corpus.read_shard(0)
    out = []
    for b in range(count):
        targets, evidence, cost = list[int](), list[int](), 0
        for i in rng.permutation(len(shard)):
            if len(shard.tokens[i]) < 2:
                continue
            if cost + len(shard.tokens[i]) + 2 > max_tokens:
                break
            (targets if len(targets) <= len(evidence) else evidence).append(int(i))
            cost += len(shard.tokens[i]) + 2
        pairs = min(len(targets), len(evidence))
        plan = BatchPlan(targets=targets[:pairs], evidence=evidence[:pairs])
        add_negatives([plan], np.arange(len(shard)), negatives, rng)  # as the batcher adds them (none: no draw)
        docs = plan.targets + plan.evidence + plan.negatives
        edges = np.stack([np.arange(pairs), np.arange(pairs)], axis=1).astype(np.int32)
        out.append(Batch(f"plan-{b}", 0, 0, shard.doc_ids[docs].astype(np.int64), tuple(shard.langs[i] for i in docs),
                         tuple(shard.tokens[i] for i in docs), np.arange(pairs, dtype=np.int32),
                         np.arange(pairs, 2 * pairs, dtype=np.int32), edges, np.ones(pairs, dtype=np.float32)))
    return out


def measure_throughput(cfg: PipelineConfig, corpus, device: torch.device, steps: int = 6) -> dict:
    """One indexer worker's and one trainer worker's achieved FLOP/s on this machine, with the config's model,
    thread counts and batch budget, on corpus documents (random-init weights: speed does not depend on them). The
    trainer's update is the config's: its objectives and its execution settings (`trainer.unpadded`, the attention
    buckets, `key_bias`, `loss_chunk_tokens`, bf16, grad_accum); only the learning rate's schedule is flat."""
    from dataclasses import replace

    from marge.model.network import Marge, RelevanceEncoder
    from services.indexer.core import embed_documents
    from services.trainer.inputs import AttentionLayout
    from services.trainer.objectives import objectives_for
    from services.trainer.precision import bf16_parameters
    from services.trainer.step import (
        Trainee,
        apply_execution_settings,
        build_optimizer,
        build_scheduler,
        train_step,
    )

    tokenizer = corpus.tokenizer()
    model_cfg = indexed_architecture(cfg, cfg.model_config(vocab_size=tokenizer.vocab_size))
    torch.manual_seed(cfg.run.seed)
    model = Marge(model_cfg).to(device)
    encoder = RelevanceEncoder.from_model(model).eval()
    documents = corpus.read_shard(0).tokens
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, int(cfg.indexer.num_cpus_per_worker)))
        embed_documents(encoder, documents[:64], tokenizer.specials, cfg.indexer.batch_tokens, str(device))  # warm-up
        t0 = time.perf_counter()
        embed_documents(encoder, documents, tokenizer.specials, cfg.indexer.batch_tokens, str(device))
        embed_s = time.perf_counter() - t0
        mean_tokens = float(np.mean([len(d) for d in documents]))
        embed_rate = len(documents) * embed_flops_per_document(model_cfg, mean_tokens) / embed_s

        torch.set_num_threads(max(1, cfg.trainer.torch_threads))
        accumulate = cfg.trainer.grad_accum  # an update as the config makes it: one optimizer step per grad_accum batches
        batches = corpus_batches(corpus, cfg.batcher.max_tokens, (steps + 1) * accumulate, cfg.run.seed,
                                 cfg.batch_shape().negatives)
        updates = [batches[i:i + accumulate] for i in range(0, len(batches), accumulate)]
        trainer = replace(cfg.trainer, warmup_steps=0, total_steps=None)
        apply_execution_settings(model.train(), trainer)
        optimizer = build_optimizer(model, trainer)
        if trainer.bf16_params:  # as the hosts train it
            bf16_parameters(model, optimizer)
        scheduler = build_scheduler(optimizer, trainer, 10**6)
        objectives = objectives_for(cfg.objectives, tokenizer, trainer.unpadded, AttentionLayout.of(trainer))
        trainee = Trainee.in_process(model, optimizer, scheduler, objectives, trainer, device)
        train_step(trainee, updates[0], 0)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        flops, t0 = 0.0, time.perf_counter()
        for i, update in enumerate(updates[1:], start=1):
            train_step(trainee, update, i)
            for batch in update:
                targets = batch.target_tokens()
                ratio = (batch.cost_tokens() - targets) / max(1, targets)
                flops += targets * training_flops_per_token(model_cfg, ratio)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_rate = flops / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)
    return {"embed_flops_per_s": embed_rate, "train_flops_per_s": train_rate, "embed_docs_per_s": len(documents) / embed_s,
            "device": str(device) if device.type != "cuda" else f"cuda: {torch.cuda.get_device_name(device)}",
            "grad_accum": accumulate, "unpadded": trainer.unpadded,
            "attention_buckets": [trainer.bucket_rows, trainer.bucket_width], "indexer_threads": int(cfg.indexer.num_cpus_per_worker),
            "trainer_threads": cfg.trainer.torch_threads, "model": model_cfg.to_dict()}


def load_throughput(path: Path) -> Throughput:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    missing = {"embed_flops_per_s", "train_flops_per_s"} - set(data)
    if missing:
        raise ValueError(f"{path}: a measured-throughput file needs {sorted(missing)} (write one with "
                         "`marge plan --measure --out FILE`)")
    return Throughput(float(data["embed_flops_per_s"]), float(data["train_flops_per_s"]),
                      f"measured on {data.get('device', '?')} ({path})", measured=True)


def estimated_throughput(cfg: PipelineConfig) -> Throughput | None:
    """Without measurements: this machine's matrix-product rate on the workers' threads (CPU) or device. None
    when the workers use GPUs this machine does not have (a CPU head node): its rate would say nothing."""
    wants_gpu = cfg.trainer.use_gpu or cfg.indexer.use_gpu
    if wants_gpu and not torch.cuda.is_available():
        return None
    device = torch.device("cuda" if wants_gpu else "cpu")
    embed = matmul_flops_per_s(device, int(cfg.indexer.num_cpus_per_worker))
    train = matmul_flops_per_s(device, cfg.trainer.torch_threads)
    return Throughput(embed, train, f"estimated from a {device.type} matrix product on this machine")


# ----------------------------------------------------------------------------------------------------
# What `marge plan` runs: the corpus's size from its manifest (or the size given), then the plan
# ----------------------------------------------------------------------------------------------------


def prepared_corpus(cfg: PipelineConfig):
    """The run's corpus when it is prepared on this machine (only its manifest and tokenizer are read, so the
    shards' checksums are not verified), else None."""
    if not (Path(cfg.data.corpus) / "manifest.json").exists():
        return None
    from marge.contracts.corpus import Corpus

    return Corpus.open(cfg.data.corpus, verify_checksums=False)


def corpus_size(cfg: PipelineConfig, corpus, documents: int | None, document_tokens: float,
                languages: int) -> tuple[int, float, int]:
    """(documents, mean tokens per document, languages) to plan for: the size given, else the prepared corpus's."""
    if documents:
        return documents, document_tokens, languages
    if corpus is not None:
        m = corpus.manifest
        return m["num_documents"], m["num_tokens"] / m["num_documents"], len(m["languages"])
    raise FileNotFoundError(f"{cfg.data.corpus} is not prepared here: give its size with --documents N "
                            "(and --document-tokens, --languages)")


def plan_run(cfg: PipelineConfig, documents: int | None = None, document_tokens: float = 400.0, languages: int = 26,
             measured: Path | None = None) -> dict:
    """`plan_capacity` for `cfg` on its prepared corpus (or one of the size given), with the throughput measured
    into `measured` by `marge plan --measure`, else estimated on this machine."""
    corpus = prepared_corpus(cfg)
    documents, tokens, languages = corpus_size(cfg, corpus, documents, document_tokens, languages)
    rates = load_throughput(measured) if measured else estimated_throughput(cfg)
    if rates is None:
        raise ValueError("this config's workers use GPUs and this machine has none: measure on a worker "
                         "(`marge plan --measure --device cuda --out FILE`) and pass --measured FILE")
    vocab = corpus.tokenizer().vocab_size if corpus is not None else cfg.data.vocab_size
    return plan_capacity(cfg, indexed_architecture(cfg, cfg.model_config(vocab_size=vocab)), documents, tokens,
                         languages, rates)


def measure_prepared(cfg: PipelineConfig, device: str) -> dict:
    """`measure_throughput` on the run's prepared corpus, which must be on this machine."""
    corpus = prepared_corpus(cfg)
    if corpus is None:
        raise FileNotFoundError(f"--measure needs the prepared corpus {cfg.data.corpus} (run `marge prepare` first)")
    return measure_throughput(cfg, corpus, torch.device(device))
