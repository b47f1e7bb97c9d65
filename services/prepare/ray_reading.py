"""The Ray Data engine's first steps and what its steps share: the block and partition sizes, the schemas of
what tasks stage, a Ray instance for the preparation, and reading the input (split by byte range) and checking each
document (`Rejected` reports). The pipeline that runs them is `services.prepare.ray_engine`."""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from marge.contracts.documents import (
    PrepareError,
    check_input,
    folder_files,
    input_order,
    jsonl_lines,
    parse_jsonl_line,
    read_folder_file,
)
from services.prepare.core import check_document, normalized_hash
from services.prepare.options import PrepareOptions

LINES_PER_BLOCK = 1000
"""Raw lines (or files) per block the reader hands the checkers, and documents per block the chunkers take: a block
is what one task holds (and at most BLOCK_BYTES of raw input)."""
BLOCK_BYTES = 2 << 20
FILES_PER_READ_TASK = 512
READ_SPLIT_BYTES = 32 << 20
"""A plain (not gzip) JSONL file larger than this is read by several tasks, one per byte range of this size (a gzip
stream can only be read from its start: one task per .gz file)."""
SHUFFLE_MAP_BYTES = 64 << 20
"""Rows a shuffle's map task partitions at once, into one file on its node's local disk (Ray Data's disk-based hash
shuffle): Ray Data's default, 1 GiB, would hand one task the whole output of a small cluster's stage; much smaller
would make more files, each read in (partitions) small ranges."""
OBJECT_STORE_BYTES = 512 << 20
"""The object store of a local Ray started for a preparation: Ray Data streams through it and spills past it."""
GZIP_EXPANSION = 4
"""Assumed bytes of text per byte of a .gz input, to size the partitions before anything is read."""
SKIPPED_KEPT = 100
"""Bad lines whose errors the driver keeps, the first in input order (as many as the single-process engine keeps;
the manifest shows the first 20): the others are counted."""

RAW_SCHEMA = pa.schema([("order", pa.int64()), ("input", pa.int32()), ("line", pa.int64()), ("path", pa.string()),
                  ("lang_dir", pa.string()), ("raw", pa.large_binary()), ("fatal", pa.string())])
DOCUMENT_SCHEMA = pa.schema([("status", pa.string()), ("order", pa.int64()), ("source", pa.string()),
                       ("doc_id", pa.string()), ("group", pa.string()), ("lang", pa.string()),
                       ("text", pa.large_string()), ("paragraph_ids", pa.list_(pa.string())),
                       ("key", pa.binary()), ("report", pa.string())])
DOCUMENT_COLUMNS = ["order", "source", "doc_id", "group", "lang", "text", "paragraph_ids"]
"""What the de-duplicated documents keep (clean/, heldout/): a `RawDocument`."""
CHUNK_SCHEMA = pa.schema([("status", pa.string()), ("order", pa.int64()), ("chunk_index", pa.int32()),
                    ("num_chunks", pa.int32()), ("group", pa.string()), ("lang", pa.string()),
                    ("doc_key", pa.string()), ("tokens", pa.list_(pa.int32())), ("text", pa.large_string()),
                    ("source", pa.string()), ("paragraph_ids", pa.list_(pa.string())), ("key", pa.binary()),
                    ("paragraphs_cut", pa.int64()), ("too_short", pa.int64()), ("bucket", pa.int32())])
SHARD_COLUMNS = ["order", "chunk_index", "num_chunks", "group", "lang", "doc_key", "tokens", "text", "source",
                  "paragraph_ids"]
DEDUPLICATION_KEYS = ["lang", "key"]
"""The shuffle key of documents and chunks: duplicates (same language, same normalised text) meet in one task. A row
that carries a report or counts instead of a document has an empty language and a key of its own, so that these rows
spread over the partitions like the documents."""
NOT_A_DOCUMENT = -1
"""The `bucket` of rows that carry counts, not chunks."""

DOCUMENT_PARTITION_SCHEMA = pa.schema([("clean_file", pa.string()), ("row_groups", pa.int64()),
                                 ("heldout_file", pa.string()), ("duplicates", pa.int64()),
                                 ("languages", pa.string()), ("all_languages", pa.string()),
                                 ("text_bytes", pa.int64()), ("heldout_bytes", pa.int64()), ("report", pa.string())])
PAIR_SCHEMA = pa.schema([("src", pa.string()), ("tgt", pa.string()), ("group", pa.string()), ("seq", pa.int64()),
                   ("cells", pa.list_(pa.string()))])
