"""Which checkpoint a run resumes from: the driver's and the ranks' one rule.

Beside the checkpoints, `lineage/` records each trainer generation and the update it resumed from
(`start_generation`), before that generation writes anything. A checkpoint of update S written by generation G is
abandoned once a later generation resumed from an update before S: a group replaced while it wrote S, whose
successor went back to an older checkpoint. `resume_candidates` leaves abandoned checkpoints out, and the driver
(`newest_good_checkpoint`) and the ranks (services.trainer.state.resume) choose by it, with one retry rule for I/O
errors (`with_io_retries`). A checkpoint without a generation (written before generations were recorded) is
never abandoned. The checkpoint format itself is `marge.model.checkpoint`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from marge.contracts import artifacts
from marge.model.checkpoint import CheckpointError, checkpoint_order, complete_checkpoints, read_manifest
from marge.util.files import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)


IO_RETRY_DELAYS_S = (0.5, 2.0, 8.0)
"""Waits before reading a checkpoint again after an I/O error (a shared filesystem's hiccup): about 10 s in all
before the checkpoint counts as unusable and an older one is taken."""


def with_io_retries(read, what: str, delays_s: tuple[float, ...] = IO_RETRY_DELAYS_S):
    """`read()`, tried again after each of `delays_s` when it fails with an I/O error that may pass (not a missing
    file, not a checksum or format error: those are the checkpoint's own and are raised at once)."""
    for attempt, delay in enumerate((*delays_s, None)):
        try:
            return read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise
        except OSError as e:
            if delay is None:
                raise
            log.warning("%s failed (%s); trying again in %.1f s (%d of %d)", what, e, delay, attempt + 1,
                        len(delays_s))
            time.sleep(delay)


LINEAGE = "lineage"
"""Beside the checkpoints: one file per trainer generation, `generation-<number>.json`, holding the update it resumed
from. One file each, written once: two groups starting at once (a replaced one's rank 0 still starting) cannot
overwrite each other's record."""
LINEAGE_FORMAT = "marge-lineage"
LINEAGE_FILE = re.compile(r"generation-(\d+)\.json")


def read_lineage(root: Path, delays_s: tuple[float, ...] = IO_RETRY_DELAYS_S) -> list[tuple[int, int]]:
    """(generation, update resumed from) of every trainer generation recorded under `root`, in generation order;
    none when nothing is recorded (a run of a marge that recorded none, or one that never started a group)."""
    folder = Path(root) / LINEAGE

    def read() -> list[tuple[Path, str]]:
        if not folder.is_dir():
            return []
        found = []
        for path in sorted(folder.iterdir()):
            if LINEAGE_FILE.fullmatch(path.name):  # not an atomic write's temporary file
                try:
                    found.append((path, path.read_text(encoding="utf-8")))
                except FileNotFoundError:  # a number written again, replaced under the listing: read next time
                    continue
        return found

    lineage = []
    for path, text in with_io_retries(read, f"reading {folder}", delays_s):
        try:
            values = json.loads(text)
            if values.get("format") != LINEAGE_FORMAT:
                raise ValueError(f"format is {values.get('format')!r}, not {LINEAGE_FORMAT!r}")
            lineage.append((int(values["generation"]), int(values["resumed_from"])))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{path}: not a trainer generation's record ({e}). The records say which checkpoints "
                                  "a replaced trainer group abandoned: restore it from a copy, or move it aside (its "
                                  "group's successors may then resume from a checkpoint it abandoned)") from None
    return sorted(lineage)


def start_generation(root: Path, start: Callable[[], int], resumed_from: int) -> int:
    """A trainer generation starting from the checkpoint of update `resumed_from` (0: from scratch), recorded in
    `root`'s lineage (its own file, written atomically and synced) before it writes anything: its number, from
    `start` (the queue's `start_generation`, which fences every older one), raised past every generation the lineage
    holds (a queue that lost its data issues numbers again). Called by rank 0 of a starting group and by the driver
    of a (re)started run, before either cuts anything back to `resumed_from`. A feed without generations (`start`
    returns 0) is recorded as generation 0, which abandons nothing."""
    root = Path(root)
    newest = max((g for g, _ in read_lineage(root)), default=0)
    generation = start()
    if 0 < generation <= newest:
        log.warning("the queue issued trainer generation %d, but %s records generations up to %d (the queue lost "
                    "data): raising it past them", generation, root / LINEAGE, newest)
        while generation <= newest:
            again = start()
            if again <= generation:
                raise CheckpointError(f"{root / LINEAGE}: the queue's trainer generation does not rise ({generation} "
                                      f"then {again}); a group cannot be fenced from the ones recorded there")
            generation = again
    folder = root / LINEAGE
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        fsync_dir(root)  # the folder's own entry: its records are synced as they are written
    atomic_write_text(folder / f"generation-{generation:012d}.json", json.dumps(
        {"format": LINEAGE_FORMAT, "version": 1, "generation": generation, "resumed_from": int(resumed_from),
         "created_unix": time.time()}) + "\n")
    log.info("trainer generation %d starts from update %d", generation, resumed_from)
    return generation


def abandoned_by(step: int, generation: int | None, lineage: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
    """The first (generation, update resumed from) of `lineage` that abandoned the checkpoint of `step` written
    by `generation`: a later generation that resumed from an older update. None: the checkpoint is on the
    surviving lineage (or has no generation)."""
    if generation is None:
        return None
    return next(((g, r) for g, r in lineage if g > generation and r < step), None)


@dataclass(frozen=True)
class Candidate:
    """A checkpoint a run may resume from, as `resume_candidates` orders them."""

    step: int
    attempt: int
    """`step-<update>-<attempt>`: a later attempt at the same update comes first (0 for a folder named otherwise)."""
    preference: int
    """Of one update's folders, the higher first: `extra`'s, in the order given, before storage's."""
    path: Path
    generation: int | None

    @property
    def key(self) -> tuple[int, int, int]:
        """What every rank can name the candidate by, whatever path its copy has."""
        return self.step, self.attempt, self.preference


def resume_candidates(root: Path, extra: Iterable[Path | str | None] = (),
                      delays_s: tuple[float, ...] = IO_RETRY_DELAYS_S) -> list[Candidate]:
    """The checkpoints a run may resume from, newest first: the complete ones under `root` and `extra` (Ray Train's,
    the one the driver chose), each folder once, less those `root`'s lineage says a later generation abandoned
    and those whose manifest cannot be read (after `with_io_retries`); each left out is logged. Not verified."""
    root = Path(root)
    lineage = read_lineage(root, delays_s)
    given = [Path(p) for p in extra if p]
    paths: dict[Path, tuple[int, Path]] = {}
    for preference, path in [(len(given) - i, p) for i, p in enumerate(given)] + \
            [(0, p) for p in complete_checkpoints(root)]:
        paths.setdefault(path.resolve(), (preference, path))
    found = []
    for preference, path in paths.values():
        try:
            manifest = with_io_retries(lambda: read_manifest(path, verify=False), f"reading {path / artifacts.MANIFEST}",
                                       delays_s)
            step, generation = int(manifest["step"]), manifest.get("generation")
            generation = None if generation is None else int(generation)
        except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("skipping checkpoint %s: %s", path, e)
            continue
        by = abandoned_by(step, generation, lineage)
        if by is not None:
            log.warning("skipping checkpoint %s: trainer generation %d wrote it, and generation %d, which replaced it, "
                        "resumed from update %d (%s)", path, generation, by[0], by[1], root / LINEAGE)
            continue
        try:
            attempt = checkpoint_order(path)[1]
        except CheckpointError:  # a copy under another name (Ray's, from remote storage)
            attempt = 0
        found.append(Candidate(step, attempt, preference, path, generation))
    return sorted(found, key=lambda c: c.key, reverse=True)


def good_checkpoints(root: Path, extra: Iterable[Path | str | None] = (), parts: bool = True,
                     delays_s: tuple[float, ...] = IO_RETRY_DELAYS_S) -> Iterator[Candidate]:
    """`resume_candidates` that verify against their manifest (`read_manifest`; `parts`: every tensor hashed too),
    newest first, each read with `with_io_retries`; the rule the driver and the ranks both resume by. A candidate
    that fails is logged and the next older one tried."""
    for candidate in resume_candidates(root, extra, delays_s):
        try:
            with_io_retries(lambda: read_manifest(candidate.path, verify=True, parts=parts),
                            f"verifying checkpoint {candidate.path}", delays_s)
        except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("skipping checkpoint %s: %s", candidate.path, e)
            continue
        yield candidate


def newest_good_checkpoint(root: Path, delays_s: tuple[float, ...] = IO_RETRY_DELAYS_S) -> Path | None:
    """The newest checkpoint under `root` on the surviving lineage whose files match its manifest (every part
    hashed): `good_checkpoints`' first. Older ones are tried when the newest is abandoned, corrupt or incomplete
    (each one skipped is logged)."""
    return next((c.path for c in good_checkpoints(root, delays_s=delays_s)), None)
