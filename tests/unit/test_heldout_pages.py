"""The pages a held-out interval resamples: the groups `marge prepare` records beside each held-out pair.

The corpus here is what a verse- or section-aligned corpus without paragraph ids looks like: every document is
several paragraphs, so prepare pairs whole documents and no pair's text is one paragraph of a held-out page."""

from __future__ import annotations

import gzip
import json
import logging

import numpy as np
import pytest
import torch
from prepare_inputs import write_jsonl  # tests/prepare_inputs.py

from marge.eval.evaluation import (
    PairsError,
    clustered_bootstrap,
    own_page_pairs,
    page_sums,
    pair_pages,
    read_pairs,
)
from services.prepare.options import PrepareOptions
from services.prepare.run import prepare

WORDS = {
    "en": "the cell sheet column row sum value formula chart page table text file menu window button".split(),
    "de": "die Zelle Tabelle Spalte Zeile Summe Wert Formel Diagramm Seite Datei Menü Fenster Knopf Text".split(),
    "fr": "la cellule feuille colonne ligne somme valeur formule graphique page fichier menu fenêtre bouton".split(),
}
GROUPS = 60


def page_text(lang: str, group: int, rng: np.random.Generator) -> str:
    """Three paragraphs (a blank line between them), each unique to its page and language."""
    return "\n\n".join(" ".join(rng.choice(WORDS[lang], size=10)) + f" {lang} {group} {k}." for k in range(3))


@pytest.fixture(scope="module")
def chunk_corpus(tmp_path_factory):
    """(corpus folder, manifest, held-out group names) of a prepared corpus whose held-out pairs are whole
    multi-paragraph documents."""
    root = tmp_path_factory.mktemp("chunk-corpus")
    rng = np.random.default_rng(0)
    rows = [{"id": f"p{g}-{lang}", "group": f"page {g}", "language": lang, "text": page_text(lang, g, rng)}
            for g in range(GROUPS) for lang in WORDS]
    raw = write_jsonl(root / "raw.jsonl", rows)
    manifest = prepare(PrepareOptions(inputs=[raw], out=root / "corpus", vocab_size=400, heldout_permille=400,
                                      lid=False, engine="local"))
    with gzip.open(root / "corpus" / manifest["heldout"]["documents_file"], "rt", encoding="utf-8") as f:
        held = {json.loads(line)["group"] for line in f}
    return root / "corpus", manifest, held


def heldout(corpus, manifest, kind: str):
    return corpus / manifest["heldout"][f"{kind}_file"]


def test_the_interval_resamples_the_held_out_groups_prepare_recorded_not_one_page_per_pair(chunk_corpus, caplog):
    corpus, manifest, held = chunk_corpus
    pairs = read_pairs(heldout(corpus, manifest, "pairs"))
    n_pairs = sum(len(p.sources) for p in pairs)
    assert 10 <= len(held) == manifest["heldout"]["groups"] and n_pairs == 3 * len(held)  # en-de, en-fr, de-fr
    assert all(text.count(".") == 3 for p in pairs for text in p.sources)  # each pair: a page's three paragraphs
    with caplog.at_level(logging.WARNING, logger="marge.eval.evaluation"):
        pages = pair_pages(pairs, heldout(corpus, manifest, "documents"))
    resampled = {p for v in pages.values() for p in v.tolist()}
    assert resampled == held, f"{len(resampled)} pages resampled for {len(held)} held-out groups ({n_pairs} pairs)"
    assert own_page_pairs(pages) == 0 and not caplog.records
    index = {p: i for i, p in enumerate(sorted(resampled))}
    sums, counts = page_sums({k: np.ones(len(v)) for k, v in pages.items()}, pages, index)
    assert len(counts) == len(held) and set(counts.tolist()) == {6.0}  # 3 pairs a page, read both ways
    assert clustered_bootstrap(sums, counts)["mean"] == 1.0
    lines = heldout(corpus, manifest, "pairs").read_text(encoding="utf-8").splitlines()
    assert all(len(line.split("\t")) == 5 and line.split("\t")[4] in held for line in lines)


