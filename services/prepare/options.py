"""`PrepareOptions`: what `marge prepare` is asked to do, validated, for either engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from marge.contracts.documents import PrepareError
from marge.contracts.languages import normalize_language
from marge.contracts.tokenizer import DEFAULT_VOCAB_SIZE

DOCUMENT_UNITS = ("chunk", "paragraph")
ENGINES = ("auto", "local", "ray")


@dataclass
class PrepareOptions:
    inputs: list[Path]
    out: Path
    tokenizer_dir: Path | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE
    max_chunk_tokens: int = 512
    document_unit: str = "chunk"
    """'chunk': whole paragraphs packed into documents of up to `max_chunk_tokens` (the paper's 512-token chunks).
    'paragraph': every paragraph is a document of its own, cut at `max_chunk_tokens` (short units whose
    translations are single documents; a deviation for small-scale runs)."""
    min_document_tokens: int = 1
    """Documents (chunks or paragraphs) with fewer text tokens are dropped and counted."""
    heldout_permille: int = 0
    """Groups per 1000 held out of training (chosen by a hash of the group: the same in every build) and written to
    `heldout/` for the health probes and retrieval P@1 of runs on this corpus; 0: none."""
    max_pairs_per_direction: int = 1000
    """Held-out translation pairs kept per language pair."""
    docs_per_shard: int = 512
    num_shards: int | None = None
    languages: tuple[str, ...] | None = None
    lid: bool = True
    lid_threshold: float = 0.5
    lid_min_chars: int = 20
    max_document_chars: int = 1_000_000
    on_bad_document: str = "error"
    seed: int = 0
    overwrite: bool = False
    tokenizer_sample_lines: int = 2_000_000
    """Lines the tokenizer is trained on, at most: an equal share per language, each share drawn at random (a hash of
    the seed and the line's place), so a language with more text than its share gets a uniform sample of it and not
    its first lines; a language with less gives all its lines. Lines are fed in corpus order."""
    engine: str = "auto"
    """'local': this process, the corpus in memory (small inputs); 'ray': streamed through Ray Data on the Ray
    cluster, memory bounded by the partition size, not the corpus; 'auto': 'ray' above `local_max_bytes` of input."""
    workers: int | None = None
    """Ray Data tasks per stage ('ray'); None: the CPUs of the Ray cluster."""
    local_max_bytes: int = 256 << 20
    """'auto' prepares input up to this many bytes on disk in this process, larger input on Ray Data."""
    partition_bytes: int = 32 << 20
    """'ray': bytes of documents per hash partition (the de-duplication and shard-writing units): what one task holds."""

    def __post_init__(self) -> None:
        self.inputs = [Path(p) for p in self.inputs]
        self.out = Path(self.out)
        if not self.inputs:
            raise PrepareError("no input given: pass JSONL files or language folders to `marge prepare`")
        if self.max_chunk_tokens < 3:
            raise PrepareError(f"--max-chunk-tokens must be at least 3 (BOS, a token, EOS), got {self.max_chunk_tokens}")
        if self.document_unit not in DOCUMENT_UNITS:
            raise PrepareError(f"--document-unit must be one of {list(DOCUMENT_UNITS)}, got {self.document_unit!r}")
        if not 0 <= self.heldout_permille < 1000:
            raise PrepareError(f"--heldout-permille must be in [0, 1000), got {self.heldout_permille}")
        if self.min_document_tokens < 1:
            raise PrepareError(f"--min-document-tokens must be at least 1, got {self.min_document_tokens}")
        if self.docs_per_shard < 1:
            raise PrepareError(f"--docs-per-shard must be positive, got {self.docs_per_shard}")
        if self.num_shards is not None and self.num_shards < 1:
            raise PrepareError(f"--num-shards must be positive, got {self.num_shards}")
        if self.on_bad_document not in ("error", "skip"):
            raise PrepareError(f"on_bad_document must be 'error' or 'skip', got {self.on_bad_document!r}")
        if self.engine not in ENGINES:
            raise PrepareError(f"--engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.workers is not None and self.workers < 1:
            raise PrepareError(f"--workers must be positive, got {self.workers}")
        if self.tokenizer_sample_lines < 1:
            raise PrepareError(f"--tokenizer-sample-lines must be positive, got {self.tokenizer_sample_lines}")
        if self.partition_bytes < 1 << 20:
            raise PrepareError(f"partition_bytes must be at least 1 MiB, got {self.partition_bytes}")
        if self.languages is not None:
            self.languages = tuple(normalize_language(lang) for lang in self.languages)