"""A held-out translation pair (`heldout_pairs_by_direction`) as a worker stages it (heldout-pairs/): its direction,
its group and its place among the group partition's pairs of that direction, then its four cells."""
HELDOUT_PARTITION_SCHEMA = pa.schema([("file", pa.string()), ("groups", pa.int64()), ("documents", pa.int64())])
SAMPLE_FAN_IN = 16
"""Tokenizer samples one task merges into one (`_merge_tokenizer_samples`): the driver gets the last one alone."""
HELDOUT_READ_ROWS = 256
"""Rows read at a time from each staged file when the held-out files are merged (`_write_heldout`)."""
CHUNK_PARTITION_SCHEMA = pa.schema([("file", pa.string()), ("chunks", pa.int64()), ("duplicates", pa.int64()),
                              ("bytes", pa.int64()), ("paragraphs_cut", pa.int64()), ("too_short", pa.int64())])
SHARD_WRITTEN_SCHEMA = pa.schema([("info", pa.string()), ("languages", pa.string()), ("groups", pa.int64()),
                            ("tokens", pa.int64()), ("aligned", pa.int64())])


# --------------------------------------------------------------------------------------------------
# Ray
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def ray_for_preparation(address: str | None, workers: int | None) -> Iterator[int]:
    """Ray for the preparation (`marge.util.local_ray.ray_for_tasks`). Yields the tasks to run at once per stage."""
    from marge.util.local_ray import ray_for_tasks

    with ray_for_tasks(address, workers, OBJECT_STORE_BYTES) as tasks:
        yield tasks


@contextlib.contextmanager
def data_context() -> Iterator[None]:
    """For the block: blocks of about BLOCK_BYTES (Ray Data's default, 128 MiB, would hand one task a whole input
    file's lines); the hash shuffle (SHUFFLE_V2, whatever RAY_DATA_DEFAULT_SHUFFLE_STRATEGY says: under a sort-based
    strategy `repartition` ignores its keys, and duplicates would not meet), on disk unless RAY_DATA_ENABLE_DISK_SHUFFLE
    is 0 (in the object store, a shuffle would hold a piece per map task and partition: millions at 100M documents),
    its map tasks SHUFFLE_MAP_BYTES each; Ray Data's progress bars on a terminal, and elsewhere (a log file, a job's
    output) the stages' own log lines, not Ray Data's report of every operator every few seconds. The process's
    settings are put back after (a program that embeds the preparation may use Ray Data itself)."""
    from ray.data import DataContext
    from ray.data.context import ShuffleStrategy

    ctx = DataContext.get_current()
    data_logger = logging.getLogger("ray.data")
    saved = (ctx.target_max_block_size, ctx.enable_progress_bars, ctx.print_on_execution_start,
             ctx.shuffle_strategy, ctx.use_disk_based_hash_shuffle, ctx.shuffle_input_batch_bytes, data_logger.level)
    ctx.target_max_block_size = 2 * BLOCK_BYTES
    ctx.enable_progress_bars = sys.stderr.isatty() and os.environ.get("MARGE_PROGRESS", "1") != "0"
    ctx.print_on_execution_start = False
    ctx.shuffle_strategy = ShuffleStrategy.SHUFFLE_V2
    ctx.use_disk_based_hash_shuffle = os.environ.get("RAY_DATA_ENABLE_DISK_SHUFFLE", "1") != "0"
    ctx.shuffle_input_batch_bytes = SHUFFLE_MAP_BYTES
    if not ctx.enable_progress_bars:
        data_logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            # an input smaller than a block is one task's work, which Ray Data warns of at every stage
            warnings.filterwarnings("ignore", message="The maximum number of concurrent tasks", category=UserWarning)
            yield
    finally:
        (ctx.target_max_block_size, ctx.enable_progress_bars, ctx.print_on_execution_start, ctx.shuffle_strategy,
         ctx.use_disk_based_hash_shuffle, ctx.shuffle_input_batch_bytes) = saved[:6]
        data_logger.setLevel(saved[6])


def task_pool(workers: int, inputs: int):
    """At most `workers` tasks at once, and never more than there are inputs."""
    from ray.data import TaskPoolStrategy

    return TaskPoolStrategy(size=max(1, min(workers, inputs)))


# --------------------------------------------------------------------------------------------------
# Stage 1: read and check
# --------------------------------------------------------------------------------------------------


def run_tasks(rows: list[dict], fn, *, workers: int, **kwargs) -> Iterator[dict]:
    """Apply `fn` to each of `rows` (one call per row), `workers` at once; its small results, as they come."""
    yield from items_dataset(rows).map_batches(fn, batch_size=1, batch_format="pyarrow", compute=task_pool(workers, len(rows)),
                                        fn_kwargs=kwargs).iter_rows()


