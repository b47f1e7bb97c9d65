"""What both preparation engines do to a document, written once: check it, cut it into chunks, sample the
tokenizer's lines and train it, assign groups to shards, write shards, the held-out split and the manifest."""

from __future__ import annotations

import gzip
import hashlib
import heapq
import json
import logging
import math
import time
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from marge import __version__
from marge.contracts.artifacts import publish_dir, write_manifest
from marge.contracts.batch import max_text_tokens
from marge.contracts.corpus import CORPUS_FORMAT, CORPUS_SCHEMA_VERSION, split_paragraphs, write_shard
from marge.contracts.documents import PrepareError, RawDocument, check_input, folder_files
from marge.contracts.languages import normalize_language
from marge.contracts.tokenizer import MargeTokenizer
from services.prepare.langid import identify
from services.prepare.options import PrepareOptions

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Checking, de-duplication, chunking, sharding
# --------------------------------------------------------------------------------------------------


def normalized_hash(text: str) -> bytes:
    norm = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return hashlib.sha1(norm.encode("utf-8")).digest()


def check_document(doc: RawDocument, opts: PrepareOptions) -> RawDocument:
    """The document with its language normalised, or PrepareError saying what is wrong."""
    try:
        lang = normalize_language(doc.lang)
    except ValueError as e:
        raise PrepareError(f"{doc.source}: field 'language': {e}") from None
    if not doc.text.strip():
        raise PrepareError(f"{doc.source}: field 'text' is empty; remove the document or give it text")
    for name, value in (("text", doc.text), ("id", doc.doc_id), ("group", doc.group)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PrepareError(f"{doc.source}: field {name!r} has a lone surrogate ({value[e.start]!r}) at character "
                               f"{e.start}, which is not text (a JSON escape like \\ud800 without its pair); fix "
                               "the producer of the file, or pass --skip-bad-documents") from None
    if len(doc.text) > opts.max_document_chars:
        raise PrepareError(f"{doc.source}: document has {len(doc.text):,} characters, more than --max-document-chars "
                           f"{opts.max_document_chars:,}; split it into smaller documents or raise the limit")
    if opts.lid and len(doc.text.strip()) >= opts.lid_min_chars:
        guess = identify(doc.text[:4000])
        if guess.lang != lang and guess.score >= opts.lid_threshold:
            raise PrepareError(f"{doc.source}: field 'language' says {lang!r} but language identification says "
                               f"{guess.lang!r} (confidence {guess.score:.2f}); fix the label, raise --lid-threshold, "
                               "or pass --no-lid to trust the labels")
    return RawDocument(doc.source, doc.doc_id, doc.group, lang, doc.text, doc.paragraph_ids, doc.order)


@dataclass
class Piece:
    """One document made from a raw document: its tokens, text and the ids of the paragraphs it holds."""

    tokens: list[int]
    text: str
    paragraph_ids: list[str]


def chunk_paragraphs(paragraphs: list[str], paragraph_tokens: list[list[int]], max_chunk_tokens: int,
                     tokenizer: MargeTokenizer, paragraph_ids: tuple[str, ...] | None = None) -> list[Piece]:
    """Greedily pack whole paragraphs into chunks of <= max_chunk_tokens - 2 tokens (BOS and EOS are
    added later); a paragraph longer than that is cut at token boundaries (each piece keeps its id)."""
    budget = max_text_tokens(max_chunk_tokens)
    ids = paragraph_ids or ("",) * len(paragraphs)
    chunks: list[Piece] = []
    current = Piece([], "", [])
    texts: list[str] = []

    def flush() -> None:
        nonlocal current
        if current.tokens:
            current.text = "\n\n".join(texts)
            chunks.append(current)
            current = Piece([], "", [])
            texts.clear()

    for text, toks, pid in zip(paragraphs, paragraph_tokens, ids):
        if not toks:
            continue
        if len(toks) > budget:
            flush()
            for start in range(0, len(toks), budget):
                piece = toks[start:start + budget]
                chunks.append(Piece(piece, tokenizer.decode(piece), [pid] if pid else []))
            continue
        if len(current.tokens) + len(toks) > budget:
            flush()
        current.tokens.extend(toks)
        if pid:
            current.paragraph_ids.append(pid)
        texts.append(text)
    flush()
    return chunks


def paragraph_documents(paragraphs: list[str], paragraph_tokens: list[list[int]], max_chunk_tokens: int,
                        tokenizer: MargeTokenizer, paragraph_ids: tuple[str, ...] | None = None) -> list[Piece]:
    """Every paragraph a document of its own, cut to max_chunk_tokens - 2 tokens (the text follows the cut)."""
    budget = max_text_tokens(max_chunk_tokens)
    ids = paragraph_ids or ("",) * len(paragraphs)
    out = []
    for text, toks, pid in zip(paragraphs, paragraph_tokens, ids):
        if not toks:
            continue
        if len(toks) > budget:
            toks = toks[:budget]
            text = tokenizer.decode(toks)
        out.append(Piece(list(toks), text, [pid] if pid else []))
    return out


def document_pieces(doc: RawDocument, tokenizer: MargeTokenizer, opts: PrepareOptions) -> tuple[list[Piece], int]:
    """The documents `doc` becomes (chunks, or paragraphs with `document_unit="paragraph"`), and how many of its
    paragraphs were cut at `max_chunk_tokens` (paragraph unit only)."""
    paragraphs = split_paragraphs(doc.text)
    paragraph_tokens = tokenizer.encode_batch(paragraphs)
    if opts.document_unit == "paragraph":
        budget = max_text_tokens(opts.max_chunk_tokens)
        cut = sum(len(t) > budget for t in paragraph_tokens)
        return paragraph_documents(paragraphs, paragraph_tokens, opts.max_chunk_tokens, tokenizer,
                                   doc.paragraph_ids), cut
    return chunk_paragraphs(paragraphs, paragraph_tokens, opts.max_chunk_tokens, tokenizer, doc.paragraph_ids), 0


class TokenizerSample:
    """The tokenizer's training lines: per language, the `per_language` lines with the smallest hash of (seed, the
    document's input order, the line's place in it). A uniform sample whatever order the input is in, and the same
    however the documents are split between workers: merging the samples of parts gives the sample of the whole."""

    def __init__(self, per_language: int, seed: int):
        self.per_language, self.seed = per_language, seed
        self.heaps: dict[str, list[tuple[int, int, int, str]]] = defaultdict(list)  # (-hash, -order, -line, text)
        self.lines_seen: Counter = Counter()

    @staticmethod
    def per_language_share(total: int, languages: int) -> int:
        return max(1, math.ceil(total / max(1, languages)))

    def add(self, lang: str, order: int, text: str) -> None:
        for i, line in enumerate(line for line in text.split("\n") if line.strip()):
            digest = hashlib.sha1(f"marge-tokenizer-sample:{self.seed}:{order}:{i}".encode()).digest()
            self._push(lang, (-int.from_bytes(digest[:8], "big"), -order, -i, line))
            self.lines_seen[lang] += 1

    def _push(self, lang: str, item: tuple[int, int, int, str]) -> None:
        heap = self.heaps[lang]
        if len(heap) < self.per_language:
            heapq.heappush(heap, item)
        elif item > heap[0]:  # a smaller hash than the largest kept
            heapq.heapreplace(heap, item)

    def merge(self, other: "TokenizerSample") -> None:
        for lang, heap in other.heaps.items():
            for item in heap:
                self._push(lang, item)
        self.lines_seen.update(other.lines_seen)

    def lines(self) -> list[str]:
        """The sampled lines in corpus order (document input order, then line)."""
        items = sorted((-order, -i, line) for heap in self.heaps.values() for _, order, i, line in heap)
        return [line for _, _, line in items]

    def summary(self) -> dict:
        return {lang: {"lines": self.lines_seen[lang], "sampled": len(self.heaps[lang])} for lang in sorted(self.heaps)}


def train_tokenizer(sample: TokenizerSample, languages: list[str], opts: PrepareOptions) -> MargeTokenizer:
    lines = sample.lines()
    log.info("training the tokenizer on %d sampled lines (%s)", len(lines),
             ", ".join(f"{lang} {s['sampled']}/{s['lines']}" for lang, s in sample.summary().items()))
    # SentencePiece keeps the first `input_sentence_size` lines it is given: never fewer than the sample (the
    # default is kept when the sample is smaller, as the setting is recorded in the model file and so in its sha256)
    tokenizer = MargeTokenizer.train(lines, languages, opts.vocab_size,
                                     input_sentence_size=max(len(lines), MargeTokenizer.DEFAULT_INPUT_SENTENCES))
    if tokenizer.vocab_size < opts.vocab_size / 2:
        log.warning("the tokenizer has %d pieces, far below the %d asked for (--vocab-size): this corpus holds no "
                    "more distinct pieces. The model's embeddings follow the tokenizer, so nothing breaks; pass "
                    "--vocab-size %d (or less) to get what you ask for, or prepare more text",
                    tokenizer.vocab_size, opts.vocab_size, tokenizer.vocab_size)
    return tokenizer


def load_tokenizer(opts: PrepareOptions, languages: list[str]) -> MargeTokenizer:
    """The tokenizer given with --tokenizer, checked to have a language token for each of `languages`."""
    if opts.tokenizer_dir is None:  # callers come here only when --tokenizer is given
        raise PrepareError("no tokenizer to load: give --tokenizer DIR")
    tokenizer = MargeTokenizer.load(opts.tokenizer_dir)
    missing = sorted(set(languages) - set(tokenizer.languages))
    if missing:
        raise PrepareError(f"{opts.tokenizer_dir}: the tokenizer has no language token for {missing}; "
                           "train a new one (omit --tokenizer)")
    return tokenizer


def shard_columns(rows: list["Chunk"], shard: int, first_doc_id: int) -> dict[str, list]:
    """The columns of one shard file: its chunks sorted by (group, language, chunk index), ids from `first_doc_id`."""
    rows = sorted(rows, key=lambda c: (c.group, c.lang, c.chunk_index))
    return {
        "doc_id": list(range(first_doc_id, first_doc_id + len(rows))),
        "doc_key": [c.doc_key for c in rows], "shard": [shard] * len(rows), "group": [c.group for c in rows],
        "lang": [c.lang for c in rows], "chunk_index": [c.chunk_index for c in rows],
        "num_chunks": [c.num_chunks for c in rows], "text": [c.text for c in rows],
        "tokens": [list(c.tokens) for c in rows], "num_tokens": [len(c.tokens) for c in rows],
        "source": [c.source for c in rows], "paragraph_ids": [list(c.paragraph_ids) for c in rows],
    }


def write_corpus_shard(folder: Path, shard: int, columns: dict[str, list]) -> dict:
    """Write one shard into the corpus folder being built; returns its manifest entry."""
    info = write_shard(folder / "shards" / f"shard-{shard:05d}.parquet", columns)
    info.file = f"shards/shard-{shard:05d}.parquet"
    info.shard = shard
    return asdict(info)


def corpus_manifest(opts: PrepareOptions, tokenizer: MargeTokenizer, shard_infos: list[dict], num_groups: int,
                    languages: Counter, num_tokens: int, aligned: int, stats: "PrepareStats", sample: dict | None,
                    engine: dict) -> dict:
    return {
        "format": CORPUS_FORMAT, "schema_version": CORPUS_SCHEMA_VERSION, "marge_version": __version__,
        "created_unix": int(time.time()), "num_documents": sum(s["rows"] for s in shard_infos),
        "num_shards": len(shard_infos), "num_groups": num_groups, "num_tokens": int(num_tokens),
        "languages": dict(sorted(languages.items())), "max_chunk_tokens": opts.max_chunk_tokens,
        "document_unit": opts.document_unit, "aligned_documents": int(aligned),
        "tokenizer": {"files": ["tokenizer.model", "tokenizer.json"], "sha256": tokenizer.sha256,
                      "vocab_size": tokenizer.vocab_size, **({"sample": sample} if sample is not None else {})},
        "inputs": [str(p) for p in opts.inputs],
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()
                    if k not in ("inputs", "out", "overwrite")},
        "engine": engine,
        "stats": {k: v for k, v in sorted(stats.counts.items()) if v}, "skipped_examples": stats.skipped[:20],
        "shards": shard_infos,
    }


