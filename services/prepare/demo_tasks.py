"""Small fine-tuning task sets built from the bundled demo corpus (LibreOffice Help, 8 languages).

Two tasks, each with train / valid / test splits, written as plain UTF-8 JSON Lines:

    translation/{train,valid,test}.jsonl
        {"id", "source", "target", "source_language", "target_language"}: paragraph translation,
        English -> German and German -> English (the supervised pair of the demo).
    pawsx/{train,valid,test}.jsonl
        {"id", "text", "text_pair", "label", "language", "pair_language"}: a PAWS-X-like pair
        classification. `text` is an English paragraph; `text_pair` is either its translation
        (label "translation") or a paragraph in the same language from the page next to this one in
        page-path order (label "other": usually the same help folder, so a related topic, which makes
        the negatives harder than random ones). train and valid hold en-de only; test holds en-de and
        en-{fr,es,it,ru,zh,ja}, so a model fine-tuned on German is measured zero-shot on the others.
    build_info.json, README.md
        counts, options, the alignment check, the source files' sha256; a short data card.

How paragraphs are aligned: the corpus stores each (page, language) as paragraphs joined by blank
lines, without the paragraph ids it was built from, and it dropped paragraphs that were left
untranslated. A page whose English and language-X versions have the same number of paragraphs lost
nothing, so its paragraphs align by index; pages with different counts are not used. The method is
checked against the corpus's `heldout_pairs.tsv` (aligned by paragraph id when the corpus was built):
the share of index-aligned held-out pairs that it confirms goes into build_info.json.

Splits are by page, so no page's text is in two splits: test = the corpus's held-out pages; valid = a
sha256-chosen ~10% of the training pages; train = the other training pages. Repeated boilerplate
("Syntax:", "Parameters:") recurs across pages, so a paragraph whose English text already occurs on a
page of an earlier split (train, then valid) is dropped from the later one. In translation each split
uses an English paragraph once per direction; in pawsx exactly twice per language pair, once with its
translation and once with a nearby paragraph, so the label depends on the pair, never on the text alone.

The build is deterministic: the same corpus, options and seed give byte-identical files.
Rebuild with `python -m services.prepare.demo_tasks --corpus data/demo/libreoffice-help --out data/demo/tasks --overwrite` (from
the checkout's root) or `marge prepare-tasks --overwrite`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from marge.contracts.artifacts import atomic_directory
from marge.contracts.documents import read_documents
from marge.util.files import setup_logging, sha256_file

log = logging.getLogger(__name__)

TRAIN_DOCUMENTS = "documents.jsonl.gz"
HELDOUT_DOCUMENTS = "heldout_documents.jsonl.gz"
HELDOUT_PAIRS = "heldout_pairs.tsv"
SOURCE_FILES = (TRAIN_DOCUMENTS, HELDOUT_DOCUMENTS, HELDOUT_PAIRS)

SPLITS = ("train", "valid", "test")
PIVOT = "en"
SUPERVISED = "de"
ZERO_SHOT = ("fr", "es", "it", "ru", "zh", "ja")
POSITIVE, NEGATIVE = "translation", "other"

# Median character-length ratio (language X / English) of index-aligned paragraphs in this corpus,
# measured when this module was written. The length filter compares a pair's ratio with its language's
# median, so that Chinese (a third of English's length) is not dropped as "too short".
TYPICAL_LENGTH_RATIO = {"de": 1.2, "fr": 1.25, "es": 1.2, "it": 1.2, "ru": 1.1, "zh": 0.33, "ja": 0.53}

# How many following pages the negative search may try when the adjacent page's paragraph fails the
# filters: a few keeps the negative "nearby" (same help folder), not an arbitrary page.
NEGATIVE_PAGE_TRIES = 5

# Page = {language: [paragraph, ...]}; Pages = {page path: Page}
Page = dict[str, list[str]]
Pages = dict[str, Page]


@dataclass(frozen=True)
class AlignedPair:
    """Paragraph `index` of page `group`: English text and its translation into `language`."""

    group: str
    index: int
    language: str
    english: str
    translation: str


@dataclass
class DemoTasksOptions:
    corpus: Path = Path("data/demo/libreoffice-help")
    out: Path = Path("data/demo/tasks")
    overwrite: bool = False
    seed: int = 0
    valid_permille: int = 100
    min_chars: int = 3
    max_chars: int = 400
    max_length_deviation: float = 3.0
    # (train, valid, test). Translation: pairs per direction; pawsx: rows per language pair (half of them
    # "translation"). The caps keep the committed folder near 2 MB; 3000 pawsx train rows are 1500 English
    # paragraphs, each seen with both labels.
    translation_caps: tuple[int, int, int] = (1000, 100, 150)
    pawsx_caps: tuple[int, int, int] = (3000, 200, 200)

    def recorded(self) -> dict:
        """The options that shape the output (not the paths, which differ between machines)."""
        d = asdict(self)
        for key in ("corpus", "out", "overwrite"):
            d.pop(key)
        d["translation_caps"] = dict(zip(SPLITS, self.translation_caps))
        d["pawsx_caps"] = dict(zip(SPLITS, self.pawsx_caps))
        return d


# ---------------------------------------------------------------------------------------------- inputs


def read_pages(path: Path) -> Pages:
    """{page path: {language: paragraphs}} from a corpus documents file; errors name the file, line and field."""
    return {group: {language: text.split("\n\n") for language, text in versions.items()}
            for group, versions in read_documents(path, unique=True).items()}


def read_reference_pairs(path: Path) -> dict[str, dict[str, str]]:
    """{language: {English paragraph: translation}} from heldout_pairs.tsv (whitespace-normalised text)."""
    pairs: dict[str, dict[str, str]] = defaultdict(dict)
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        cells = line.split("\t")
        if len(cells) not in (4, 5):  # a 5th field, the pair's group, is what `marge prepare` adds
            raise ValueError(f"{path} line {lineno}: expected 4 tab-separated fields "
                             f"(src_lang, src_text, tgt_lang, tgt_text) or 5 (and the pair's group), got {len(cells)}")
        src_lang, src, tgt_lang, tgt = cells[:4]
        if src_lang != PIVOT:
            raise ValueError(f"{path} line {lineno}: field src_lang is {src_lang!r}, expected {PIVOT!r}")
        pairs[tgt_lang].setdefault(src, tgt)
    return dict(pairs)


def split_pages(train_pages: Pages, heldout_pages: Pages, valid_permille: int) -> dict[str, Pages]:
    """test = held-out pages; valid = a fixed hash-chosen share of the training pages; train = the rest."""
    both = sorted(set(train_pages) & set(heldout_pages))
    if both:
        raise ValueError(f"{len(both)} pages are in both {TRAIN_DOCUMENTS} and {HELDOUT_DOCUMENTS}, e.g. {both[0]!r}")
    valid = {g: p for g, p in train_pages.items() if is_valid_page(g, valid_permille)}
    train = {g: p for g, p in train_pages.items() if g not in valid}
    return {"train": train, "valid": valid, "test": dict(heldout_pages)}


def is_valid_page(group: str, permille: int) -> bool:
    # A hash of the path alone: the same pages are chosen whatever the seed, so valid never drifts into train.
    return int.from_bytes(hashlib.sha256(group.encode("utf-8")).digest()[:8], "big") % 1000 < permille


# ------------------------------------------------------------------------------------------- alignment


def index_aligned(pages: Pages, language: str) -> list[tuple[str, int, str, str]]:
    """(group, index, English, translation) for every paragraph of the pages whose counts match."""
    out: list[tuple[str, int, str, str]] = []
    for group in sorted(pages):
        page = pages[group]
        if PIVOT in page and language in page and len(page[PIVOT]) == len(page[language]):
            out.extend((group, i, e, x) for i, (e, x) in enumerate(zip(page[PIVOT], page[language])))
    return out


def length_ok(text: str, opts: DemoTasksOptions) -> bool:
    return opts.min_chars <= len(text) <= opts.max_chars


def plausible_pair(english: str, other: str, language: str, opts: DemoTasksOptions) -> bool:
    """Cheap sanity filters: both lengths in range, not identical, a length ratio near the language's usual one."""
    if not (length_ok(english, opts) and length_ok(other, opts)) or english == other:
        return False
    deviation = len(other) / len(english) / TYPICAL_LENGTH_RATIO.get(language, 1.0)
    return 1.0 / opts.max_length_deviation <= deviation <= opts.max_length_deviation


