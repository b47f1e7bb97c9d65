"""How every artifact another stage reads is published and trusted: one set of mechanics for snapshots, index
versions, checkpoints and prepared corpora, each of which keeps only its own schema (files and fields).

The contract (CONTRIBUTING.md, "Artifacts"):

* **A folder is built under a temporary name and renamed into place** (`publish_dir`, or `commit_staged` for a
  folder that several workers fill under a fixed staging name; both swap it in with `swap_into_place`, as
  `atomic_directory` does for a folder without a manifest), so no reader ever sees half of it.
* **Its manifest is written last and commits it**: `manifest.json`, written atomically, names the format and
  its version and holds the sha256 of the files (where, the artifact's schema says). A folder without a
  manifest does not exist: `Series.versions` does not list it, `read_manifest` refuses it, `set_latest` does
  not point at it.
* **A reader refuses what it does not know**: `read_manifest` checks the format and the version field against
  the versions this marge reads, and `verify_checksums` every file against its digest, each error naming the
  file, the field and the value.
* **LATEST moves last, and only forward**: a series of versioned folders (`Series`: `snapshots/step-*`,
  `index/v*`) has a pointer file, `LATEST` = `{"<field>": <number>, "dir": "<folder>"}`, replaced atomically
  after the folder is committed; a reader that follows it always finds a complete folder. Deleting a version
  (`drop_after`, `prune`) moves LATEST first and removes the folder's manifest before its files, so a half-deleted
  folder is no artifact either.

It imports neither torch nor pyarrow, so whatever only checks or lists artifacts needs neither.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marge.util.files import atomic_write_text, fsync_dir, sha256_file

MANIFEST = "manifest.json"
LATEST = "LATEST"


class ArtifactError(ValueError):
    """An artifact is missing, incomplete, corrupt or of a format or version this marge does not read. The
    message names the file. Each artifact raises its own subclass (SnapshotError, CheckpointError, ...)."""


# --- manifests -------------------------------------------------------------------------------------------


def file_sha256s(directory: Path, names: Iterable[str], what: str = "artifact",
                 error: type[ArtifactError] = ArtifactError) -> dict[str, str]:
    """The sha256 of each of `names` (paths relative to `directory`), for a manifest to hold."""
    directory = Path(directory)
    digests = {}
    for name in names:
        path = directory / name
        if not path.is_file():
            raise error(f"{path} is missing: the {what} in {directory} cannot be committed without it")
        digests[name] = sha256_file(path)
    return digests


def write_manifest(directory: Path, manifest: dict[str, Any], ascii: bool = True) -> dict[str, Any]:
    """Write `manifest` as `directory/manifest.json`, atomically: the last write of an artifact, which commits it.

    The dict is written as given (json, indent 2, ASCII unless `ascii` is False: a prepared corpus keeps the text of
    the examples it skipped as it was), so each artifact keeps the field order its readers and older files know."""
    if "format" not in manifest:
        raise ValueError(f"{Path(directory) / MANIFEST}: a manifest names its format (field 'format' is missing)")
    atomic_write_text(Path(directory) / MANIFEST, json.dumps(manifest, indent=2, ensure_ascii=ascii) + "\n")
    return manifest


def read_manifest(directory: Path, formats: str | Iterable[str], versions: Iterable[int], *,
                  version_field: str = "version", fields: Iterable[str] = (),
                  checksums: Callable[[dict[str, Any]], Mapping[str, str]] | None = None,
                  what: str = "artifact", hint: str = "",
                  error: type[ArtifactError] = ArtifactError) -> dict[str, Any]:
    """`directory`'s manifest, checked: it exists and is a JSON object, its `format` is one of `formats`, its
    `version_field` one of `versions`, each of `fields` is present, and (given `checksums`, which maps the
    manifest to {relative path: sha256}) every file matches its digest.

    `what` names the artifact in messages ("snapshot"); `hint`, appended to each message with its own leading
    punctuation, says what to do. Raises `error`."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        why = ("an unfinished or abandoned one has no manifest" if directory.exists()
               else f"{directory} does not exist")
        raise error(f"{path} is missing: {directory} is not a complete {what} ({why}){hint}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # torn by a crash mid-copy (storage uploads files in no fixed order)
        raise error(f"{path} cannot be read ({e}): an incomplete or corrupt {what}{hint}") from None
    if not isinstance(manifest, dict):
        raise error(f"{path}: not a {what} manifest (a JSON object expected, got {type(manifest).__name__}){hint}")
    formats = (formats,) if isinstance(formats, str) else tuple(formats)
    if manifest.get("format") not in formats:
        raise error(f"{path}: format is {manifest.get('format')!r}, expected "
                    f"{' or '.join(repr(f) for f in formats)}{hint}")
    versions = tuple(versions)
    if manifest.get(version_field) not in versions:
        raise error(f"{path}: {version_field} {manifest.get(version_field)!r} is not supported "
                    f"(this marge reads {what} {version_field} {list(versions)}){hint}")
    for key in fields:
        if key not in manifest:
            raise error(f"{path}: field {key!r} is missing{hint}")
    if checksums is not None:
        verify_checksums(directory, checksums(manifest), what=what, hint=hint, error=error)
    return manifest


def verify_checksums(directory: Path, digests: Mapping[str, str], what: str = "artifact", hint: str = "",
                     error: type[ArtifactError] = ArtifactError) -> None:
    """Check each file (relative to `directory`) against the sha256 its manifest gives; raise `error` naming the
    first one missing or different."""
    directory = Path(directory)
    for name, expected in digests.items():
        path = directory / name
        if not path.is_file():
            raise error(f"{path} is missing, though {directory / MANIFEST} lists it: an incomplete {what}{hint}")
        actual = sha256_file(path)
        if actual != expected:
            raise error(f"{path}: sha256 differs from {MANIFEST} (file {actual[:16]}..., manifest "
                        f"{str(expected)[:16]}...): the file is corrupt or was modified{hint}")


# --- publishing a folder ---------------------------------------------------------------------------------


def swap_into_place(source: Path, target: Path) -> Path:
    """Rename the complete folder `source` to `target`, replacing a folder there: the old one is moved aside, not
    deleted in place, so a reader sees the old folder whole or the new one, never a torn one; then it is removed."""
    source, target = Path(source), Path(target)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(source, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


@contextlib.contextmanager
def atomic_directory(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name and move it into place only if the block succeeds.

    Nothing half-written is ever visible at `target`; on error the temporary folder is removed and an
    existing `target` is left untouched. With `overwrite`, an existing `target` is replaced.
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; remove it or pass --overwrite to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        swap_into_place(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def publish_dir(target: Path, overwrite: bool = False, error: type[ArtifactError] = ArtifactError) -> Iterator[Path]:
    """Yield a temporary folder to build an artifact in (its manifest last); when the block ends, move it to
    `target` in one rename. An exception in the block, or a block that wrote no manifest, publishes nothing and
    leaves an existing `target` as it was. With `overwrite`, an existing `target` is replaced."""
    with atomic_directory(Path(target), overwrite=overwrite) as tmp:
        yield tmp
        if not (tmp / MANIFEST).is_file():
            raise error(f"{target}: nothing was published: the folder was built without its {MANIFEST}, which "
                        "commits it (write_manifest last)")


def commit_staged(staging: Path, target: Path, error: type[ArtifactError] = ArtifactError) -> Path:
    """Rename a complete staging folder (manifest written) to `target`, replacing a folder there.

    For artifacts whose files several workers write under a fixed staging name before one commits them
    (index versions); a single writer uses `publish_dir`."""
    staging, target = Path(staging), Path(target)
    if not (staging / MANIFEST).is_file():
        raise error(f"{staging}: has no {MANIFEST}; write the manifest before committing it as {target}")
    return swap_into_place(staging, target)  # a folder there: a re-run of the version, after a crash before LATEST moved


def remove(path: Path, ignore_errors: bool = False) -> None:
    """Delete an artifact folder, its manifest first: should the rest fail half-way, what is left is no artifact."""
    path = Path(path)
    try:
        (path / MANIFEST).unlink(missing_ok=True)
    except OSError:
        if not ignore_errors:
            raise
    shutil.rmtree(path, ignore_errors=ignore_errors)


# --- series of versions and the LATEST pointer -----------------------------------------------------------


@dataclass(frozen=True)
class Artifact:
    """One committed folder of a series, as a reader holds it: the number the series orders it by (a snapshot's
    step, an index's version), the folder, and its manifest as read. Each series names the number its own way."""

    number: int
    path: Path
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Series:
    """Versioned folders side by side under one root (`step-00000200`, `v000003`), each an artifact committed
    by its manifest, and optionally a LATEST pointer naming the newest.

    `order(name)` gives the sort key a folder name carries (an int for a series with a pointer: the number
    LATEST records under `pointer_field`); it raises ValueError for a name that is not one of the series."""

    pattern: str
    order: Callable[[str], Any]
    pointer_field: str | None = None
    what: str = "artifact"
    error: type[ArtifactError] = ArtifactError

    def _folders(self, root: Path) -> list[Path]:
        """Folders whose name is one of the series, committed or not, oldest first."""
        found = []
        for path in Path(root).glob(self.pattern):
            try:
                key = self.order(path.name)
            except ValueError:  # a stray folder matching the pattern
                continue
            if path.is_dir():
                found.append((key, path))
        return [p for _, p in sorted(found, key=lambda kp: kp[0])]

    def versions(self, root: Path) -> list[Path]:
        """The committed versions under `root` (those with a manifest; not verified), oldest first."""
        return [p for p in self._folders(root) if (p / MANIFEST).is_file()]

    def latest(self, root: Path) -> Path | None:
        """The folder LATEST names, or None when nothing has been published yet."""
        pointer = self._read_pointer(Path(root))
        return None if pointer is None else Path(root) / pointer["dir"]

    def set_latest(self, root: Path, name: str) -> bool:
        """Point LATEST at committed version `name`, unless it already names a newer one (a slow writer must not
        move readers back). True when it moved."""
        root = Path(root)
        field = self._field()
        number = self.order(name)
        if not (root / name / MANIFEST).is_file():
            raise self.error(f"{root / name}: has no {MANIFEST}; {root / LATEST} points only at a committed "
                             f"{self.what}")
        current = self._read_pointer(root)
        if current is not None and current[field] >= number:
            return False
        self._point(root, name)
        return True

    def drop_after(self, root: Path, after: int, key: Callable[[Path], int] | None = None) -> list[Any]:
        """Delete the committed versions whose `key` (default: the number in the folder name) is above `after` (a
        resumed run's discarded lineage), pointing LATEST at the newest one left first. Returns the dropped
        versions' `order`, oldest first."""
        root = Path(root)
        key = key or (lambda path: self.order(path.name))
        committed = self.versions(root)
        doomed = [p for p in committed if key(p) > after]
        if not doomed:
            return []
        if self.pointer_field is not None:
            kept = [p for p in committed if p not in doomed]
            if kept:
                self._point(root, kept[-1].name)
            else:
                (root / LATEST).unlink(missing_ok=True)
        for path in doomed:
            remove(path)
        return [self.order(p.name) for p in doomed]

    def prune(self, root: Path, keep: int) -> list[Any]:
        """Keep the newest `keep` committed versions (and the one LATEST names); delete older ones, and the
        leftovers of an interrupted deletion older than those kept. keep <= 0 keeps everything. Returns the
        deleted folders' `order`."""
        root = Path(root)
        kept = self.versions(root)[-keep:] if keep > 0 else []
        if not kept:
            return []
        oldest_kept = self.order(kept[0].name)
        pointed = self.latest(root) if self.pointer_field is not None else None
        doomed = [p for p in self._folders(root)
                  if self.order(p.name) < oldest_kept and (pointed is None or p.name != pointed.name)]
        for path in doomed:
            remove(path, ignore_errors=True)  # a reader still holding an old version may keep its files busy
        return [self.order(p.name) for p in doomed]

    def _field(self) -> str:
        if self.pointer_field is None:
            raise TypeError(f"{self.what} folders ({self.pattern}) have no LATEST pointer")
        return self.pointer_field

    def _point(self, root: Path, name: str) -> None:
        atomic_write_text(root / LATEST, json.dumps({self._field(): self.order(name), "dir": name}) + "\n")

    def _read_pointer(self, root: Path) -> dict[str, Any] | None:
        path = root / LATEST
        if not path.exists():
            return None
        try:
            pointer = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            # marge only ever replaces LATEST whole, so a torn one was damaged by something else
            raise self.error(f"{path} cannot be read ({e}): write it again as {{{self._field()!r}: <number>, "
                             f"'dir': <folder>}} naming the newest {self.what} with a {MANIFEST}") from None
        field = self._field()
        if not isinstance(pointer, dict) or not isinstance(pointer.get("dir"), str) or field not in pointer:
            raise self.error(f"{path}: expected {{{field!r}: <number>, 'dir': <folder>}}, got {pointer!r}")
        return pointer