def publish_corpus(opts: PrepareOptions, tokenizer: MargeTokenizer,
                   heldout: list[RawDocument] | Callable[[Path, int], dict | None],
                   write_shards: Callable[[Path], dict]) -> dict:
    """Write the corpus folder `opts.out` the way every artifact is written (`marge.contracts.artifacts`): in a temporary
    folder renamed into place, the tokenizer, the shards `write_shards(folder)` writes under `shards/` (it returns
    the manifest, `corpus_manifest`), the held-out split, and the manifest last. Returns the manifest. `heldout` is
    the held-out documents, or what writes them (`heldout(folder, training groups)`, returning the manifest's
    `heldout` or None when there are none: the Ray engine's workers write them)."""
    with publish_dir(opts.out, overwrite=opts.overwrite) as tmp:
        (tmp / "shards").mkdir()
        tokenizer.save(tmp)
        manifest = write_shards(tmp)
        if callable(heldout):
            written = heldout(tmp / HELDOUT_DIR, manifest["num_groups"])
            if written is not None:
                manifest["heldout"] = written
        elif heldout:
            manifest["heldout"] = write_heldout(tmp / HELDOUT_DIR, heldout, opts, manifest["num_groups"])
        write_manifest(tmp, manifest, ascii=False)
    return manifest


