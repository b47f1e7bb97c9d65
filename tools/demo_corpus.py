"""The demo corpus: LibreOffice Help in many languages, built from Debian's `libreoffice-help-*` packages.

The same relative page path in every language is the same page, and every paragraph carries an id
that is the same in every language, so the corpus is aligned by construction (like the paper's
Wikipedia shards: the same article in every language). A fixed set of pages, chosen by a hash of the
page path, is held out of training; their paragraph pairs become the retrieval test set.

Outputs (in `out_dir`):
    documents.jsonl.gz        training pages, one JSON object per (page, language): the input of `marge prepare`;
                              `paragraph_ids` lists the id of each paragraph of `text` (paragraphs are separated
                              by blank lines), the same in every language, so translations can be found by
                              paragraph (what the alignment measures and the aligned oracle use, never training)
    heldout_documents.jsonl.gz  held-out pages in the same format (document-level translation tests)
    heldout_pairs.tsv         src_lang<TAB>src_text<TAB>tgt_lang<TAB>tgt_text, English -> every other language
    heldout_pages.txt         the held-out page paths
    build_info.json           packages, counts and the options used
    ATTRIBUTION.md            licence and source of the text

Run `python -m tools.demo_corpus --help` from the checkout's root (or `scripts/build_demo_corpus.sh`).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import os
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from marge.contracts.artifacts import atomic_directory
from marge.contracts.html_text import extract_paragraphs
from marge.util.files import setup_logging
from services.prepare.langid import identify

log = logging.getLogger(__name__)

# ISO 639-1 code -> (directory under usr/share/libreoffice/help, Debian package suffix)
LIBREOFFICE_LANGUAGES = {
    "en": ("en-US", "en-us"), "de": ("de", "de"), "fr": ("fr", "fr"), "es": ("es", "es"), "it": ("it", "it"),
    "nl": ("nl", "nl"), "pl": ("pl", "pl"), "pt": ("pt-BR", "pt-br"), "ru": ("ru", "ru"), "zh": ("zh-CN", "zh-cn"),
    "ja": ("ja", "ja"), "ko": ("ko", "ko"), "sv": ("sv", "sv"), "fi": ("fi", "fi"), "cs": ("cs", "cs"),
    "hu": ("hu", "hu"), "tr": ("tr", "tr"), "el": ("el", "el"), "hi": ("hi", "hi"), "vi": ("vi", "vi"),
    "da": ("da", "da"), "sk": ("sk", "sk"), "sl": ("sl", "sl"), "ca": ("ca", "ca"), "id": ("id", "id"),
}
DEFAULT_LANGUAGES = ("en", "de", "fr", "es", "it", "ru", "zh", "ja")

ATTRIBUTION = """# Attribution

