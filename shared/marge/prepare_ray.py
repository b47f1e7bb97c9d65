"""`marge prepare --engine ray`: the same corpus as the single-process engine, streamed through Ray Data.

The corpus never sits in one process. Each stage is a Ray Data operator, run by `workers` tasks at a time, and
hands the next stage files in a work folder beside `--out` (so on a cluster, like the corpus, it must be on a
filesystem every node sees):

  read -> check -> hash partitions      the input's lines (or files) are read as raw bytes, then parsed and
                                        checked (UTF-8, fields, fastText language ID, the --languages filter) and
                                        written partitioned by a hash of (language, normalised text);
  de-duplicate documents                one task per partition keeps, of each duplicate, the first in input order
                                        (what the single-process engine keeps), splits off the held-out groups, and
                                        samples the tokenizer's lines (`TokenizerSample`: merged in the driver,
                                        it is the sample the single-process engine draws);
  train the tokenizer                   in the driver, on the sample alone;
  tokenize and chunk -> partitions      documents become chunks, tokens as int32 arrays, partitioned by a hash of
                                        (language, normalised chunk text);
  de-duplicate chunks                   one task per partition, first in (input order, chunk index) kept;
  route to shards                       a group's shard is a hash of (seed, group) (every chunk of a page in one
                                        shard, as in the single-process engine, whose greedy balance needs every
                                        group's size in one place: shards here are equal in expectation instead);
  write shards                          one task per group of shards sorts, numbers and writes them.

What a task holds is one partition (`partition_bytes`), one block of lines, or the tokenizer sample: the peak memory
does not grow with the corpus (measured in `benchmarks/prepare_scale.py`). The documents and their tokens are the
single-process engine's (tests/test_prepare_ray.py); the shards they are in, and so the doc ids, differ.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import pickle
import shutil
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from marge.prepare import (HELDOUT_DIR, PrepareError, PrepareOptions, RawDocument, TokenizerSample, _Chunk,
                           _Stats, check_document, check_input, corpus_manifest, document_pieces, folder_files,
                           input_bytes, input_order, is_heldout_group, jsonl_lines, load_tokenizer, normalized_hash,
                           parse_jsonl_line, read_folder_file, shard_columns, train_tokenizer, write_corpus_shard,
                           write_heldout)
from marge.tokenizer import MargeTokenizer
from marge.utils import atomic_directory, atomic_write_text

log = logging.getLogger(__name__)

LINES_PER_BLOCK = 1000
"""Raw lines (or files) per block the reader hands the checkers, and documents per block the chunkers take: a block
is what one task holds (and at most BLOCK_BYTES of raw input)."""
BLOCK_BYTES = 2 << 20
FILES_PER_READ_TASK = 512
OBJECT_STORE_BYTES = 512 << 20
"""The object store of a local Ray started for a preparation: Ray Data streams through it and spills past it."""
GZIP_EXPANSION = 4
"""Assumed bytes of text per byte of a .gz input, to size the partitions before anything is read."""

_RAW = pa.schema([("order", pa.int64()), ("input", pa.int32()), ("line", pa.int64()), ("path", pa.string()),
                  ("lang_dir", pa.string()), ("raw", pa.large_binary()), ("fatal", pa.string())])
_DOCUMENT = pa.schema([("status", pa.string()), ("order", pa.int64()), ("source", pa.string()),
                       ("doc_id", pa.string()), ("group", pa.string()), ("lang", pa.string()),
                       ("text", pa.large_string()), ("paragraph_ids", pa.list_(pa.string())),
                       ("key", pa.binary()), ("error", pa.string()), ("bucket", pa.int32())])
_CHUNK = pa.schema([("status", pa.string()), ("order", pa.int64()), ("chunk_index", pa.int32()),
                    ("num_chunks", pa.int32()), ("group", pa.string()), ("lang", pa.string()),
                    ("doc_key", pa.string()), ("tokens", pa.list_(pa.int32())), ("text", pa.large_string()),
                    ("source", pa.string()), ("paragraph_ids", pa.list_(pa.string())), ("key", pa.binary()),
                    ("paragraphs_cut", pa.int64()), ("too_short", pa.int64()), ("bucket", pa.int32())])
NOT_A_DOCUMENT = -1
"""The partition of rows that carry counts or errors, not documents."""


# --------------------------------------------------------------------------------------------------
# Ray
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def ray_for_preparation(address: str | None, workers: int | None) -> Iterator[int]:
    """Ray for the preparation: the one this process is already connected to, the cluster at `address` (or
    RAY_ADDRESS), or a private local Ray on loopback stopped afterwards. Yields the tasks to run at once per stage."""
    import ray

    from marge.local_ray import apply_local_ray_env, keeping_sigterm_handler, local_ray

    address = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        yield workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    elif address:
        apply_local_ray_env()
        with keeping_sigterm_handler():
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        try:
            yield workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        finally:
            ray.shutdown()  # this process's connection only
    else:
        cpus = workers or os.cpu_count() or 1
        with local_ray(cpus, object_store_memory=OBJECT_STORE_BYTES):
            yield cpus


@contextlib.contextmanager
def _data_context() -> Iterator[None]:
    """For the block: blocks of about BLOCK_BYTES (Ray Data's default, 128 MiB, would hand one task a whole input
    file's lines), and Ray Data's progress bars on a terminal; elsewhere (a log file, a job's output) the stages' own
    log lines, not Ray Data's report of every operator every few seconds. The process's settings are put back after
    (a program that embeds the preparation may use Ray Data itself)."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    data_logger = logging.getLogger("ray.data")
    saved = (ctx.target_max_block_size, ctx.enable_progress_bars, ctx.print_on_execution_start, data_logger.level)
    ctx.target_max_block_size = 2 * BLOCK_BYTES
    ctx.enable_progress_bars = sys.stderr.isatty() and os.environ.get("MARGE_PROGRESS", "1") != "0"
    ctx.print_on_execution_start = False
    if not ctx.enable_progress_bars:
        data_logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            # an input smaller than a block is one task's work, which Ray Data warns of at every stage
            warnings.filterwarnings("ignore", message="The maximum number of concurrent tasks", category=UserWarning)
            yield
    finally:
        (ctx.target_max_block_size, ctx.enable_progress_bars, ctx.print_on_execution_start) = saved[:3]
        data_logger.setLevel(saved[3])


def _tasks(workers: int, inputs: int):
    """At most `workers` tasks at once, and never more than there are inputs."""
    from ray.data import TaskPoolStrategy

    return TaskPoolStrategy(size=max(1, min(workers, inputs)))


# --------------------------------------------------------------------------------------------------
# Stage 1: read, check, partition the documents
# --------------------------------------------------------------------------------------------------


def read_tasks(inputs: list[Path]) -> list[dict]:
    """One task per JSONL file, one per FILES_PER_READ_TASK files of a folder, in input order."""
    tasks: list[dict] = []
    for index, path in enumerate(inputs):
        if check_input(path) == "folder":
            files = [(str(lang_dir), str(file)) for lang_dir, file in folder_files(path)]
            for start in range(0, len(files), FILES_PER_READ_TASK):
                tasks.append({"kind": "folder", "input": index, "start": start,
                              "files": files[start:start + FILES_PER_READ_TASK]})
        else:
            tasks.append({"kind": "jsonl", "input": index, "path": str(path)})
    return tasks


def _raw_blocks(batch: pa.Table, tasks: list[dict]) -> Iterator[pa.Table]:
    """The raw lines (or files) of the read tasks in `batch`, LINES_PER_BLOCK at a time."""
    rows: list[dict] = []
    size = 0
    for task_index in batch.column("task").to_pylist():
        task = tasks[task_index]
        try:
            if task["kind"] == "jsonl":
                items = ((line_no, task["path"], None, raw) for line_no, raw in jsonl_lines(Path(task["path"])))
            else:
                items = ((position, file, lang_dir, Path(file).read_bytes())
                         for position, (lang_dir, file) in enumerate(task["files"], start=task["start"]))
            for position, path, lang_dir, raw in items:
                rows.append({"order": input_order(task["input"], position), "input": task["input"],
                             "line": position, "path": path, "lang_dir": lang_dir, "raw": raw})
                size += len(raw)
                if len(rows) >= LINES_PER_BLOCK or size >= BLOCK_BYTES:
                    yield pa.Table.from_pylist(rows, schema=_RAW)
                    rows, size = [], 0
        except (PrepareError, OSError) as e:
            rows.append({"order": input_order(task["input"], 0), "input": task["input"], "line": 0,
                         "path": task.get("path", ""), "fatal": str(e)})
    if rows:
        yield pa.Table.from_pylist(rows, schema=_RAW)


def _released(table: pa.Table) -> pa.Table:
    """`table`, after handing the memory Arrow freed in this task back to the system: a Ray worker process is reused
    by the next task, and would otherwise keep the peak of every partition it held (measured: an idle worker kept
    about 650 MiB after a 16x preparation's partitions)."""
    pa.default_memory_pool().release_unused()
    return table


def _partition(key: bytes, partitions: int) -> int:
    return int.from_bytes(key[:8], "big") % partitions


def _checked_documents(batch: pa.Table, opts: PrepareOptions, partitions: int) -> pa.Table:
    """Parse and check a block of raw lines (files): documents with their de-duplication key and partition, and
    rows for the bad, the filtered-out and the unreadable (with NOT_A_DOCUMENT as partition)."""
    out: list[dict] = []
    for row in batch.to_pylist():
        if row["fatal"] is not None:
            out.append({"status": "fatal", "order": row["order"], "error": row["fatal"], "bucket": NOT_A_DOCUMENT})
            continue
        path = Path(row["path"])
        try:
            if row["lang_dir"] is None:
                raw_doc = parse_jsonl_line(path, row["line"], row["raw"], row["input"])
                if raw_doc is None:  # a blank line
                    continue
            else:
                raw_doc = read_folder_file(Path(row["lang_dir"]), path, row["order"], row["raw"])
            doc = check_document(raw_doc, opts)
        except PrepareError as e:
            out.append({"status": "bad", "order": row["order"], "error": str(e), "bucket": NOT_A_DOCUMENT})
            continue
        if opts.languages is not None and doc.lang not in opts.languages:
            out.append({"status": "language", "order": doc.order, "bucket": NOT_A_DOCUMENT})
            continue
        key = normalized_hash(doc.text)
        out.append({"status": "ok", "order": doc.order, "source": doc.source, "doc_id": doc.doc_id,
                    "group": doc.group, "lang": doc.lang, "text": doc.text,
                    "paragraph_ids": list(doc.paragraph_ids) if doc.paragraph_ids is not None else None,
                    "key": key, "bucket": _partition(hashlib.sha1(doc.lang.encode() + key).digest(), partitions)})
    return pa.Table.from_pylist(out, schema=_DOCUMENT)


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


def _partition_files(root: Path, bucket: int) -> list[Path]:
    return sorted((root / f"bucket={bucket}").glob("*.parquet"))


def _read_partition(root: Path, bucket: int, schema: pa.Schema) -> pa.Table:
    """The rows of one partition (written by `write_parquet(partition_cols=["bucket"])`: the column is in the
    folder's name, not in the files)."""
    schema = schema.remove(schema.get_field_index("bucket"))
    tables = [pq.read_table(f) for f in _partition_files(root, bucket)]
    tables = [t if t.schema.equals(schema) else t.cast(schema) for t in tables]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def _deduplicate_documents(batch: pa.Table, work: str, opts: PrepareOptions, share: int) -> pa.Table:
    """One partition of documents: the first of each duplicate kept, training and held-out groups written apart,
    the tokenizer's lines sampled from the training documents."""
    out = []
    for bucket in batch.column("bucket").to_pylist():
        table, duplicates = _first_of_each(_read_partition(Path(work) / "documents", bucket, _DOCUMENT), ["order"])
        heldout = np.array([is_heldout_group(g, opts.heldout_permille) for g in table.column("group").to_pylist()],
                           dtype=bool)
        train = table.filter(pa.array(~heldout))
        pq.write_table(train, Path(work) / "clean" / f"part-{bucket:05d}.parquet", row_group_size=LINES_PER_BLOCK)
        if heldout.any():
            pq.write_table(table.filter(pa.array(heldout)), Path(work) / "heldout" / f"part-{bucket:05d}.parquet")
        sample = TokenizerSample(share, opts.seed)
        if opts.tokenizer_dir is None:
            for lang, order, text in zip(train.column("lang").to_pylist(), train.column("order").to_pylist(),
                                         train.column("text").to_pylist()):
                sample.add(lang, order, text)
        out.append({"bucket": bucket, "duplicates": duplicates, "languages": json.dumps(
                    Counter(train.column("lang").to_pylist())), "text_bytes": int(train.column("text").nbytes),
                    "sample": pickle.dumps(sample)})
    return _released(pa.Table.from_pylist(out))


# --------------------------------------------------------------------------------------------------
# Stage 2: tokenize and chunk, de-duplicate chunks
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


def _chunked_documents(batch: pa.Table, tokenizer_bytes: bytes, languages: list[str], opts: PrepareOptions,
                       partitions: int) -> pa.Table:
    """The documents of a row group of de-duplicated documents (`batch`: its file and index) as chunks with their
    de-duplication key and partition, and one row counting the paragraphs cut and the chunks too short
    (NOT_A_DOCUMENT)."""
    tokenizer = _tokenizer(tokenizer_bytes, languages)
    (task,) = batch.to_pylist()
    documents = pq.ParquetFile(task["file"]).read_row_group(task["row_group"])
    out: list[dict] = []
    cut = too_short = 0
    for row in documents.to_pylist():
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
    out.append({"status": "counts", "paragraphs_cut": cut, "too_short": too_short, "bucket": NOT_A_DOCUMENT})
    return pa.Table.from_pylist(out, schema=_CHUNK)


def shard_of_group(group: str, seed: int, num_shards: int) -> int:
    """The shard a group's chunks go to: a hash of the seed and the group."""
    return int.from_bytes(hashlib.sha1(f"marge-shard:{seed}:{group}".encode()).digest()[:8], "big") % num_shards


_SHARD_COLUMNS = ["order", "chunk_index", "num_chunks", "group", "lang", "doc_key", "tokens", "text", "source",
                  "paragraph_ids"]


def _deduplicate_chunks(batch: pa.Table, work: str) -> pa.Table:
    out = []
    for bucket in batch.column("bucket").to_pylist():
        table, duplicates = _first_of_each(_read_partition(Path(work) / "chunks", bucket, _CHUNK),
                                           ["order", "chunk_index"], _SHARD_COLUMNS)
        pq.write_table(table, Path(work) / "chunks-clean" / f"part-{bucket:05d}.parquet")
        out.append({"bucket": bucket, "chunks": table.num_rows, "duplicates": duplicates,
                    "bytes": int(table.nbytes)})
    return _released(pa.Table.from_pylist(out))


def _route_to_shards(batch: pa.Table, work: str, seed: int, num_shards: int, shard_groups: int) -> pa.Table:
    """Chunks of one partition into the folders of their shard groups (shard % shard_groups); returns the chunks per
    shard."""
    out = []
    for bucket in batch.column("bucket").to_pylist():
        table = pq.read_table(Path(work) / "chunks-clean" / f"part-{bucket:05d}.parquet")
        shards = np.array([shard_of_group(g, seed, num_shards) for g in table.column("group").to_pylist()],
                          dtype=np.int64)
        for q in np.unique(shards % shard_groups):
            folder = Path(work) / "by-shard" / f"q={q}"
            folder.mkdir(parents=True, exist_ok=True)
            rows = shards % shard_groups == q
            part = table.filter(pa.array(rows)).append_column("shard", pa.array(shards[rows]))
            pq.write_table(part, folder / f"part-{bucket:05d}.parquet")
        out.append({"bucket": bucket, "counts": np.bincount(shards, minlength=num_shards).tobytes()})
    return _released(pa.Table.from_pylist(out))


def _write_shards(batch: pa.Table, work: str, corpus: str, numbering: dict[int, tuple[int, int]]) -> pa.Table:
    """The shards of one shard group, each sorted and numbered (`numbering`: shard -> (its number in the corpus, its
    first doc id)) and written into the corpus folder."""
    out = []
    for q in batch.column("q").to_pylist():
        files = sorted((Path(work) / "by-shard" / f"q={q}").glob("*.parquet"))
        if not files:
            continue
        table = pa.concat_tables(pq.read_table(f) for f in files)
        shard_column = table.column("shard").to_numpy()
        for shard in sorted(set(shard_column.tolist())):
            rows = table.filter(pa.array(shard_column == shard)).to_pylist()
            chunks = [_Chunk(r["group"], r["lang"], r["doc_key"], r["chunk_index"], r["num_chunks"], r["tokens"],
                             r["text"], r["source"], r["paragraph_ids"]) for r in rows]
            number, first_id = numbering[shard]
            info = write_corpus_shard(Path(corpus), number, shard_columns(chunks, number, first_id))
            out.append({"info": json.dumps(info), "languages": json.dumps(Counter(c.lang for c in chunks)),
                        "groups": len({c.group for c in chunks}), "tokens": sum(len(c.tokens) for c in chunks),
                        "aligned": sum(bool(c.paragraph_ids) for c in chunks)})
    return _released(pa.Table.from_pylist(out))


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


def _run(rows: list[dict], fn, *, workers: int, **kwargs) -> Iterator[dict]:
    """Apply `fn` to each of `rows` (one call per row), `workers` at once; its small results, as they come."""
    yield from _items(rows).map_batches(fn, batch_size=1, batch_format="pyarrow", compute=_tasks(workers, len(rows)),
                                        fn_kwargs=kwargs).iter_rows()


def _items(rows: list[dict]):
    import ray.data

    return ray.data.from_items(rows, override_num_blocks=max(1, len(rows)))


def prepare_on_ray(opts: PrepareOptions, ray_address: str | None = None) -> dict:
    """Prepare the corpus `opts` describes on Ray Data (see the module docstring); returns the manifest written."""
    started = time.time()
    if opts.out.exists() and not opts.overwrite:
        raise PrepareError(f"{opts.out} already exists; choose another --out or pass --overwrite to replace it")
    for path in opts.inputs:
        check_input(path)
    with ray_for_preparation(ray_address, opts.workers) as workers, _data_context():
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        work = opts.out.parent / f".{opts.out.name}.work"
        shutil.rmtree(work, ignore_errors=True)  # a killed run's
        try:
            for sub in ("clean", "heldout", "chunks-clean"):
                (work / sub).mkdir(parents=True)
            manifest = _prepare(opts, work, workers)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("wrote %d chunks in %d shards to %s in %.1f s on Ray Data (%d workers)", manifest["num_documents"],
             manifest["num_shards"], opts.out, time.time() - started, workers)
    return manifest


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
    stats = _Stats()
    clock = _StageClock()
    partitions = max(1, math.ceil(input_bytes(opts.inputs, GZIP_EXPANSION) / opts.partition_bytes))
    tasks = read_tasks(opts.inputs)
    log.info("reading, checking and partitioning %d input task(s) into %d partition(s), %d workers", len(tasks),
             partitions, workers)
    (_items([{"task": i} for i in range(len(tasks))])
     .map_batches(_raw_blocks, batch_size=1, batch_format="pyarrow", compute=_tasks(workers, len(tasks)),
                  fn_kwargs={"tasks": tasks})
     .map_batches(_checked_documents, batch_size=None, batch_format="pyarrow", compute=_tasks(workers, workers),
                  fn_kwargs={"opts": opts, "partitions": partitions})
     .write_parquet(str(work / "documents"), partition_cols=["bucket"]))
    ok_languages = _check_rejected(opts, work, stats)
    clock.lap("read_and_check")

    log.info("de-duplicating the documents of %d partition(s)", partitions)
    per_language = Counter()
    if not ok_languages:
        raise PrepareError(f"no usable documents in {', '.join(map(str, opts.inputs))}")
    share = TokenizerSample.per_language_share(opts.tokenizer_sample_lines, len(ok_languages))
    sample = TokenizerSample(share, opts.seed)
    clean_bytes = 0
    for row in _run([{"bucket": b} for b in range(partitions)], _deduplicate_documents, workers=workers,
                    work=str(work), opts=opts, share=share):
        stats.counts["documents_duplicate"] += row["duplicates"]
        per_language.update(json.loads(row["languages"]))
        clean_bytes += row["text_bytes"]
        sample.merge(pickle.loads(row["sample"]))
    if not per_language:
        raise PrepareError(f"--heldout-permille {opts.heldout_permille} held out every group: nothing left to train on")
    languages = sorted(per_language)
    log.info("%d documents in %d languages after checks and de-duplication", sum(per_language.values()),
             len(languages))
    clock.lap("deduplicate_documents")
    if opts.tokenizer_dir is not None:
        tokenizer, sample_summary = load_tokenizer(opts, languages), None
    else:
        tokenizer, sample_summary = train_tokenizer(sample, languages, opts), sample.summary()
    del sample
    clock.lap("tokenizer")

    chunk_partitions = max(1, math.ceil(2 * clean_bytes / opts.partition_bytes))
    log.info("tokenizing and chunking into %d partition(s)", chunk_partitions)
    row_groups = [{"file": str(f), "row_group": g} for f in sorted((work / "clean").glob("*.parquet"))
                  for g in range(pq.ParquetFile(f).num_row_groups)]
    (_items(row_groups)
     .map_batches(_chunked_documents, batch_size=1, batch_format="pyarrow", compute=_tasks(workers, len(row_groups)),
                  fn_kwargs={"tokenizer_bytes": tokenizer.model_bytes, "languages": tokenizer.languages,
                             "opts": opts, "partitions": chunk_partitions})
     .write_parquet(str(work / "chunks"), partition_cols=["bucket"]))
    counts = pq.read_table(work / "chunks" / f"bucket={NOT_A_DOCUMENT}", columns=["paragraphs_cut", "too_short"])
    stats.counts["paragraphs_cut"] += int(pc.sum(counts.column("paragraphs_cut")).as_py() or 0)
    stats.counts["documents_too_short"] += int(pc.sum(counts.column("too_short")).as_py() or 0)
    clock.lap("tokenize_and_chunk")

    log.info("de-duplicating the chunks of %d partition(s)", chunk_partitions)
    total = chunk_bytes = 0
    for row in _run([{"bucket": b} for b in range(chunk_partitions)], _deduplicate_chunks, workers=workers,
                    work=str(work)):
        stats.counts["chunks_duplicate"] += row["duplicates"]
        total += row["chunks"]
        chunk_bytes += row["bytes"]
    if not total:
        raise PrepareError("every chunk was a duplicate or empty; nothing to write")
    clock.lap("deduplicate_chunks")
    num_shards = opts.num_shards or max(1, math.ceil(total / opts.docs_per_shard))
    shard_groups = max(1, min(num_shards, math.ceil(chunk_bytes / opts.partition_bytes)))
    per_shard = np.zeros(num_shards, dtype=np.int64)
    for row in _run([{"bucket": b} for b in range(chunk_partitions)], _route_to_shards, workers=workers,
                    work=str(work), seed=opts.seed, num_shards=num_shards, shard_groups=shard_groups):
        per_shard += np.frombuffer(row["counts"], dtype=np.int64)
    numbering, next_id = {}, 0
    for shard in np.flatnonzero(per_shard):  # a shard no group hashed to is left out, the others renumbered
        numbering[int(shard)] = (len(numbering), next_id)
        next_id += int(per_shard[shard])
    clock.lap("route_to_shards")

    log.info("writing %d shards", len(numbering))
    heldout = _heldout_documents(work)
    with atomic_directory(opts.out, overwrite=opts.overwrite) as tmp:
        (tmp / "shards").mkdir()
        tokenizer.save(tmp)
        written = list(_run([{"q": q} for q in range(shard_groups)], _write_shards, workers=workers,
                       work=str(work), corpus=str(tmp), numbering=numbering))
        infos = sorted((json.loads(r["info"]) for r in written), key=lambda i: i["shard"])
        clock.lap("write_shards")
        lang_counts = Counter()
        for r in written:
            lang_counts.update(json.loads(r["languages"]))
        manifest = corpus_manifest(
            opts, tokenizer, infos, sum(r["groups"] for r in written), lang_counts, sum(r["tokens"] for r in written),
            sum(r["aligned"] for r in written), stats, sample_summary,
            {"name": "ray", "shard_assignment": "hash", "workers": workers, "document_partitions": partitions,
             "chunk_partitions": chunk_partitions, "shard_groups": shard_groups, "stage_seconds": clock.seconds})
        if heldout:
            manifest["heldout"] = write_heldout(tmp / HELDOUT_DIR, heldout, opts, manifest["num_groups"])
        atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


def _check_rejected(opts: PrepareOptions, work: Path, stats: _Stats) -> set[str]:
    """Count the documents read and the rejected ones; stop at the first unreadable input, and (unless bad ones are
    to be skipped) at the first bad document in input order, as the single-process engine does. Returns the
    languages of the documents kept (one read of the status and language columns serves both)."""
    table = pa.concat_tables(pq.read_table(f, columns=["status", "lang"]) for f in
                             (work / "documents").glob("bucket=*/*.parquet"))
    stats.counts["documents_read"] += int(table.num_rows - pc.sum(
        pc.equal(table.column("status"), "fatal")).as_py() or 0)
    languages = set(pc.unique(table.filter(pc.equal(table.column("status"), "ok")).column("lang")).to_pylist())
    rejected_files = _partition_files(work / "documents", NOT_A_DOCUMENT)
    if not rejected_files:
        return languages
    rejected = pa.concat_tables(pq.read_table(f, columns=["status", "order", "error"]) for f in rejected_files)
    rejected = rejected.sort_by([("order", "ascending")]).to_pylist()
    for row in rejected:
        if row["status"] == "fatal":
            raise PrepareError(row["error"])
    for row in rejected:
        if row["status"] == "language":
            stats.counts["documents_skipped_language"] += 1
        elif row["status"] == "bad":
            if opts.on_bad_document == "error":
                raise PrepareError(f"{row['error']} (or pass --skip-bad-documents to drop such documents)")
            stats.counts["documents_skipped_bad"] += 1
            if len(stats.skipped) < 100:
                stats.skipped.append(row["error"])
            log.warning("skipping: %s", row["error"])
    return languages


def _heldout_documents(work: Path) -> list[RawDocument]:
    files = sorted((work / "heldout").glob("*.parquet"))
    if not files:
        return []
    table = pa.concat_tables(pq.read_table(f) for f in files).sort_by([("order", "ascending")])
    return [_raw_document(row) for row in table.to_pylist()]