def aligned_pairs(pages: Pages, language: str, opts: DemoTasksOptions, stats: Counter) -> list[AlignedPair]:
    pairs = []
    for group, i, english, translation in index_aligned(pages, language):
        if plausible_pair(english, translation, language, opts):
            pairs.append(AlignedPair(group, i, language, english, translation))
        else:
            stats[f"filtered_{language}"] += 1
    return pairs


def check_alignment(heldout: Pages, reference: dict[str, dict[str, str]], opts: DemoTasksOptions) -> dict:
    """Share of index-aligned held-out pairs that heldout_pairs.tsv (aligned by paragraph id) confirms.

    A pair is checkable when its English paragraph is a source in the reference for that language (the
    reference holds a capped subset); it is confirmed when the reference's translation is the same text.
    Pages with unequal paragraph counts are measured too, to show why they are left out.
    """
    def norm(s: str) -> str:  # the corpus wrote the tsv with runs of whitespace collapsed
        return " ".join(s.split())

    per_language: dict[str, dict[str, int]] = {}
    unequal = Counter[str]()
    checked = confirmed = 0
    for language in (SUPERVISED, *ZERO_SHOT):
        ref = reference.get(language, {})
        n = ok = 0
        for _, _, english, translation in index_aligned(heldout, language):
            if plausible_pair(english, translation, language, opts) and norm(english) in ref:
                n += 1
                ok += ref[norm(english)] == norm(translation)
        per_language[f"{PIVOT}-{language}"] = {"checked": n, "confirmed": ok}
        checked, confirmed = checked + n, confirmed + ok
        for page in heldout.values():  # the contrast: same index on pages whose counts differ
            if PIVOT in page and language in page and len(page[PIVOT]) != len(page[language]):
                for english, translation in zip(page[PIVOT], page[language]):
                    if norm(english) in ref:
                        unequal["checked"] += 1
                        unequal["confirmed"] += ref[norm(english)] == norm(translation)
    return {
        "share": round(confirmed / checked, 4) if checked else 0.0,
        "checked": checked,
        "confirmed": confirmed,
        "per_language_pair": per_language,
        "unequal_count_pages_share": round(unequal["confirmed"] / unequal["checked"], 4) if unequal["checked"] else 0.0,
    }