def assign_shards(group_sizes: dict[str, int], num_shards: int, seed: int) -> dict[str, int]:
    """Groups in random (seeded) order, each to the currently smallest shard: related documents stay
    together, unrelated ones are spread at random, shards stay about the same size."""
    groups = sorted(group_sizes)
    np.random.default_rng(seed).shuffle(groups)
    heap = [(0, s) for s in range(num_shards)]
    out = {}
    for g in groups:
        size, s = heapq.heappop(heap)
        out[g] = s
        heapq.heappush(heap, (size + group_sizes[g], s))
    return out


@dataclass
class Chunk:
    group: str
    lang: str
    doc_key: str
    chunk_index: int
    num_chunks: int
    tokens: list[int]
    text: str
    source: str
    paragraph_ids: list[str]


@dataclass
class PrepareStats:
    counts: Counter = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)


HELDOUT_DIR = "heldout"


def is_heldout_group(group: str, permille: int) -> bool:
    """Whether a group is held out: a hash of its name, so the same groups in every build of the same input."""
    return bool(permille) and int.from_bytes(hashlib.sha1(f"marge-heldout:{group}".encode()).digest()[:8], "big") % 1000 < permille


def heldout_pairs(docs: list[RawDocument], max_per_direction: int) -> list[tuple[str, tuple[str, str, str, str]]]:
    """Translation pairs of the held-out groups in every language direction the groups cover (each unordered pair
    of languages once, the alphabetically first as the source; P@1 reads both ways), each with its group: aligned
    paragraphs where the input numbers them (paragraph_ids), else the groups' whole documents (cut at 1,000
    characters). At most `max_per_direction` pairs per pair of languages, groups in name order."""
    pairs = heldout_pairs_by_direction(docs, max_per_direction)
    return [grouped for key in sorted(pairs) for grouped in pairs[key]]


