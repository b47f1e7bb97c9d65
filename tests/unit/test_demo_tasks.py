"""`services.prepare.demo_tasks` (`marge prepare-tasks`): the demo fine-tuning tasks are deterministic, split by
page, balanced and well formed."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from services.prepare.demo_tasks import DemoTasksOptions, build_demo_tasks, main

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "demo" / "libreoffice-help"
COMMITTED = REPO / "data" / "demo" / "tasks"
SPLITS = ("train", "valid", "test")
ALL_PAIRS = {"en-de", "en-fr", "en-es", "en-it", "en-ru", "en-zh", "en-ja"}
SCHEMAS = {
    "translation": {"id", "source", "target", "source_language", "target_language"},
    "pawsx": {"id", "text", "text_pair", "label", "language", "pair_language"},
}
MAX_FOLDER_BYTES = 2_500_000


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def read_rows(folder: Path, task: str, split: str) -> list[dict]:
    return [json.loads(line) for line in (folder / task / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]


def page_of(row_id: str) -> str:
    """"test:en-de:text/shared/01/0110#3" -> "text/shared/01/0110"."""
    return row_id.split(":", 2)[2].rsplit("#", 1)[0]


def corpus_pages(name: str) -> dict[str, dict[str, set[str]]]:
    """{page: {language: paragraphs}}, read here independently of the module under test."""
    pages: dict[str, dict[str, set[str]]] = defaultdict(dict)
    with gzip.open(CORPUS / name, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            pages[row["group"]][row["language"]] = set(row["text"].split("\n\n"))
    return pages


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tasks") / "tasks"
    return out, build_demo_tasks(DemoTasksOptions(corpus=CORPUS, out=out))


def test_builds_are_byte_identical_and_match_the_committed_files(built, tmp_path):
    out, _ = built
    again = tmp_path / "again"
    build_demo_tasks(DemoTasksOptions(corpus=CORPUS, out=again))
    first = files_of(out)
    assert set(first) == {f"{t}/{s}.jsonl" for t in SCHEMAS for s in SPLITS} | {"build_info.json", "README.md"}
    assert files_of(again) == first
    committed = files_of(COMMITTED)
    assert set(committed) == set(first), "data/demo/tasks is stale: rebuild it (see its README.md)"
    stale = [name for name in first if committed[name] != first[name]]
    assert not stale, f"data/demo/tasks is stale ({stale}): rebuild it (see its README.md)"


def test_committed_folder_is_small():
    assert sum(len(b) for b in files_of(COMMITTED).values()) <= MAX_FOLDER_BYTES


def test_every_row_has_the_schema(built):
    out, _ = built
    for task, keys in SCHEMAS.items():
        for split in SPLITS:
            rows = read_rows(out, task, split)
            assert rows, f"{task}/{split} is empty"
            for row in rows:
                assert set(row) == keys, (task, split, row)
                assert all(isinstance(v, str) and v.strip() for v in row.values()), (task, split, row)
            assert len({r["id"] for r in rows}) == len(rows), f"{task}/{split}: duplicate ids"
    for split in SPLITS:
        for row in read_rows(out, "translation", split):
            assert row["source"] != row["target"]
        for row in read_rows(out, "pawsx", split):
            assert row["label"] in ("translation", "other") and row["language"] == "en"


def test_splits_are_disjoint_by_page_and_every_text_comes_from_its_split(built):
    out, _ = built
    training, heldout = corpus_pages("documents.jsonl.gz"), corpus_pages("heldout_documents.jsonl.gz")
    in_valid = {g for g in training if int.from_bytes(hashlib.sha256(g.encode()).digest()[:8], "big") % 1000 < 100}
    split_pages = {"train": {g: p for g, p in training.items() if g not in in_valid},
                   "valid": {g: p for g, p in training.items() if g in in_valid},
                   "test": heldout}
    pages_used = {}
    for split in SPLITS:
        paragraphs = defaultdict(set)  # language -> every paragraph of this split's pages
        for page in split_pages[split].values():
            for lang, paras in page.items():
                paragraphs[lang] |= paras
        used = set()
        for row in read_rows(out, "translation", split):
            used.add(page_of(row["id"]))
            assert split_pages[split][page_of(row["id"])][row["source_language"]] >= {row["source"]}
            assert split_pages[split][page_of(row["id"])][row["target_language"]] >= {row["target"]}
        for row in read_rows(out, "pawsx", split):
            used.add(page_of(row["id"]))
            assert row["text"] in split_pages[split][page_of(row["id"])]["en"]
            # a negative's text comes from another page, but of the same split
            assert row["text_pair"] in paragraphs[row["pair_language"]], (split, row["id"])
        pages_used[split] = used
    assert not pages_used["train"] & pages_used["valid"]
    assert not pages_used["train"] & pages_used["test"]
    assert not pages_used["valid"] & pages_used["test"]


def test_pawsx_labels_are_balanced_and_each_english_paragraph_has_both_labels(built):
    """The label must depend on the pair: every English paragraph appears exactly twice per language pair,
    once as "translation" and once as "other", so no model can read the label off the text alone."""
    out, _ = built
    for split in SPLITS:
        rows = read_rows(out, "pawsx", split)
        assert len({r["id"] for r in rows}) == len(rows), f"pawsx/{split}: repeated ids"
        labels: Counter = Counter()
        text_labels: dict[tuple[str, str], list[str]] = defaultdict(list)
        for row in rows:
            pair = f"{row['language']}-{row['pair_language']}"
            labels[pair, row["label"]] += 1
            text_labels[pair, row["text"]].append(row["label"])
            assert row["text_pair"] != row["text"]
        for pair in {p for p, _ in labels}:
            assert labels[pair, "translation"] == labels[pair, "other"] > 0, (split, pair, labels)
        for key, seen in text_labels.items():
            assert sorted(seen) == ["other", "translation"], (split, key, seen)


def test_language_pairs_and_caps(built):
    out, info = built
    opts = DemoTasksOptions()
    for s, split in enumerate(SPLITS):
        pawsx = Counter(f"{r['language']}-{r['pair_language']}" for r in read_rows(out, "pawsx", split))
        assert set(pawsx) == (ALL_PAIRS if split == "test" else {"en-de"})
        assert max(pawsx.values()) <= opts.pawsx_caps[s]
        translation = Counter(f"{r['source_language']}-{r['target_language']}"
                              for r in read_rows(out, "translation", split))
        assert set(translation) == {"en-de", "de-en"}
        assert max(translation.values()) <= opts.translation_caps[s]
        assert info["counts"][f"pawsx/{split}.jsonl"]["rows"] == sum(pawsx.values())
        assert info["counts"][f"translation/{split}.jsonl"]["per_language_pair"] == dict(translation)


def test_index_alignment_is_confirmed_by_the_id_aligned_pairs(built):
    out, info = built
    check = info["alignment_check"]
    assert check["checked"] >= 100, "too few held-out pairs to judge the alignment"
    assert check["share"] >= 0.9
    # the contrast that justifies using equal-count pages only
    assert check["unequal_count_pages_share"] < 0.5
    assert json.loads((out / "build_info.json").read_text(encoding="utf-8")) == info


def test_existing_out_dir_is_not_replaced_without_overwrite(built, tmp_path, capsys):
    out, _ = built
    before = files_of(out)
    with pytest.raises(FileExistsError, match=str(out)):
        build_demo_tasks(DemoTasksOptions(corpus=CORPUS, out=out))
    assert files_of(out) == before
    assert main(["--corpus", str(CORPUS), "--out", str(out)]) == 1
    assert str(out) in capsys.readouterr().err
    build_demo_tasks(DemoTasksOptions(corpus=CORPUS, out=out, overwrite=True))
    assert files_of(out) == before


def test_missing_corpus_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="documents.jsonl.gz"):
        build_demo_tasks(DemoTasksOptions(corpus=tmp_path, out=tmp_path / "out"))