def drop_repeats(pairs: list[AlignedPair], seen_english: set[str], stats: Counter, split: str) -> list[AlignedPair]:
    """Keep the first pair per English paragraph, and none whose English text an earlier split's pages hold."""
    kept, used = [], set()
    for p in pairs:
        if p.english in seen_english:
            stats[f"dropped_seen_earlier_{split}_{p.language}"] += 1
        elif p.english in used:
            stats[f"dropped_repeat_{split}_{p.language}"] += 1
        else:
            used.add(p.english)
            kept.append(p)
    return kept


def english_paragraphs(pages: Pages) -> set[str]:
    return {para for page in pages.values() for para in page.get(PIVOT, [])}


# ----------------------------------------------------------------------------------------------- tasks


def seeded_rng(seed: int, *parts: str) -> random.Random:
    # A str seed is hashed with SHA-512 by random.Random: stable across runs and PYTHONHASHSEED.
    return random.Random(":".join([str(seed), *parts]))


def capped_sample(items: list, cap: int, rng: random.Random) -> list:
    """A seeded sample of at most `cap` items, in their original order."""
    if len(items) <= cap:
        return list(items)
    chosen = sorted(rng.sample(range(len(items)), cap))
    return [items[i] for i in chosen]


def translation_rows(pairs: list[AlignedPair], split: str, cap: int, seed: int) -> list[dict]:
    """English -> X and X -> English rows; each direction is sampled on its own."""
    rows: list[dict] = []
    if not pairs:
        return rows
    language = pairs[0].language
    for src, tgt in ((PIVOT, language), (language, PIVOT)):
        forward = src == PIVOT
        for p in capped_sample(pairs, cap, seeded_rng(seed, "translation", split, f"{src}-{tgt}")):
            rows.append({
                "id": f"{split}:{src}-{tgt}:{p.group}#{p.index}",
                "source": p.english if forward else p.translation,
                "target": p.translation if forward else p.english,
                "source_language": src,
                "target_language": tgt,
            })
    return rows