def test_an_old_pairs_file_without_groups_finds_whole_documents_and_counts_the_pairs_it_cannot_place(
        chunk_corpus, tmp_path, caplog):
    corpus, manifest, held = chunk_corpus
    lines = heldout(corpus, manifest, "pairs").read_text(encoding="utf-8").splitlines()
    old = tmp_path / "pairs.tsv"  # as prepare wrote it before it recorded groups: four fields
    old.write_text("".join("\t".join(line.split("\t")[:4]) + "\n" for line in lines), encoding="utf-8")
    pairs = read_pairs(old)
    pages = pair_pages(pairs, heldout(corpus, manifest, "documents"))
    assert {p for v in pages.values() for p in v.tolist()} == held and own_page_pairs(pages) == 0
    assert all(p.groups is not None and set(p.groups) == {None} for p in pairs)
    cells = lines[0].split("\t")  # a pair whose texts no held-out document has: a page of its own, said aloud
    old.write_text("".join("\t".join(line.split("\t")[:4]) + "\n" for line in lines[1:])
                   + f"{cells[0]}\tan edited source\t{cells[2]}\tan edited target\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="marge.eval.evaluation"):
        pages = pair_pages(read_pairs(old), heldout(corpus, manifest, "documents"))
    assert own_page_pairs(pages) == 1
    assert any(f"1 of {len(lines)} held-out pairs have no known page" in r.getMessage() for r in caplog.records)


def test_g_health_line_says_how_many_pairs_were_resampled_as_their_own_page(chunk_corpus, tmp_path, caplog):
    from marge.contracts.corpus import Corpus
    from marge.model.architecture import preset
    from marge.model.network import Marge, RelevanceEncoder
    from services.trainer.health import centre_rows, describe_g_health, g_health

    corpus, manifest, held = chunk_corpus
    tokenizer = Corpus.open(corpus).tokenizer()
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=tokenizer.vocab_size, max_positions=256, relevance_pooling="mean",
                 relevance_layers=1, relevance_centering=True)
    trained, initial = (RelevanceEncoder.from_model(Marge(cfg)).eval() for _ in range(2))
    centre = centre_rows(Corpus.open(corpus), size=32)
    pairs = read_pairs(heldout(corpus, manifest, "pairs"), tokenizer.languages)
    recorded = g_health(trained, [initial], tokenizer, pairs, centre,
                        pair_pages(pairs, heldout(corpus, manifest, "documents")), resamples=200)
    assert recorded["pages"] == len(held) and recorded["pairs_own_page"] == 0
    assert f"over {len(held)} held-out pages | " in describe_g_health(recorded)
    lines = heldout(corpus, manifest, "pairs").read_text(encoding="utf-8").splitlines()
    old = tmp_path / "pairs.tsv"
    old.write_text("".join("\t".join(line.split("\t")[:4]) + "\n" for line in lines), encoding="utf-8")
    unplaced = read_pairs(old, tokenizer.languages)
    with caplog.at_level(logging.WARNING, logger="marge.eval.evaluation"):
        alone = g_health(trained, [initial], tokenizer, unplaced, centre, resamples=200)  # no pages, no documents
    assert alone["pages"] == alone["pairs_own_page"] == len(lines)
    line = describe_g_health(alone)
    assert f"over {len(lines)} held-out pages ({len(lines)} of them a single pair whose page is unknown" in line, line
    assert any("held-out pairs have no known page" in r.getMessage() for r in caplog.records)


def test_read_pairs_takes_an_optional_group_field_and_names_a_bad_one(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("en\tOpen the file.\tde\tÖffnen Sie die Datei.\tpage 1\n"
                    "en\tClose the file.\tde\tSchließen Sie die Datei.\n", encoding="utf-8")
    [pair] = read_pairs(path)
    assert pair.groups == ["page 1", None]
    path.write_text("en\tOpen the file.\tde\tÖffnen Sie die Datei.\t \n", encoding="utf-8")
    with pytest.raises(PairsError, match=r"pairs\.tsv:1: empty group \(field 5\)"):
        read_pairs(path)
    path.write_text("en\tOpen the file.\tde\tÖffnen Sie die Datei.\tpage 1\tmore\n", encoding="utf-8")
    with pytest.raises(PairsError, match=r"pairs\.tsv:1: expected 4 .* or 5 \(and the pair's group\), found 6"):
        read_pairs(path)


def test_own_page_labels_are_counted_in_measures_written_before_they_were_marked():
    pages = {"en->de": np.array(["page 1", "own page: en-de#1", "en-de#2"], dtype=object)}
    assert own_page_pairs(pages) == 2
