"""The single-process preparation engine: the whole corpus in this process's memory, for inputs of up to a few
hundred MB (`engine: local`)."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, defaultdict
from pathlib import Path

from marge.contracts.documents import BadLine, PrepareError, RawDocument, read_inputs
from marge.util.progress import track
from services.prepare.core import (
    Chunk,
    PrepareStats,
    TokenizerSample,
    assign_shards,
    check_document,
    corpus_manifest,
    document_pieces,
    is_heldout_group,
    load_tokenizer,
    normalized_hash,
    publish_corpus,
    shard_columns,
    train_tokenizer,
    write_corpus_shard,
)
from services.prepare.options import PrepareOptions

log = logging.getLogger(__name__)


def _collect(opts: PrepareOptions, stats: PrepareStats) -> list[RawDocument]:
    docs, seen = [], set()
    for raw in track(read_inputs(opts.inputs), "reading documents", unit="doc"):
        stats.counts["documents_read"] += 1
        try:
            if isinstance(raw, BadLine):
                raise raw.error
            doc = check_document(raw, opts)
        except PrepareError as e:
            if opts.on_bad_document == "error":
                raise PrepareError(f"{e} (or pass --skip-bad-documents to drop such documents)") from None
            stats.counts["documents_skipped_bad"] += 1
            if len(stats.skipped) < 100:
                stats.skipped.append(str(e))
            log.warning("skipping: %s", e)
            continue
        if opts.languages is not None and doc.lang not in opts.languages:
            stats.counts["documents_skipped_language"] += 1
            continue
        key = (doc.lang, normalized_hash(doc.text))
        if key in seen:
            stats.counts["documents_duplicate"] += 1
            continue
        seen.add(key)
        docs.append(doc)
    if not docs:
        raise PrepareError(f"no usable documents in {', '.join(map(str, opts.inputs))}")
    return docs


def prepare_locally(opts: PrepareOptions) -> dict:
    """The single-process engine: the whole corpus in this process's memory; for inputs of up to a few hundred MB."""
    started = time.time()
    stats = PrepareStats()
    docs = _collect(opts, stats)
    sample = TokenizerSample(TokenizerSample.per_language_share(opts.tokenizer_sample_lines,
                                                                len({d.lang for d in docs})), opts.seed)
    heldout = [d for d in docs if is_heldout_group(d.group, opts.heldout_permille)]
    docs = [d for d in docs if not is_heldout_group(d.group, opts.heldout_permille)]
    if not docs:
        raise PrepareError(f"--heldout-permille {opts.heldout_permille} held out every group: nothing left to train on")
    languages = sorted({d.lang for d in docs})
    log.info("%d documents in %d languages after checks and de-duplication", len(docs), len(languages))

    if opts.tokenizer_dir is not None:
        tokenizer, sample_summary = load_tokenizer(opts, languages), None
    else:
        for d in docs:
            sample.add(d.lang, d.order, d.text)
        tokenizer, sample_summary = train_tokenizer(sample, languages, opts), sample.summary()
        del sample

    chunks: list[Chunk] = []
    seen_chunks = set()
    for doc in track(docs, "chunking", unit="doc"):
        pieces, cut = document_pieces(doc, tokenizer, opts)
        stats.counts["paragraphs_cut"] += cut
        for i, piece in enumerate(pieces):
            if len(piece.tokens) < opts.min_document_tokens:
                stats.counts["documents_too_short"] += 1
                continue
            key = (doc.lang, normalized_hash(piece.text))
            if key in seen_chunks:
                stats.counts["chunks_duplicate"] += 1
                continue
            seen_chunks.add(key)
            chunks.append(Chunk(doc.group, doc.lang, f"{doc.doc_id}#{i}", i, len(pieces), piece.tokens, piece.text,
                                 doc.source, piece.paragraph_ids))
    if not chunks:
        raise PrepareError("every chunk was a duplicate or empty; nothing to write")

    group_sizes = Counter(c.group for c in chunks)
    num_shards = opts.num_shards or max(1, math.ceil(len(chunks) / opts.docs_per_shard))
    num_shards = min(num_shards, len(group_sizes))
    shard_of = assign_shards(dict(group_sizes), num_shards, opts.seed)
    by_shard: dict[int, list[Chunk]] = defaultdict(list)
    for c in chunks:
        by_shard[shard_of[c.group]].append(c)

    def write_shards(folder: Path) -> dict:
        next_id = 0
        shard_infos = []
        for s in track(range(num_shards), "writing shards", unit="shard"):
            shard_infos.append(write_corpus_shard(folder, s, shard_columns(by_shard[s], s, next_id)))
            next_id += len(by_shard[s])
        return corpus_manifest(
            opts, tokenizer, shard_infos, len(group_sizes), Counter(c.lang for c in chunks),
            sum(len(c.tokens) for c in chunks), sum(bool(c.paragraph_ids) for c in chunks), stats, sample_summary,
            {"name": "local", "shard_assignment": "balanced"})

    manifest = publish_corpus(opts, tokenizer, heldout, write_shards)
    log.info("wrote %d chunks in %d shards to %s in %.1f s", manifest["num_documents"], num_shards, opts.out,
             time.time() - started)
    return manifest