def shuffled_tasks(dataset, keys: list[str], partitions: int, fn, *, workers: int, **kwargs) -> Iterator[dict]:
    """Hash-shuffle `dataset` by `keys` into `partitions` partitions and apply `fn` to each partition whole (a keyed
    repartition gives each partition as one block, which `batch_size=None` hands to `fn` as one batch: what
    `GroupedData.map_groups` relies on); `fn`'s small results, as they come."""
    yield from dataset.repartition(partitions, keys=keys).map_batches(
        fn, batch_size=None, batch_format="pyarrow", compute=task_pool(workers, partitions), fn_kwargs=kwargs).iter_rows()


def items_dataset(rows: list[dict]):
    import ray.data

    return ray.data.from_items(rows, override_num_blocks=max(1, len(rows)))


def read_tasks(inputs: list[Path], split_bytes: int = READ_SPLIT_BYTES) -> list[dict]:
    """One task per .gz file, one per byte range of `split_bytes` of a plain JSONL file, one per FILES_PER_READ_TASK
    files of a folder, in input order. A byte range's first line number is not known here: `number_lines` adds it."""
    tasks: list[dict] = []
    for index, path in enumerate(inputs):
        if check_input(path) == "folder":
            files = [(str(lang_dir), str(file)) for lang_dir, file in folder_files(path)]
            for start in range(0, len(files), FILES_PER_READ_TASK):
                tasks.append({"kind": "folder", "input": index, "start": start,
                              "files": files[start:start + FILES_PER_READ_TASK]})
        elif path.suffix != ".gz" and path.is_file() and path.stat().st_size > split_bytes:
            size = path.stat().st_size
            tasks.extend({"kind": "jsonl", "input": index, "path": str(path),
                          "byte_range": (start, min(start + split_bytes, size))} for start in range(0, size, split_bytes))
        else:
            tasks.append({"kind": "jsonl", "input": index, "path": str(path)})
    return tasks


def line_starts(path: Path, start: int, end: int) -> int:
    """How many lines of `path` start in the byte range [start, end): the one at offset 0, and one after each newline
    at an offset in [start - 1, end - 1) (a newline at the file's last byte starts none)."""
    count = 1 if start == 0 else 0
    with open(path, "rb") as f:
        f.seek(max(0, start - 1))
        left = end - 1 - max(0, start - 1)
        while left > 0:
            data = f.read(min(left, 1 << 20))
            if not data:
                break
            count += data.count(b"\n")
            left -= len(data)
    return count