def heldout_pairs_by_direction(docs: list[RawDocument], max_per_direction: int
                               ) -> dict[tuple[str, str], list[tuple[str, tuple[str, str, str, str]]]]:
    """`heldout_pairs` by (source, target language), each pair with its group: the first `max_per_direction` pairs
    of each direction in (group name, place in the group) order. The pairs of a group depend on that group's
    documents alone, so the pairs of a set of whole groups split into parts are the first `max_per_direction` of each
    direction among the parts' own, merged in that order (how the Ray engine's workers write them)."""
    by_group: dict[str, dict[str, RawDocument]] = defaultdict(dict)
    for d in docs:
        by_group[d.group].setdefault(d.lang, d)
    pairs: dict[tuple[str, str], list[tuple[str, tuple[str, str, str, str]]]] = defaultdict(list)
    for group in sorted(by_group):
        versions = sorted(by_group[group].items())
        for i, (src_lang, source) in enumerate(versions):
            for tgt_lang, target in versions[i + 1:]:
                direction = pairs[(src_lang, tgt_lang)]
                if len(direction) >= max_per_direction:
                    continue
                if source.paragraph_ids and target.paragraph_ids:
                    theirs = dict(zip(target.paragraph_ids, split_paragraphs(target.text)))
                    for pid, text in zip(source.paragraph_ids, split_paragraphs(source.text)):
                        if pid in theirs and len(text.split()) >= 3 and text != theirs[pid]:
                            direction.append((group, (src_lang, text, tgt_lang, theirs[pid])))
                else:
                    direction.append((group, (src_lang, " ".join(source.text.split())[:1000], tgt_lang,
                                              " ".join(target.text.split())[:1000])))
    return {key: direction[:max_per_direction] for key, direction in pairs.items()}


def heldout_row(d: RawDocument) -> dict:
    """A held-out document as a line of `heldout/documents.jsonl.gz`."""
    return {"id": d.doc_id, "group": d.group, "language": d.lang, "text": d.text,
            **({"paragraph_ids": list(d.paragraph_ids)} if d.paragraph_ids else {})}