The text in this folder is extracted from the LibreOffice Help pages shipped in Debian's
`libreoffice-help-<lang>` packages (LibreOffice {version}, https://help.libreoffice.org).

LibreOffice Help is © The Document Foundation and contributors, licensed under the Mozilla Public
License 2.0 (https://www.mozilla.org/MPL/2.0/); small parts are Apache-2.0 licensed. This folder holds
an extract (plain text of selected pages and paragraphs, no markup), used as a multilingual demo and
test corpus for MARGE pre-training. Rebuild it, or a larger version, with `scripts/build_demo_corpus.sh`.

Languages: {languages}
"""


@dataclass
class BuildOptions:
    out_dir: Path
    languages: tuple[str, ...] = DEFAULT_LANGUAGES
    cache_dir: Path = Path("data/build/debs")
    holdout_permille: int = 100
    max_train_pages: int | None = None
    max_heldout_pages: int | None = None
    min_page_chars: int = 40
    min_pair_words: int = 5
    max_pairs_per_language: int = 1000
    lid_min_score: float = 0.5


def page_hash(path: str, salt: str) -> int:
    return int.from_bytes(hashlib.sha1(f"{salt}:{path}".encode()).digest()[:8], "big")


def is_heldout(path: str, permille: int) -> bool:
    """A fixed, language-independent choice: the same pages are held out in every build."""
    return page_hash(path, "marge-heldout") % 1000 < permille


def fetch_help_packages(languages: tuple[str, ...], cache_dir: Path) -> tuple[Path, str]:
    """Download (once) and unpack the help packages; returns the help root and the LibreOffice version."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    missing = [lang for lang in languages if lang not in LIBREOFFICE_LANGUAGES]
    if missing:
        raise ValueError(f"no LibreOffice Help package known for {missing}; choose from {sorted(LIBREOFFICE_LANGUAGES)}")
    packages = [f"libreoffice-help-{LIBREOFFICE_LANGUAGES[lang][1]}" for lang in languages]
    have = {p.name.split("_")[0]: p for p in cache_dir.glob("libreoffice-help-*.deb")}
    todo = [p for p in packages if p not in have]
    if todo:
        if shutil.which("apt-get") is None:
            raise RuntimeError("apt-get is not available: build the demo corpus on a Debian/Ubuntu machine, "
                               f"or put the .deb files for {todo} into {cache_dir}")
        log.info("downloading %s", " ".join(todo))
        result = subprocess.run(["apt-get", "download", *todo], cwd=cache_dir, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"apt-get download failed ({result.stderr.strip()[-500:]}); "
                               "run `apt-get update` first (as root) and check the package names")
        have = {p.name.split("_")[0]: p for p in cache_dir.glob("libreoffice-help-*.deb")}
    root = cache_dir / "root"
    version = ""
    for package in packages:
        deb = have[package]
        # libreoffice-help-de_4%3a7.4.7-1+deb12u14_all.deb -> 7.4.7 (drop the epoch and the Debian revision)
        version = deb.name.split("_")[1].replace("%3a", ":").split(":")[-1].split("-")[0]
        marker = root / f".unpacked-{deb.name}"
        if not marker.exists():
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
            marker.touch()
    return root / "usr/share/libreoffice/help", version


def read_pages(help_root: Path, languages: tuple[str, ...]) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """{page path: {lang: [(paragraph id, text), ...]}} for pages present in every language."""
    dirs = {lang: help_root / LIBREOFFICE_LANGUAGES[lang][0] for lang in languages}
    for lang, d in dirs.items():
        if not d.is_dir():
            raise FileNotFoundError(f"{d} does not exist: the package for {lang!r} did not unpack as expected")
    english_dir = dirs.get("en", next(iter(dirs.values())))
    paths = sorted(str(p.relative_to(english_dir)) for p in english_dir.glob("text/**/*.html"))
    pages: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for path in tqdm(paths, desc="reading help pages", unit="page"):
        per_lang = {}
        for lang, d in dirs.items():
            f = d / path
            if not f.exists():
                break
            per_lang[lang] = extract_paragraphs(f.read_text(encoding="utf-8")).paragraphs
        else:
            pages[path.removesuffix(".html")] = per_lang
    return pages


def translated_paragraphs(paragraphs: dict[str, list[tuple[str, str]]], lang: str) -> list[tuple[str, str]]:
    """Drop paragraphs that fell back to the English text (untranslated strings)."""
    if lang == "en" or "en" not in paragraphs:
        return paragraphs[lang]
    english = dict(paragraphs["en"])
    return [(pid, text) for pid, text in paragraphs[lang] if english.get(pid) != text]


def occurrence_keys(ids: list[str]) -> list[str]:
    """Paragraph ids made unique within a page: a page may use one id for several paragraphs (about 5% of
    LibreOffice Help's), so the k-th use of an id becomes `id~k` (k >= 1), which still matches the k-th use of
    that id in another language's version of the page."""
    seen: Counter = Counter()
    out = []
    for pid in ids:
        out.append(pid if not seen[pid] else f"{pid}~{seen[pid]}")
        seen[pid] += 1
    return out


def keyed_translated_paragraphs(paragraphs: dict[str, list[tuple[str, str]]], lang: str) -> list[tuple[str, str]]:
    """`translated_paragraphs` with `occurrence_keys` for ids (counted over all of the page's paragraphs in
    `lang`, before untranslated ones are dropped, so the keys of one page match across languages)."""
    if lang == "en" or "en" not in paragraphs:
        kept = [True] * len(paragraphs[lang])
    else:
        english = dict(paragraphs["en"])
        kept = [english.get(pid) != text for pid, text in paragraphs[lang]]
    keys = occurrence_keys([pid for pid, _ in paragraphs[lang]])
    return [(key, text) for key, (_, text), keep in zip(keys, paragraphs[lang], kept) if keep]


def write_jsonl_gz(path: Path, rows: list[dict]) -> None:
    # mtime=0 keeps the gzip header, and so the committed fixture, byte-identical across builds
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for row in rows:
            f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))