def nearby_paragraph(pair: AlignedPair, order: list[str], position: dict[str, int], pages: Pages,
                     opts: DemoTasksOptions) -> str | None:
    """The negative: same index (clamped) on the next page in path order with the pair language.

    Pages that lack the language are skipped; a candidate that equals the true translation or fails the
    pair filters (so that length alone never gives the label away) moves the search to the following page.
    """
    start = position[pair.group]
    tried = 0
    for step in range(1, len(order)):
        page = pages[order[(start + step) % len(order)]]
        paragraphs = page.get(pair.language)
        if not paragraphs:
            continue
        candidate = paragraphs[min(pair.index, len(paragraphs) - 1)]
        if candidate != pair.translation and plausible_pair(pair.english, candidate, pair.language, opts):
            return candidate
        tried += 1
        if tried >= NEGATIVE_PAGE_TRIES:
            break
    return None


def pawsx_rows(pairs: list[AlignedPair], pages: Pages, split: str, cap: int, opts: DemoTasksOptions,
               stats: Counter) -> list[dict]:
    """Balanced "translation" / "other" rows, PAWS-style: each English paragraph appears twice, once with its
    translation and once with a nearby paragraph, so the label depends on the pair and never on the text alone
    (with one row per paragraph, a model fine-tuned on 1000 rows memorised texts and stayed at chance on
    validation: experiments/finetune/README.md)."""
    if not pairs:
        return []
    language = pairs[0].language
    order = sorted(pages)
    position = {g: i for i, g in enumerate(order)}
    shuffled = list(pairs)
    seeded_rng(opts.seed, "pawsx", split, language).shuffle(shuffled)
    chosen: list[tuple[AlignedPair, str]] = []
    for p in shuffled:
        if len(chosen) >= cap // 2:
            break
        other = nearby_paragraph(p, order, position, pages, opts)
        if other is None:
            stats[f"no_negative_{split}_{language}"] += 1
        else:
            chosen.append((p, other))
    chosen.sort(key=lambda c: (c[0].group, c[0].index))  # page order: readable files, stable diffs
    return [pawsx_row(split, p, text_pair, label) for p, other in chosen
            for text_pair, label in ((p.translation, POSITIVE), (other, NEGATIVE))]


def pawsx_row(split: str, p: AlignedPair, text_pair: str, label: str) -> dict:
    return {
        "id": f"{split}:{PIVOT}-{p.language}:{p.group}#{p.index}:{label}",
        "text": p.english,
        "text_pair": text_pair,
        "label": label,
        "language": PIVOT,
        "pair_language": p.language,
    }


# ----------------------------------------------------------------------------------------------- build