def pair_line(pair: tuple[str, str, str, str], group: str) -> str:
    """A translation pair as a line of `heldout/pairs.tsv`: its four cells, then its group (the page an interval
    resamples, `marge.eval.evaluation.pair_pages`), whitespace collapsed in each as a tab or newline would break
    the line."""
    return "\t".join(" ".join(cell.split()) for cell in (*pair, group)) + "\n"


MIN_HELDOUT_GROUPS = 30
"""Fewer held-out pages than this measure P@1 with a 95% interval wider than +-0.18 (at P@1 0.5): prepare warns."""


def write_heldout(folder: Path, docs: list[RawDocument], opts: PrepareOptions, train_groups: int) -> dict:
    """The held-out groups as a documents JSONL (the page probe's and the aligned probe's input) and their translation
    pairs as a pairs TSV (retrieval P@1); returns what the manifest records of them. Warns, saying what to pass,
    when the split is too small to measure (`MIN_HELDOUT_GROUPS`) or has no pairs across languages."""
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "documents.jsonl.gz", "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(heldout_row(d), ensure_ascii=False) + "\n")
    pairs = heldout_pairs(docs, opts.max_pairs_per_direction)
    if pairs:
        with open(folder / "pairs.tsv", "w", encoding="utf-8", newline="\n") as f:
            for group, pair in pairs:
                f.write(pair_line(pair, group))
    return heldout_manifest(opts, len({d.group for d in docs}), len(docs), len(pairs), train_groups)


def heldout_manifest(opts: PrepareOptions, groups: int, documents: int, pairs: int, train_groups: int) -> dict:
    """What the manifest records of the held-out split written under `heldout/` (`write_heldout`); warns as
    `heldout_advice` says."""
    advice = heldout_advice(groups, pairs, train_groups, opts.heldout_permille)
    if advice:
        log.warning("%s", advice)
    return {"groups": groups, "documents": documents, "pairs": pairs,
            "permille": opts.heldout_permille, "documents_file": f"{HELDOUT_DIR}/documents.jsonl.gz",
            "pairs_file": f"{HELDOUT_DIR}/pairs.tsv" if pairs else None}


def heldout_advice(groups: int, pairs: int, train_groups: int, permille: int) -> str | None:
    """Why the held-out split cannot measure retrieval (fewer than `MIN_HELDOUT_GROUPS` groups, or no pairs across
    languages) and what to pass instead, or None. The permille it advises is always above the one that gave too
    few groups (groups are held out by a hash of their name, so a permille can fall short of its expected share):
    the share that would hold `MIN_HELDOUT_GROUPS` out on average, or, where this one was already that large, the
    share this split's own rate says; a corpus too small for any permille is told so."""
    if groups >= MIN_HELDOUT_GROUPS and pairs:
        return None
    total = groups + train_groups
    head = (f"the held-out split has {groups} groups and {pairs} translation pairs: too few to measure retrieval P@1 "
            f"(over {MIN_HELDOUT_GROUPS} pages its 95% interval is wider than +-0.18)")
    if groups >= MIN_HELDOUT_GROUPS:  # enough groups: the pairs are missing, not the share
        return head + ", and no pairs across languages: documents need a shared `group`"
    if total < MIN_HELDOUT_GROUPS / 0.999:
        return (head + f"; the corpus has {total} groups in all, too few for any --heldout-permille: add documents, "
                "or point health.documents and data.heldout_pairs at held-out data of your own")
    expected = math.ceil(MIN_HELDOUT_GROUPS * 1000 / max(1, total))
    if permille < expected:
        wanted = expected
    else:  # the hash held out fewer than this share's expected count: scale by the rate it gave, at least +1
        wanted = max(permille + 1, math.ceil(permille * MIN_HELDOUT_GROUPS / groups) if groups else 1000)
    wanted = min(999, wanted)
    missing = "" if pairs else ", and no pairs across languages: documents need a shared `group`"
    return head + (f"{missing}; pass --heldout-permille {wanted} (about {math.ceil(wanted * total / 1000)} of the "
                   f"{total} groups)")


def input_bytes(inputs: list[Path], gzip_expansion: int = 1) -> int:
    """Bytes on disk of the inputs (files, and the files under folders), a .gz file's counted `gzip_expansion`
    times (an estimate of its text)."""
    total = 0
    for path in inputs:
        files = [p for _, p in folder_files(path)] if check_input(path) == "folder" else [path]
        total += sum(p.stat().st_size * (gzip_expansion if p.suffix == ".gz" else 1) for p in files)
    return total