def jsonl_range_lines(path: Path, start: int, end: int, first_line: int) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of the lines of a plain JSONL file that start in the byte range [start, end), the first
    numbered `first_line`: together, the ranges of a file give what `jsonl_lines` gives for the whole of it."""
    line_no = first_line - 1
    try:
        with open(path, "rb") as f:
            position = 0
            if start > 0:
                f.seek(start - 1)
                position = start - 1 + len(f.readline())  # the end of a line that starts before the range
            while position < end:
                raw = f.readline()
                if not raw:
                    break
                line_no += 1
                yield line_no, raw
                position += len(raw)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise PrepareError(f"{path}: file not found") from None
        raise PrepareError(f"{path}:{line_no + 1}: cannot be read after line {line_no} ({e}); is the file still "
                           "there and readable from every node?") from None


def _count_line_starts(batch: pa.Table, tasks: list[dict]) -> pa.Table:
    out = []
    for task_index in batch.column("task").to_pylist():
        task = tasks[task_index]
        try:
            lines = line_starts(Path(task["path"]), *task["byte_range"])
        except OSError:
            lines = 0  # the read task reports the file, naming the line
        out.append({"task": task_index, "lines": lines})
    return pa.Table.from_pylist(out)


def number_lines(tasks: list[dict], workers: int) -> None:
    """Give every byte-range task the number of its first line (`first_line`): the lines that start in the ranges
    before it, counted by one task per range (a pass over the file that looks for newlines only)."""
    ranged = [i for i, task in enumerate(tasks) if "byte_range" in task]
    if ranged:
        first_lines(tasks, {row["task"]: row["lines"] for row in run_tasks(
            [{"task": i} for i in ranged], _count_line_starts, workers=workers, tasks=tasks)})


def first_lines(tasks: list[dict], lines_per_task: dict[int, int]) -> None:
    """Number the first line of each byte-range task from the lines that start in each range (`line_starts`)."""
    next_line: dict[int, int] = {}
    for i, task in enumerate(tasks):  # a file's ranges are in file order
        if "byte_range" in task:
            task["first_line"] = next_line.get(task["input"], 1)
            next_line[task["input"]] = task["first_line"] + lines_per_task[i]


def raw_blocks(batch: pa.Table, tasks: list[dict]) -> Iterator[pa.Table]:
    """The raw lines (or files) of the read tasks in `batch`, LINES_PER_BLOCK at a time."""
    rows: list[dict] = []
    size = 0
    for task_index in batch.column("task").to_pylist():
        task = tasks[task_index]
        try:
            if task["kind"] == "jsonl":
                path = Path(task["path"])
                lines = (jsonl_range_lines(path, task["byte_range"][0], task["byte_range"][1], task["first_line"])
                         if "byte_range" in task else jsonl_lines(path))
                items = ((line_no, task["path"], None, raw) for line_no, raw in lines)
            else:
                items = ((position, file, lang_dir, Path(file).read_bytes())
                         for position, (lang_dir, file) in enumerate(task["files"], start=task["start"]))
            for position, path, lang_dir, raw in items:
                rows.append({"order": input_order(task["input"], position), "input": task["input"],
                             "line": position, "path": path, "lang_dir": lang_dir, "raw": raw})
                size += len(raw)
                if len(rows) >= LINES_PER_BLOCK or size >= BLOCK_BYTES:
                    yield pa.Table.from_pylist(rows, schema=RAW_SCHEMA)
                    rows, size = [], 0
        except (PrepareError, OSError) as e:
            rows.append({"order": input_order(task["input"], 0), "input": task["input"], "line": 0,
                         "path": task.get("path", ""), "fatal": str(e)})
    if rows:
        yield pa.Table.from_pylist(rows, schema=RAW_SCHEMA)


@dataclass
class Rejected:
    """What a stretch of the input held besides documents, in a size that does not grow with it: the lines read, and
    of them those filtered out by language and the bad ones, counted; the first unreadable input and the first
    SKIPPED_KEPT bad lines, in input order, with their errors. Merging the reports of parts gives the report of the
    whole (the first SKIPPED_KEPT of the whole are among the first SKIPPED_KEPT of its parts)."""

    read: int = 0
    skipped_language: int = 0
    skipped_bad: int = 0
    first_fatal: tuple[int, str] | None = None
    first_bad: list[tuple[int, str]] = field(default_factory=list)

    def add_fatal(self, order: int, error: str) -> None:
        if self.first_fatal is None or (order, error) < self.first_fatal:
            self.first_fatal = (order, error)

    def add_bad(self, order: int, error: str) -> None:
        self.skipped_bad += 1
        self.first_bad.append((order, error))
        if len(self.first_bad) >= 2 * SKIPPED_KEPT:
            self.first_bad = heapq.nsmallest(SKIPPED_KEPT, self.first_bad)

    def merge(self, other: Rejected) -> None:
        self.read += other.read
        self.skipped_language += other.skipped_language
        self.skipped_bad += other.skipped_bad
        if other.first_fatal is not None:
            self.add_fatal(*other.first_fatal)
        self.first_bad = heapq.nsmallest(SKIPPED_KEPT, [*self.first_bad, *other.first_bad])

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "first_bad": heapq.nsmallest(SKIPPED_KEPT, self.first_bad)})

    @classmethod
    def from_json(cls, text: str) -> Rejected:
        d = json.loads(text)
        return cls(d["read"], d["skipped_language"], d["skipped_bad"],
                   tuple(d["first_fatal"]) if d["first_fatal"] else None, [tuple(b) for b in d["first_bad"]])


def spread_key(*what: object) -> bytes:
    """A shuffle key for a row that carries a report or counts: a hash of where it comes from."""
    return hashlib.sha1(repr(what).encode()).digest()


def checked_documents(batch: pa.Table, opts: PrepareOptions) -> pa.Table:
    """Parse and check a block of raw lines (files): the documents with their de-duplication key, and one row that
    reports the block's bad, filtered-out and unreadable lines (`Rejected`)."""
    out: list[dict] = []
    rejected = Rejected()
    for row in batch.to_pylist():
        if row["fatal"] is not None:
            rejected.add_fatal(row["order"], row["fatal"])
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
            rejected.read += 1
            rejected.add_bad(row["order"], str(e))
            continue
        rejected.read += 1
        if opts.languages is not None and doc.lang not in opts.languages:
            rejected.skipped_language += 1
            continue
        out.append({"status": "ok", "order": doc.order, "source": doc.source, "doc_id": doc.doc_id,
                    "group": doc.group, "lang": doc.lang, "text": doc.text,
                    "paragraph_ids": list(doc.paragraph_ids) if doc.paragraph_ids is not None else None,
                    "key": normalized_hash(doc.text)})
    first = batch.column("order")[0].as_py() if batch.num_rows else 0
    out.append({"status": "report", "order": first, "lang": "", "key": spread_key("report", first),
                "report": rejected.to_json()})
    return pa.Table.from_pylist(out, schema=DOCUMENT_SCHEMA)


# --------------------------------------------------------------------------------------------------
# Stage 2: de-duplicate the documents, sample the tokenizer's lines