def build_tasks(splits: dict[str, Pages], opts: DemoTasksOptions, stats: Counter) -> dict[str, list[dict]]:
    """{relative file name: rows} for both tasks and all splits."""
    files: dict[str, list[dict]] = {}
    seen: set[str] = set()  # English paragraphs of earlier splits' pages
    for s, split in enumerate(SPLITS):
        pages = splits[split]
        languages = (SUPERVISED, *ZERO_SHOT) if split == "test" else (SUPERVISED,)
        pairs = {lang: drop_repeats(aligned_pairs(pages, lang, opts, stats), seen, stats, split) for lang in languages}
        for lang in languages:
            stats[f"candidates_{split}_{lang}"] = len(pairs[lang])
        files[f"translation/{split}.jsonl"] = translation_rows(pairs[SUPERVISED], split, opts.translation_caps[s],
                                                               opts.seed)
        files[f"pawsx/{split}.jsonl"] = [row for lang in languages
                                         for row in pawsx_rows(pairs[lang], pages, split, opts.pawsx_caps[s], opts, stats)]
        seen |= english_paragraphs(pages)
    return files


def count_rows(files: dict[str, list[dict]]) -> dict:
    counts: dict = {}
    for name, rows in files.items():
        per: dict = {}
        for row in rows:
            if "label" in row:
                key = f"{row['language']}-{row['pair_language']}"
                per.setdefault(key, {POSITIVE: 0, NEGATIVE: 0})[row["label"]] += 1
            else:
                key = f"{row['source_language']}-{row['target_language']}"
                per[key] = per.get(key, 0) + 1
        counts[name] = {"rows": len(rows), "per_language_pair": per}
    return counts


