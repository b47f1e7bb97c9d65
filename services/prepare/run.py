"""`marge prepare`: raw multilingual documents -> a validated, sharded Parquet corpus (see marge.contracts.corpus).

Steps (paper §3 "Data Pre-processing" and §2.4 "Data Sharding"):
  1. read documents: JSONL files (one object per line with "text" and "language"; optional "id",
     "group", "title", "paragraph_ids": one id per paragraph of "text", shared by a paragraph's translations
     in the other documents of its group) or folders laid out as <root>/<lang>/**/*.{html,htm,txt} (the language is the
     first folder name; a page's path below it is its group, so the same page in every language
     lands in one shard);
  2. check each document: valid UTF-8, not empty, not oversized, an ISO 639-1 language that offline
     language identification (fastText LID-176) does not contradict;
  3. drop exact duplicates (same language, same normalised text);
  4. train the tokenizer on the corpus (or load a given one);
  5. cut documents into chunks of at most `max_chunk_tokens` tokens along paragraph boundaries (or, with
     `document_unit="paragraph"`, make every paragraph a document of its own: dropped under
     `min_document_tokens`, cut at `max_chunk_tokens`), and drop duplicate chunks;
  6. assign groups to shards: all chunks of a group share a shard, groups are spread at random
     (seeded) over shards of about `docs_per_shard` chunks; with `heldout_permille`, a fixed share of the groups
     (chosen by a hash of the group) is held out of training instead and written as the run's probes
     (`heldout/documents.jsonl.gz` and, across languages, `heldout/pairs.tsv` with each pair's group);
  7. write shards, tokenizer and manifest into a temporary folder and rename it into place.

A bad document stops the run with an error naming the file, line and field (or, with
`on_bad_document="skip"`, is dropped, logged and counted in the manifest). Nothing half-written is
left behind either way.
"""

from __future__ import annotations

import logging

from marge.contracts.documents import PrepareError, check_input
from services.prepare.core import input_bytes
from services.prepare.local import prepare_locally
from services.prepare.options import PrepareOptions

log = logging.getLogger(__name__)


def chosen_engine(opts: PrepareOptions) -> str:
    """'local' or 'ray': the engine `opts.engine` names, 'auto' by the size of the input."""
    if opts.engine != "auto":
        return opts.engine
    size = input_bytes(opts.inputs)
    engine = "ray" if size > opts.local_max_bytes else "local"
    log.info("%s of input: preparing it %s (engine=auto, local up to %s)", _mib(size),
             "on Ray Data" if engine == "ray" else "in this process", _mib(opts.local_max_bytes))
    return engine


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def prepare(opts: PrepareOptions, ray_address: str | None = None) -> dict:
    """Run the whole preparation on the engine `opts.engine` chooses; returns the manifest that was written.
    `ray_address`: the Ray cluster of the 'ray' engine (None: the one this process is connected to, RAY_ADDRESS, or a
    local Ray started for it)."""
    if opts.out.exists() and not opts.overwrite:
        raise PrepareError(f"{opts.out} already exists; choose another --out or pass --overwrite to replace it")
    for path in opts.inputs:
        check_input(path)
    if chosen_engine(opts) == "ray":
        from services.prepare.ray_engine import prepare_on_ray

        return prepare_on_ray(opts, ray_address)
    return prepare_locally(opts)


