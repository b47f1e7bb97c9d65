"""`marge prepare --engine ray`: the same corpus as the single-process engine, streamed through Ray Data.

The corpus never sits in one process. Each stage is a Ray Data pipeline, run by `workers` tasks at a time. Where a
stage must bring rows together (the duplicates of a document or of a chunk, the chunks of a shard), Ray Data's hash
shuffle (`Dataset.repartition(keys=...)`, on disk: a file per map task on its node's local disk, removed after the
shuffle) does it, and one task per partition writes that partition as one file into a work folder beside `--out` (so
on a cluster, like the corpus, it must be on a filesystem every node sees): the work folder holds a file per
partition, never one per block (`engine.intermediate_files` in the manifest counts them).

  read -> check                         the input's lines (or files) are read as raw bytes (a plain .jsonl larger
                                        than READ_SPLIT_BYTES by several tasks, one per byte range), then parsed and
                                        checked (UTF-8, fields, fastText language ID, the --languages filter); each
                                        block's rejected lines become one report (`Rejected`: counts and the first
                                        errors in input order);
  -> shuffle by (language, text hash)   one task per partition keeps, of each duplicate, the first in input order
     -> de-duplicate documents          (what the single-process engine keeps) and writes the training and the
                                        held-out documents apart (clean/, heldout/: a file each);
  sample the tokenizer's lines          one task per partition stages its sample (`TokenizerSample`), tasks merge
                                        them SAMPLE_FAN_IN at a time into one: the sample the single-process engine
                                        draws, at most --tokenizer-sample-lines lines (and one per language);
  train the tokenizer                   in the driver, on that sample alone;
  tokenize and chunk -> shuffle by      documents become chunks, tokens as int32 arrays; one task per partition
     (language, chunk text hash)        keeps the first of each duplicate chunk in (input order, chunk index) and
     -> de-duplicate chunks             writes the partition (chunks-clean/: a file each);
  count the shards                      a group's shard is a hash of (seed, group) (every chunk of a page in one
                                        shard, as in the single-process engine, whose greedy balance needs every
                                        group's size in one place: shards here are equal in expectation instead);
                                        one task per partition counts its chunks per shard, to number the shards;
  held-out documents -> shuffle by      one task per partition of held-out groups stages the groups' translation
     group -> stage pairs               pairs (heldout-pairs/: a file each), the first --max-pairs-per-direction of
                                        each direction among its groups;
  -> shuffle by shard -> write shards   one task per group of shards sorts, numbers and writes them;
  write heldout/                        one task merges the staged held-out documents (input order) and pairs
                                        (direction, group order) into the corpus folder, a few rows of each file at
                                        a time.

What comes back to the driver is small and bounded: per partition its file names and counts and its first rejected
lines, and the one merged tokenizer sample (at most --tokenizer-sample-lines lines, whatever the corpus's size); the
held-out documents never come to it. What a task holds is one partition (`partition_bytes`), one block of lines, a
shuffle's map batch (SHUFFLE_MAP_BYTES), a tokenizer sample or two, or HELDOUT_READ_ROWS rows of each staged
held-out file: the peak memory does not grow with the corpus (measured in `benchmarks/prepare_scale.py`). The documents and their tokens are the single-process engine's
(tests/integration/test_prepare_ray.py); the shards they are in, and so the doc ids, differ.

Reading and checking the input, with the Ray setup and the schemas every step shares, is
`services.prepare.ray_reading`.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import heapq
import json
import logging
import math
import os
import pickle
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from marge.contracts.documents import PrepareError, RawDocument, check_input
from marge.contracts.tokenizer import MargeTokenizer
from services.prepare.core import (
    Chunk,
    PrepareStats,
    TokenizerSample,
    corpus_manifest,
    document_pieces,
    heldout_manifest,
    heldout_pairs_by_direction,
    heldout_row,
    input_bytes,
    is_heldout_group,
    load_tokenizer,
    normalized_hash,
    pair_line,
    publish_corpus,
    shard_columns,
    train_tokenizer,
    write_corpus_shard,
)
from services.prepare.options import PrepareOptions
from services.prepare.ray_reading import (
    CHUNK_PARTITION_SCHEMA,
    CHUNK_SCHEMA,
    DEDUPLICATION_KEYS,
    DOCUMENT_COLUMNS,
    DOCUMENT_PARTITION_SCHEMA,
    GZIP_EXPANSION,
    HELDOUT_PARTITION_SCHEMA,
    HELDOUT_READ_ROWS,
    LINES_PER_BLOCK,
    NOT_A_DOCUMENT,
    PAIR_SCHEMA,
    READ_SPLIT_BYTES,
    SAMPLE_FAN_IN,
    SHARD_COLUMNS,
    SHARD_WRITTEN_SCHEMA,
    Rejected,
    checked_documents,
    data_context,
    items_dataset,
    number_lines,
    raw_blocks,
    ray_for_preparation,
    read_tasks,
    run_tasks,
    shuffled_tasks,
    spread_key,
    task_pool,
)

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------


def _raw_document(row: dict) -> RawDocument:
    ids = row["paragraph_ids"]
    return RawDocument(row["source"], row["doc_id"], row["group"], row["lang"], row["text"],
                       tuple(ids) if ids is not None else None, row["order"])


def _first_of_each(table: pa.Table, sort_keys: list[str], columns: list[str] | None = None) -> tuple[pa.Table, int]:
    """The rows of `table` that are the first, in `sort_keys` order, of their (language, key), in that order and with
    `columns` (None: all), and the number of duplicates dropped. Only the sort and key columns are read row by row;
    the table is copied once, into the result."""
    order = pc.sort_indices(table, sort_keys=[(k, "ascending") for k in sort_keys])
    seen: set[tuple[str, bytes]] = set()
    kept: list[int] = []
    langs, keys = table.column("lang").take(order).to_pylist(), table.column("key").take(order).to_pylist()
    for row, lang, key in zip(order.to_pylist(), langs, keys):
        if (lang, key) not in seen:
            seen.add((lang, key))
            kept.append(row)
    table = table.select(columns) if columns else table
    return table.take(pa.array(kept, type=pa.int64())), table.num_rows - len(kept)


def _released(table: pa.Table) -> pa.Table:
    """`table`, after handing the memory Arrow freed in this task back to the system: a Ray worker process is reused
    by the next task, and would otherwise keep the peak of every partition it held (measured: an idle worker kept
    about 650 MiB after a 16x preparation's partitions)."""
    pa.default_memory_pool().release_unused()
    return table


def _deduplicate_documents(batch: pa.Table, work: str, opts: PrepareOptions) -> pa.Table:
    """One partition of the shuffled documents (every duplicate of a document is in the same one): the first of each
    duplicate kept, the training and the held-out groups written apart (a file each, named after the partition's
    first document), and the partition's reports merged into one."""
    is_report = pc.equal(batch.column("status"), "report")
    rejected = Rejected()
    for text in batch.filter(is_report).column("report").to_pylist():
        rejected.merge(Rejected.from_json(text))
    table, duplicates = _first_of_each(batch.filter(pc.invert(is_report)), ["order"], DOCUMENT_COLUMNS)
    out = {"clean_file": None, "row_groups": 0, "heldout_file": None, "duplicates": duplicates,
           "languages": "{}", "all_languages": "[]", "text_bytes": 0, "heldout_bytes": 0, "report": rejected.to_json()}
    if table.num_rows:
        name = f"part-{table.column('order')[0].as_py():016x}.parquet"
        heldout = np.array([is_heldout_group(g, opts.heldout_permille) for g in table.column("group").to_pylist()],
                           dtype=bool)
        train = table.filter(pa.array(~heldout))
        if train.num_rows:
            out["clean_file"] = str(Path(work) / "clean" / name)
            pq.write_table(train, out["clean_file"], row_group_size=LINES_PER_BLOCK)
            out["row_groups"] = pq.ParquetFile(out["clean_file"]).num_row_groups
        if heldout.any():
            out["heldout_file"] = str(Path(work) / "heldout" / name)
            held = table.filter(pa.array(heldout))
            pq.write_table(held, out["heldout_file"], row_group_size=HELDOUT_READ_ROWS)
            out["heldout_bytes"] = int(held.column("text").nbytes)
        out.update(languages=json.dumps(Counter(train.column("lang").to_pylist())),
                   all_languages=json.dumps(sorted(set(table.column("lang").to_pylist()))),
                   text_bytes=int(train.column("text").nbytes))
    return _released(pa.Table.from_pylist([out], schema=DOCUMENT_PARTITION_SCHEMA))


def _tokenizer_sample(batch: pa.Table, share: int, seed: int, work: str) -> pa.Table:
    """The tokenizer's sample of one partition's training documents, staged in the work folder (tokenizer-sample/):
    the driver gets the file's name."""
    out = []
    for file in batch.column("file").to_pylist():
        sample = TokenizerSample(share, seed)
        documents = pq.read_table(file, columns=["lang", "order", "text"])
        for lang, order, text in zip(documents.column("lang").to_pylist(), documents.column("order").to_pylist(),
                                     documents.column("text").to_pylist()):
            sample.add(lang, order, text)
        out.append({"file": _stage_sample(sample, Path(work) / "tokenizer-sample" / f"{Path(file).stem}.pickle")})
    return _released(pa.Table.from_pylist(out))


def _stage_sample(sample: TokenizerSample, path: Path) -> str:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(pickle.dumps(sample))
    os.replace(tmp, path)
    return str(path)


def _merge_tokenizer_samples(batch: pa.Table, share: int, seed: int, work: str) -> pa.Table:
    """Merge the staged samples each row names (`files`, a JSON list) into one staged sample: the sample of their
    parts together (`TokenizerSample.merge`), whatever the order they come in. Holds one part and the merged
    sample."""
    out = []
    for files in batch.column("files").to_pylist():
        files = json.loads(files)
        merged = TokenizerSample(share, seed)
        for file in files:
            merged.merge(pickle.loads(Path(file).read_bytes()))
        name = f"merged-{hashlib.sha1(json.dumps(sorted(files)).encode()).hexdigest()[:16]}.pickle"
        out.append({"file": _stage_sample(merged, Path(work) / "tokenizer-sample" / name)})
    return pa.Table.from_pylist(out)


def tokenizer_sample(clean_files: list[str], share: int, seed: int, work: Path, workers: int) -> TokenizerSample:
    """The tokenizer's sample of the training documents: one task per partition stages its sample, and tasks merge
    them SAMPLE_FAN_IN at a time until one is left, the only one the driver reads: it is at most `share` lines per
    language whatever the size of the corpus, and the sample the single-process engine draws (merging parts gives
    the sample of the whole)."""
    files = [row["file"] for row in run_tasks([{"file": f} for f in clean_files], _tokenizer_sample, workers=workers,
                                         share=share, seed=seed, work=str(work))]
    while len(files) > 1:
        groups = [json.dumps(sorted(files)[i:i + SAMPLE_FAN_IN]) for i in range(0, len(files), SAMPLE_FAN_IN)]
        files = [row["file"] for row in run_tasks([{"files": g} for g in groups], _merge_tokenizer_samples,
                                             workers=workers, share=share, seed=seed, work=str(work))]
    return pickle.loads(Path(files[0]).read_bytes()) if files else TokenizerSample(share, seed)


# --------------------------------------------------------------------------------------------------
# Stage 3: tokenize and chunk, de-duplicate chunks
# --------------------------------------------------------------------------------------------------


_TOKENIZERS: dict[str, MargeTokenizer] = {}
"""Tokenizers a worker process has loaded, by sha256: tasks, not actors, chunk the documents (an actor pool would
hold its CPUs while the stage's reads and writes wait for one: a deadlock on a 2-CPU cluster), and a worker process
runs many of them."""


def _tokenizer(model_bytes: bytes, languages: list[str]) -> MargeTokenizer:
    sha = hashlib.sha256(model_bytes).hexdigest()
    if sha not in _TOKENIZERS:
        _TOKENIZERS.clear()
        _TOKENIZERS[sha] = MargeTokenizer(model_bytes, languages)
    return _TOKENIZERS[sha]


def _partition(key: bytes, partitions: int) -> int:
    return int.from_bytes(key[:8], "big") % partitions


def _chunked_documents(batch: pa.Table, tokenizer_bytes: bytes, languages: list[str], opts: PrepareOptions,
                       partitions: int) -> Iterator[pa.Table]:
    """The documents of a span of row groups (LINES_PER_BLOCK documents each) of a partition of de-duplicated
    documents (`batch`: its file and span, `chunk_tasks`), a row group at a time, as chunks with their de-duplication
    key, each row group's with one row counting the paragraphs cut and the chunks too short. A chunk's `bucket`, a hash of (language, normalised chunk text) over
    `partitions`, is where the engine used to put it: the shards keep the order of chunks that tie
    (`_write_shards`)."""
    tokenizer = _tokenizer(tokenizer_bytes, languages)
    for task in batch.to_pylist():
        file, parquet = task["file"], pq.ParquetFile(task["file"])
        for row_group in range(task["start"], task["stop"]):
            out: list[dict] = []
            cut = too_short = 0
            for row in parquet.read_row_group(row_group).to_pylist():
                doc = _raw_document(row)
                pieces, n_cut = document_pieces(doc, tokenizer, opts)
                cut += n_cut
                for i, piece in enumerate(pieces):
                    if len(piece.tokens) < opts.min_document_tokens:
                        too_short += 1
                        continue
                    key = normalized_hash(piece.text)
                    out.append({"status": "ok", "order": doc.order, "chunk_index": i, "num_chunks": len(pieces),
                                "group": doc.group, "lang": doc.lang, "doc_key": f"{doc.doc_id}#{i}",
                                "tokens": piece.tokens, "text": piece.text, "source": doc.source,
                                "paragraph_ids": piece.paragraph_ids, "key": key,
                                "bucket": _partition(hashlib.sha1(doc.lang.encode() + key).digest(), partitions)})
            out.append({"status": "counts", "lang": "", "key": spread_key("counts", file, row_group),
                        "paragraphs_cut": cut, "too_short": too_short, "bucket": NOT_A_DOCUMENT})
            yield pa.Table.from_pylist(out, schema=CHUNK_SCHEMA)


def chunk_tasks(files: list[tuple[str, int]], workers: int) -> list[dict]:
    """The chunking tasks for the clean files (each with its row groups): spans of row groups, about four per worker
    in all (a task per row group would be a task per LINES_PER_BLOCK documents: 100,000 at 100M documents), never
    across files."""
    per_task = max(1, sum(n for _, n in files) // (4 * workers))
    return [{"file": f, "start": g, "stop": min(g + per_task, n)} for f, n in files for g in range(0, n, per_task)]


def _deduplicate_chunks(batch: pa.Table, work: str) -> pa.Table:
    """One partition of the shuffled chunks: the first of each duplicate in (input order, chunk index) kept and
    written (one file, named after its first chunk), the partition's counts summed."""
    is_counts = pc.equal(batch.column("status"), "counts")
    counts = batch.filter(is_counts)
    table, duplicates = _first_of_each(batch.filter(pc.invert(is_counts)), ["order", "chunk_index"],
                                       [*SHARD_COLUMNS, "bucket"])
    out = {"file": None, "chunks": table.num_rows, "duplicates": duplicates,
           "bytes": int(table.select(SHARD_COLUMNS).nbytes),
           "paragraphs_cut": int(pc.sum(counts.column("paragraphs_cut")).as_py() or 0),
           "too_short": int(pc.sum(counts.column("too_short")).as_py() or 0)}
    if table.num_rows:
        first = (table.column("order")[0].as_py(), table.column("chunk_index")[0].as_py())
        out["file"] = str(Path(work) / "chunks-clean" / f"part-{first[0]:016x}-{first[1]:05d}.parquet")
        pq.write_table(table, out["file"])
    return _released(pa.Table.from_pylist([out], schema=CHUNK_PARTITION_SCHEMA))


# --------------------------------------------------------------------------------------------------
# Stage 4: route to shards, write them
# --------------------------------------------------------------------------------------------------


def shard_of_group(group: str, seed: int, num_shards: int) -> int:
    """The shard a group's chunks go to: a hash of the seed and the group."""
    return int.from_bytes(hashlib.sha1(f"marge-shard:{seed}:{group}".encode()).digest()[:8], "big") % num_shards


def _shards(groups: list[str], seed: int, num_shards: int) -> np.ndarray:
    return np.array([shard_of_group(g, seed, num_shards) for g in groups], dtype=np.int64)


def _count_shards(batch: pa.Table, seed: int, num_shards: int) -> pa.Table:
    """The chunks per shard of one partition of de-duplicated chunks."""
    out = []
    for file in batch.column("file").to_pylist():
        shards = _shards(pq.read_table(file, columns=["group"]).column("group").to_pylist(), seed, num_shards)
        out.append({"counts": np.bincount(shards, minlength=num_shards).tobytes()})
    return pa.Table.from_pylist(out)


def _chunks_with_their_shard(batch: pa.Table, seed: int, num_shards: int) -> Iterator[pa.Table]:
    for file in batch.column("file").to_pylist():
        table = pq.read_table(file)
        yield table.append_column("shard", pa.array(_shards(table.column("group").to_pylist(), seed, num_shards)))


def _write_shards(batch: pa.Table, corpus: str, per_shard: np.ndarray) -> pa.Table:
    """The shards of one partition of chunks shuffled by shard (every chunk of a shard is in it), each sorted and
    numbered and written into the corpus folder: a shard's number is its place among the shards that have chunks
    (`per_shard`: the chunks of every shard), its first doc id the chunks of the shards before it. Chunks that tie in
    `shard_columns`'s order (a group's documents in one language) stay in (bucket, input order, chunk index) order."""
    numbers, first_ids = np.cumsum(per_shard > 0) - 1, np.cumsum(per_shard) - per_shard
    table = batch.sort_by([("bucket", "ascending"), ("order", "ascending"), ("chunk_index", "ascending")])
    shard_column = table.column("shard").to_numpy()
    out = []
    for shard in sorted(set(shard_column.tolist())):
        rows = table.filter(pa.array(shard_column == shard)).to_pylist()
        chunks = [Chunk(r["group"], r["lang"], r["doc_key"], r["chunk_index"], r["num_chunks"], r["tokens"],
                         r["text"], r["source"], r["paragraph_ids"]) for r in rows]
        number = int(numbers[shard])
        info = write_corpus_shard(Path(corpus), number, shard_columns(chunks, number, int(first_ids[shard])))
        out.append({"info": json.dumps(info), "languages": json.dumps(Counter(c.lang for c in chunks)),
                    "groups": len({c.group for c in chunks}), "tokens": sum(len(c.tokens) for c in chunks),
                    "aligned": sum(bool(c.paragraph_ids) for c in chunks)})
    return _released(pa.Table.from_pylist(out, schema=SHARD_WRITTEN_SCHEMA))


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


def prepare_on_ray(opts: PrepareOptions, ray_address: str | None = None) -> dict:
    """Prepare the corpus `opts` describes on Ray Data (see the module docstring); returns the manifest written."""
    started = time.time()
    if opts.out.exists() and not opts.overwrite:
        raise PrepareError(f"{opts.out} already exists; choose another --out or pass --overwrite to replace it")
    for path in opts.inputs:
        check_input(path)
    with ray_for_preparation(ray_address, opts.workers) as workers, data_context():
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        work = opts.out.parent / f".{opts.out.name}.work"
        shutil.rmtree(work, ignore_errors=True)  # a killed run's
        try:
            for sub in INTERMEDIATE_FOLDERS:
                (work / sub).mkdir(parents=True)
            manifest = _prepare(opts, work, workers)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("wrote %d chunks in %d shards to %s in %.1f s on Ray Data (%d workers)", manifest["num_documents"],
             manifest["num_shards"], opts.out, time.time() - started, workers)
    return manifest


INTERMEDIATE_FOLDERS = ("clean", "heldout", "chunks-clean", "tokenizer-sample", "heldout-pairs")
"""The work folder's: the training and the held-out documents, de-duplicated; the chunks, de-duplicated (a file per
partition in each); the tokenizer's samples (a file per document partition, and one per merge of SAMPLE_FAN_IN);
the held-out translation pairs (a file per partition of the held-out groups)."""


class _StageClock:
    """Seconds per stage, for the manifest (`engine.stage_seconds`): where a preparation's time went."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = round(now - self._last, 2)
        self._last = now


def _prepare(opts: PrepareOptions, work: Path, workers: int) -> dict:
    stats = PrepareStats()
    clock = _StageClock()
    partitions = max(1, math.ceil(input_bytes(opts.inputs, GZIP_EXPANSION) / opts.partition_bytes))
    tasks = read_tasks(opts.inputs, READ_SPLIT_BYTES)
    number_lines(tasks, workers)
    log.info("reading, checking and de-duplicating %d input task(s) in %d partition(s), %d workers", len(tasks),
             partitions, workers)
    documents = (items_dataset([{"task": i} for i in range(len(tasks))])
                 .map_batches(raw_blocks, batch_size=1, batch_format="pyarrow", compute=task_pool(workers, len(tasks)),
                              fn_kwargs={"tasks": tasks})
                 .map_batches(checked_documents, batch_size=None, batch_format="pyarrow",
                              compute=task_pool(workers, workers), fn_kwargs={"opts": opts}))
    rejected = Rejected()
    per_language, languages = Counter[str](), set[str]()
    clean_files, heldout_files = [], []  # the clean files with their row groups
    clean_bytes = heldout_bytes = 0
    for row in shuffled_tasks(documents, DEDUPLICATION_KEYS, partitions, _deduplicate_documents, workers=workers,
                         work=str(work), opts=opts):
        rejected.merge(Rejected.from_json(row["report"]))
        stats.counts["documents_duplicate"] += row["duplicates"]
        per_language.update(json.loads(row["languages"]))
        languages.update(json.loads(row["all_languages"]))
        clean_bytes += row["text_bytes"]
        heldout_bytes += row["heldout_bytes"]
        if row["clean_file"]:
            clean_files.append((row["clean_file"], row["row_groups"]))
        if row["heldout_file"]:
            heldout_files.append(row["heldout_file"])
    account_rejected(rejected, opts, stats)
    if not languages:
        raise PrepareError(f"no usable documents in {', '.join(map(str, opts.inputs))}")
    if not per_language:
        raise PrepareError(f"--heldout-permille {opts.heldout_permille} held out every group: nothing left to train on")
    clock.lap("read_check_deduplicate")
    trained_languages = sorted(per_language)
    log.info("%d documents in %d languages after checks and de-duplication", sum(per_language.values()),
             len(trained_languages))

    if opts.tokenizer_dir is not None:
        tokenizer, sample_summary = load_tokenizer(opts, trained_languages), None
    else:
        share = TokenizerSample.per_language_share(opts.tokenizer_sample_lines, len(languages))
        sample = tokenizer_sample([f for f, _ in clean_files], share, opts.seed, work, workers)
        clock.lap("tokenizer_sample")
        tokenizer, sample_summary = train_tokenizer(sample, trained_languages, opts), sample.summary()
        del sample
    clock.lap("tokenizer")

    chunk_partitions = max(1, math.ceil(2 * clean_bytes / opts.partition_bytes))
    log.info("tokenizing, chunking and de-duplicating in %d partition(s)", chunk_partitions)
    spans = chunk_tasks(clean_files, workers)
    chunks = items_dataset(spans).map_batches(
        _chunked_documents, batch_size=1, batch_format="pyarrow", compute=task_pool(workers, len(spans)),
        fn_kwargs={"tokenizer_bytes": tokenizer.model_bytes, "languages": tokenizer.languages, "opts": opts,
                   "partitions": chunk_partitions})
    chunk_files = []
    total = chunk_bytes = 0
    for row in shuffled_tasks(chunks, DEDUPLICATION_KEYS, chunk_partitions, _deduplicate_chunks, workers=workers,
                         work=str(work)):
        stats.counts["chunks_duplicate"] += row["duplicates"]
        stats.counts["paragraphs_cut"] += row["paragraphs_cut"]
        stats.counts["documents_too_short"] += row["too_short"]
        total += row["chunks"]
        chunk_bytes += row["bytes"]
        if row["file"]:
            chunk_files.append(row["file"])
    if not total:
        raise PrepareError("every chunk was a duplicate or empty; nothing to write")
    clock.lap("tokenize_chunk_deduplicate")

    num_shards = opts.num_shards or max(1, math.ceil(total / opts.docs_per_shard))
    shard_groups = max(1, min(num_shards, math.ceil(chunk_bytes / opts.partition_bytes)))
    per_shard = np.zeros(num_shards, dtype=np.int64)
    for row in run_tasks([{"file": f} for f in chunk_files], _count_shards, workers=workers, seed=opts.seed,
                    num_shards=num_shards):
        per_shard += np.frombuffer(row["counts"], dtype=np.int64)
    clock.lap("count_shards")

    heldout_groups, pair_files = stage_heldout_pairs(
        heldout_files, work, opts, workers, max(1, math.ceil(heldout_bytes / opts.partition_bytes))) \
        if heldout_files else (0, [])
    clock.lap("heldout_pairs")

    log.info("writing %d shards", int(np.count_nonzero(per_shard)))  # a shard no group hashed to is left out
    intermediate_files = {sub: sum(1 for _ in os.scandir(work / sub)) for sub in INTERMEDIATE_FOLDERS}

    def write_shards(folder: Path) -> dict:
        by_shard = items_dataset([{"file": f} for f in chunk_files]).map_batches(
            _chunks_with_their_shard, batch_size=1, batch_format="pyarrow", compute=task_pool(workers, len(chunk_files)),
            fn_kwargs={"seed": opts.seed, "num_shards": num_shards})
        written = list(shuffled_tasks(by_shard, ["shard"], shard_groups, _write_shards, workers=workers, corpus=str(folder),
                                 per_shard=per_shard))
        infos = sorted((json.loads(r["info"]) for r in written), key=lambda i: i["shard"])
        clock.lap("write_shards")
        lang_counts = Counter[str]()
        for r in written:
            lang_counts.update(json.loads(r["languages"]))
        return corpus_manifest(
            opts, tokenizer, infos, sum(r["groups"] for r in written), lang_counts, sum(r["tokens"] for r in written),
            sum(r["aligned"] for r in written), stats, sample_summary,
            {"name": "ray", "shard_assignment": "hash", "workers": workers, "read_tasks": len(tasks),
             "document_partitions": partitions, "chunk_partitions": chunk_partitions, "shard_groups": shard_groups,
             "intermediate_files": intermediate_files, "stage_seconds": clock.seconds})

    def write_heldout(folder: Path, train_groups: int) -> dict | None:
        if not heldout_files:
            return None
        return heldout_manifest(opts, heldout_groups, *write_heldout_split(heldout_files, pair_files, folder, opts),
                                train_groups)

    return publish_corpus(opts, tokenizer, write_heldout, write_shards)


def account_rejected(rejected: Rejected, opts: PrepareOptions, stats: PrepareStats) -> None:
    """Count the documents read and the rejected ones; stop at the first unreadable input, and (unless bad ones are to
    be skipped) at the first bad document in input order, as the single-process engine does. The bad documents'
    warnings name the first SKIPPED_KEPT of them and count the rest."""
    if rejected.first_fatal is not None:
        raise PrepareError(rejected.first_fatal[1])
    stats.counts["documents_read"] += rejected.read
    stats.counts["documents_skipped_language"] += rejected.skipped_language
    if not rejected.skipped_bad:
        return
    if opts.on_bad_document == "error":
        raise PrepareError(f"{rejected.first_bad[0][1]} (or pass --skip-bad-documents to drop such documents)")
    stats.counts["documents_skipped_bad"] += rejected.skipped_bad
    for _, error in rejected.first_bad:
        stats.skipped.append(error)
        log.warning("skipping: %s", error)
    if rejected.skipped_bad > len(rejected.first_bad):
        log.warning("skipping %d more bad documents (%d in all: the manifest's stats.documents_skipped_bad)",
                    rejected.skipped_bad - len(rejected.first_bad), rejected.skipped_bad)


# --------------------------------------------------------------------------------------------------
# The held-out split, written by the workers
# --------------------------------------------------------------------------------------------------


def stage_heldout_pairs(heldout_files: list[str], work: Path, opts: PrepareOptions, workers: int,
                        partitions: int) -> tuple[int, list[str]]:
    """The held-out documents the de-duplication staged (`heldout_files`) shuffled by group, one task per partition
    of groups staging its translation pairs (`_heldout_pairs`); returns the groups and the staged pairs' files."""
    documents = items_dataset([{"file": f} for f in heldout_files]).map_batches(
        _staged_documents, batch_size=1, batch_format="pyarrow", compute=task_pool(workers, len(heldout_files)))
    groups, pair_files = 0, []
    for row in shuffled_tasks(documents, ["group"], partitions, _heldout_pairs, workers=workers, work=str(work),
                         max_per_direction=opts.max_pairs_per_direction):
        groups += row["groups"]
        if row["file"]:
            pair_files.append(row["file"])
    return groups, pair_files


def write_heldout_split(heldout_files: list[str], pair_files: list[str], folder: Path, opts: PrepareOptions
                        ) -> tuple[int, int]:
    """Write `heldout/` into the corpus folder being built without bringing the held-out documents to the driver:
    one task merges the staged files into documents.jsonl.gz (input order) and pairs.tsv (`_write_heldout`), the
    single-process engine's files (`write_heldout`). Returns (documents, pairs)."""
    [written] = run_tasks([{"documents": json.dumps(sorted(heldout_files)), "pairs": json.dumps(sorted(pair_files))}],
                     _write_heldout, workers=1, folder=str(folder), max_per_direction=opts.max_pairs_per_direction)
    return written["documents"], written["pairs"]


def _staged_documents(batch: pa.Table) -> Iterator[pa.Table]:
    for file in batch.column("file").to_pylist():
        yield pq.read_table(file, columns=DOCUMENT_COLUMNS)


def _heldout_pairs(batch: pa.Table, work: str, max_per_direction: int) -> pa.Table:
    """One partition of the held-out documents shuffled by group (every document of a group in it): the first
    `max_per_direction` translation pairs of each direction among its groups (`heldout_pairs_by_direction`), staged
    in direction, group and place order (heldout-pairs/: a file, named after its first document)."""
    out = {"file": None, "groups": 0, "documents": batch.num_rows}
    if batch.num_rows:
        table = batch.sort_by([("order", "ascending")])
        docs = [_raw_document(row) for row in table.select(DOCUMENT_COLUMNS).to_pylist()]
        out["groups"] = len({d.group for d in docs})
        rows = [{"src": src, "tgt": tgt, "group": group, "seq": seq, "cells": list(pair)}
                for (src, tgt), pairs in sorted(heldout_pairs_by_direction(docs, max_per_direction).items())
                for seq, (group, pair) in enumerate(pairs)]
        if rows:
            out["file"] = str(Path(work) / "heldout-pairs" / f"part-{docs[0].order:016x}.parquet")
            pq.write_table(pa.Table.from_pylist(rows, schema=PAIR_SCHEMA), out["file"], row_group_size=HELDOUT_READ_ROWS)
    return _released(pa.Table.from_pylist([out], schema=HELDOUT_PARTITION_SCHEMA))


def _staged_rows(file: str) -> Iterator[dict]:
    for batch in pq.ParquetFile(file).iter_batches(batch_size=HELDOUT_READ_ROWS):
        yield from batch.to_pylist()


def _write_heldout(batch: pa.Table, folder: str, max_per_direction: int) -> pa.Table:
    """documents.jsonl.gz and pairs.tsv in `folder`, from the staged files the row names: the held-out documents'
    files (each in input order) merged into input order, and the staged pairs (each file in direction, group, place
    order) merged into that order, the first `max_per_direction` of each direction kept: what `write_heldout`
    writes. Holds HELDOUT_READ_ROWS rows of each file."""
    [task] = batch.to_pylist()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    documents = pairs = 0
    with gzip.open(out / "documents.jsonl.gz", "wt", encoding="utf-8") as f:
        for row in heapq.merge(*(_staged_rows(file) for file in json.loads(task["documents"])),
                               key=lambda r: r["order"]):
            f.write(json.dumps(heldout_row(_raw_document(row)), ensure_ascii=False) + "\n")
            documents += 1
    taken: Counter = Counter()
    with contextlib.ExitStack() as stack:
        tsv = None
        for row in heapq.merge(*(_staged_rows(file) for file in json.loads(task["pairs"])),
                               key=lambda r: (r["src"], r["tgt"], r["group"], r["seq"])):
            direction = (row["src"], row["tgt"])
            if taken[direction] >= max_per_direction:
                continue
            taken[direction] += 1
            if tsv is None:
                tsv = stack.enter_context(open(out / "pairs.tsv", "w", encoding="utf-8", newline="\n"))
            tsv.write(pair_line(tuple(row["cells"]), row["group"]))
            pairs += 1
    return pa.Table.from_pylist([{"documents": documents, "pairs": pairs}])