def build_demo_tasks(opts: DemoTasksOptions) -> dict:
    """Build the task folder at `opts.out` (atomically) and return the build info written with it."""
    out = Path(opts.out)
    if out.exists() and not opts.overwrite:  # fail before the work; atomic_directory checks again
        raise FileExistsError(f"{out} already exists; remove it or pass --overwrite to replace it")
    corpus = Path(opts.corpus)
    for name in SOURCE_FILES:
        if not (corpus / name).is_file():
            raise FileNotFoundError(f"{corpus / name} does not exist: --corpus must be a demo corpus folder "
                                    "(built by `python -m tools.demo_corpus`)")
    train_pages = read_pages(corpus / TRAIN_DOCUMENTS)
    heldout_pages = read_pages(corpus / HELDOUT_DOCUMENTS)
    reference = read_reference_pairs(corpus / HELDOUT_PAIRS)
    splits = split_pages(train_pages, heldout_pages, opts.valid_permille)

    stats: Counter = Counter()
    files = build_tasks(splits, opts, stats)
    info = {
        "options": opts.recorded(),
        "sources": {name: sha256_file(corpus / name) for name in SOURCE_FILES},
        "pages": {split: len(pages) for split, pages in splits.items()},
        "alignment_check": check_alignment(heldout_pages, reference, opts),
        "counts": count_rows(files),
        "stats": dict(sorted(stats.items())),
    }
    with atomic_directory(out, overwrite=opts.overwrite) as tmp:
        for name, rows in files.items():
            write_jsonl(tmp / name, rows)
        (tmp / "build_info.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(data_card(info), encoding="utf-8")
    log.info("demo tasks in %s: %s", out, {name: c["rows"] for name, c in info["counts"].items()})
    return info


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def data_card(info: dict) -> str:
    counts = info["counts"]
    lines = [f"| `{name}` | {c['rows']} | " + ", ".join(
        f"{pair} {n if isinstance(n, int) else n[POSITIVE] + n[NEGATIVE]}" for pair, n in c["per_language_pair"].items())
        + " |" for name, c in counts.items()]
    check = info["alignment_check"]
    return DATA_CARD.format(
        table="\n".join(lines), share=check["share"], checked=check["checked"],
        unequal=check["unequal_count_pages_share"], pages=info["pages"], options=info["options"],
        valid_percent=info["options"]["valid_permille"] / 10)


DATA_CARD = """# Demo fine-tuning tasks (LibreOffice Help)

Two small task sets built from the bundled demo corpus (`data/demo/libreoffice-help`), for fine-tuning
and evaluating a MARGE model on the demo's languages (en, de, fr, es, it, ru, zh, ja). Generated by
`services/prepare/demo_tasks.py`; do not edit by hand.

## Tasks

* **translation/** — paragraph translation, English → German and German → English. One JSON object per
  line: `{{"id", "source", "target", "source_language", "target_language"}}`.
* **pawsx/** — a PAWS-X-like pair classification: is `text_pair` a translation of the English `text`
  (`"label": "translation"`), or a paragraph in the same language from the neighbouring page in
  page-path order, at the same paragraph position (`"label": "other"`; usually a related page of the
  same help folder)? One JSON object per line: `{{"id", "text", "text_pair", "label", "language",
  "pair_language"}}`. Labels are balanced 50/50 within each split and language pair. train and valid
  are en–de only; test has en–de (the supervised pair) and en–fr, en–es, en–it, en–ru, en–zh, en–ja
  (zero-shot cross-lingual transfer).

| file | rows | per language pair |
|---|---|---|
{table}

## How it was built

* Splits are by page: test = the corpus's held-out pages ({pages[test]}); valid = the training pages
  whose sha256(page path) falls in the first {valid_percent:g}% ({pages[valid]}); train = the other training pages
  ({pages[train]}). No page is in two splits.
* Paragraphs align by index on pages whose English and other-language versions have the same number
  of paragraphs (the corpus dropped untranslated paragraphs, so other pages would be misaligned).
  Checked against the corpus's id-aligned `heldout_pairs.tsv`: {share:.1%} of {checked} checkable
  held-out pairs confirmed (on pages with unequal counts, the same index gives only {unequal:.1%}).
* Filters: paragraphs of {options[min_chars]}–{options[max_chars]} characters; source ≠ target
  (untranslated); a length ratio within {options[max_length_deviation]:g}× of the language's usual
  one. In translation an English paragraph is used once per split and direction; in pawsx twice per
  split and language pair (with its translation, and with a nearby paragraph of another page, so the
  label can only be told from the pair). Never when its text occurs on a page of an earlier split
  (train → valid → test), so repeated boilerplate does not leak.
* Caps (seeded samples, seed {options[seed]}), train / valid / test: translation
  {options[translation_caps][train]} / {options[translation_caps][valid]} / {options[translation_caps][test]}
  pairs per direction; pawsx {options[pawsx_caps][train]} / {options[pawsx_caps][valid]} /
  {options[pawsx_caps][test]} rows per language pair. They keep this folder small enough to commit.
  Counts, filter statistics and the source files' sha256 are in `build_info.json`.

Rebuild (byte-identical for the same corpus and seed):

```bash
python -m services.prepare.demo_tasks --corpus data/demo/libreoffice-help --out data/demo/tasks --overwrite
```

## Licence

The text is LibreOffice Help, © The Document Foundation and contributors, under the Mozilla Public
License 2.0 (https://www.mozilla.org/MPL/2.0/); small parts are Apache-2.0. See
`data/demo/libreoffice-help/ATTRIBUTION.md`.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.prepare.demo_tasks", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=Path("data/demo/libreoffice-help"),
                   help="demo corpus folder (documents.jsonl.gz, heldout_documents.jsonl.gz, heldout_pairs.tsv)")
    p.add_argument("--out", type=Path, default=Path("data/demo/tasks"), help="output folder (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples and the positive/negative choice")
    args = p.parse_args(argv)
    setup_logging()
    try:
        info = build_demo_tasks(DemoTasksOptions(corpus=args.corpus, out=args.out, overwrite=args.overwrite,
                                                 seed=args.seed))
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"out": str(args.out), "counts": {k: v["rows"] for k, v in info["counts"].items()},
                      "alignment_share": info["alignment_check"]["share"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