def build(opts: BuildOptions) -> dict:
    help_root, version = fetch_help_packages(opts.languages, opts.cache_dir)
    pages = read_pages(help_root, opts.languages)
    order = sorted(pages, key=lambda p: page_hash(p, "marge-order"))
    heldout = [p for p in order if is_heldout(p, opts.holdout_permille)]
    train = [p for p in order if not is_heldout(p, opts.holdout_permille)]
    if opts.max_train_pages is not None:
        train = train[: opts.max_train_pages]
    if opts.max_heldout_pages is not None:
        heldout = heldout[: opts.max_heldout_pages]
    stats: Counter = Counter()

    def documents(paths: list[str]) -> list[dict]:
        rows = []
        for path in tqdm(paths, desc="checking pages", unit="page"):
            for lang in opts.languages:
                paras = keyed_translated_paragraphs(pages[path], lang)
                text = "\n\n".join(t for _, t in paras)
                if len(text) < opts.min_page_chars:
                    stats[f"dropped_short_{lang}"] += 1
                    continue
                guess = identify(text)
                if guess.lang != lang and guess.score >= opts.lid_min_score:
                    stats[f"dropped_lid_{lang}"] += 1
                    continue
                rows.append({"id": f"{lang}:{path}", "group": path, "language": lang,
                             "title": paras[0][1] if paras else "", "text": text,
                             "paragraph_ids": [pid for pid, _ in paras]})
                stats[f"documents_{lang}"] += 1
        return rows

    train_rows = documents(train)
    heldout_rows = documents(heldout)
    # Paragraph pairs of held-out pages, English -> each language; never a text that a training page has.
    seen_in_training = {(row["language"], para) for row in train_rows for para in row["text"].split("\n\n")}
    pairs: list[tuple[str, str, str, str]] = []
    for lang in opts.languages:
        if lang == "en":
            continue
        chosen, seen = [], set()
        for path in heldout:
            english = dict(pages[path]["en"])
            for pid, text in translated_paragraphs(pages[path], lang):
                src = english.get(pid)
                if (src is None or src == text or len(src.split()) < opts.min_pair_words or src in seen
                        or ("en", src) in seen_in_training or (lang, text) in seen_in_training):
                    continue
                seen.add(src)
                chosen.append(("en", src, lang, text))
        pairs.extend(chosen[: opts.max_pairs_per_language])
        stats[f"pairs_en_{lang}"] = min(len(chosen), opts.max_pairs_per_language)

    info = {"libreoffice_version": version, "languages": list(opts.languages), "train_pages": len(train),
            "heldout_pages": len(heldout), "holdout_permille": opts.holdout_permille,
            "train_documents": len(train_rows), "heldout_documents": len(heldout_rows), "pairs": len(pairs),
            "stats": dict(sorted(stats.items()))}
    with atomic_directory(opts.out_dir, overwrite=True) as tmp:
        write_jsonl_gz(tmp / "documents.jsonl.gz", train_rows)
        write_jsonl_gz(tmp / "heldout_documents.jsonl.gz", heldout_rows)
        with open(tmp / "heldout_pairs.tsv", "w", encoding="utf-8", newline="\n") as f:
            for row in pairs:
                f.write("\t".join(" ".join(cell.split()) for cell in row) + "\n")
        (tmp / "heldout_pages.txt").write_text("".join(p + "\n" for p in heldout), encoding="utf-8")
        (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        (tmp / "ATTRIBUTION.md").write_text(
            ATTRIBUTION.format(version=version, languages=", ".join(opts.languages)), encoding="utf-8")
    log.info("demo corpus in %s: %d training documents, %d held-out documents, %d held-out pairs",
             opts.out_dir, len(train_rows), len(heldout_rows), len(pairs))
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.demo_corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (replaced atomically)")
    p.add_argument("--languages", default=",".join(DEFAULT_LANGUAGES),
                   help=f"comma-separated ISO 639-1 codes (default {','.join(DEFAULT_LANGUAGES)})")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("MARGE_DEB_CACHE", "data/build/debs")))
    p.add_argument("--holdout-permille", type=int, default=100, help="pages held out of training, per 1000")
    p.add_argument("--max-train-pages", type=int, default=None, help="keep only this many training pages (a fixture)")
    p.add_argument("--max-heldout-pages", type=int, default=None)
    p.add_argument("--max-pairs-per-language", type=int, default=1000)
    args = p.parse_args(argv)
    setup_logging()
    opts = BuildOptions(out_dir=args.out, languages=tuple(args.languages.split(",")), cache_dir=args.cache_dir,
                        holdout_permille=args.holdout_permille, max_train_pages=args.max_train_pages,
                        max_heldout_pages=args.max_heldout_pages, max_pairs_per_language=args.max_pairs_per_language)
    info = build(opts)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
