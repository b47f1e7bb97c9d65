"""A corpus of one's own, written here, run from the shell the way the README's quickstart runs it, from a folder where
no demo file can be reached: `marge prepare` -> `marge pretrain --single-process` (then resumed, then refused with a
changed setting) -> `marge audit` and `marge serve` answering in one line -> `marge eval retrieval` -> `marge.load`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "deploy" / "configs" / "own-corpus.yaml"

# word-for-word translations: enough for a tokenizer, held-out pairs in every direction, and retrieval to score
WORDS = {
    "en": {"the": "the", "nouns": ["house", "river", "garden", "window", "teacher", "city", "table", "letter", "train", "bridge",
                                   "mountain", "kitchen"],
           "adjectives": ["old", "green", "small", "quiet", "bright", "cold"],
           "verbs": ["sees", "builds", "opens", "paints", "finds", "closes"]},
    "de": {"the": "das", "nouns": ["Haus", "Fluss", "Garten", "Fenster", "Lehrer", "Stadt", "Tisch", "Brief", "Zug", "Brücke",
                                   "Berg", "Küche"],
           "adjectives": ["alte", "grüne", "kleine", "stille", "helle", "kalte"],
           "verbs": ["sieht", "baut", "öffnet", "malt", "findet", "schließt"]},
    "fr": {"the": "le", "nouns": ["maison", "rivière", "jardin", "fenêtre", "professeur", "ville", "table", "lettre", "train",
                                  "pont", "montagne", "cuisine"],
           "adjectives": ["vieux", "vert", "petit", "calme", "clair", "froid"],
           "verbs": ["voit", "construit", "ouvre", "peint", "trouve", "ferme"]},
}


def own_documents(groups: int = 160, seed: int = 0) -> list[dict]:
    """Pages in en/de/fr, each a few paragraphs of sentences built from the same random choices in every language."""
    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        plan = [[(rng.randrange(6), rng.randrange(12), rng.randrange(6), rng.randrange(12), g % 7)
                 for _ in range(rng.randint(2, 4))] for _ in range(rng.randint(2, 3))]
        for lang, w in WORDS.items():
            paragraphs = [" ".join(f"{w['the'].capitalize()} {w['adjectives'][a]} {w['nouns'][n]} {w['verbs'][v]} "
                                   f"{w['the']} {w['nouns'][m]} {k + 1}." for a, n, v, m, k in paragraph)
                          for paragraph in plan]
            rows.append({"id": f"page{g}-{lang}", "group": f"page{g}", "language": lang, "text": "\n\n".join(paragraphs)})
    return rows


def marge(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'shared'}:{REPO}"}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


SMALL = ["data.corpus=corpus", "run.dir=run", "model.max_positions=128", "batcher.max_tokens=400",
         "trainer.num_workers=1", "trainer.snapshot_every=2", "indexer.reindex_every=2", "trainer.checkpoint_every=2",
         "trainer.warmup_steps=2", "trainer.total_steps=100", "objectives.self_evidence.until=4",
         "objectives.marge.detach_relevance_until=2", "health.probe_size=4", "health.pairs_per_language=8",
         "run.progress_every_s=1", "indexer.keep_snapshots=1", "indexer.keep_versions=2", "trainer.keep_checkpoints=1"]


@pytest.mark.slow
def test_own_corpus_from_the_shell_with_no_demo_file_in_reach(tmp_path):
    work = tmp_path / "work"  # the current directory of every command: no data/demo under it
    work.mkdir()
    (work / "mine.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in own_documents()),
                                     encoding="utf-8")
    prepared = marge("prepare", "mine.jsonl", "--out", "corpus", "--vocab-size", "400", "--max-chunk-tokens", "128",
                     "--document-unit", "paragraph", "--heldout-permille", "250", cwd=work)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    manifest = json.loads((work / "corpus" / "manifest.json").read_text())
    assert manifest["heldout"]["groups"] >= 30 and "WARNING" not in prepared.stderr, prepared.stderr[-3000:]

    first = marge("pretrain", "--config", str(TEMPLATE), "--single-process", "--device", "cpu", *SMALL,
                  "run.max_steps=4", cwd=work)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["pipeline"]["steps"] == 4 and Path(summary["report"]).is_file()
    assert summary["g_health"]["directions"] == 6  # en, de, fr both ways: the corpus's own held-out split
    assert "held-out retrieval P@1: from the corpus's held-out split" in first.stderr
    assert "demo" not in (work / "run" / "config.yaml").read_text()
    probes = json.loads(Path(summary["report"]).read_text())["config"]
    assert probes["data"]["heldout_pairs"] == str(work / "corpus" / "heldout" / "pairs.tsv")
    assert probes["health"]["documents"] == str(work / "corpus" / "heldout" / "documents.jsonl.gz")

    resumed = marge("pretrain", "--config", str(TEMPLATE), "--single-process", "--device", "cpu", *SMALL,
                    "run.max_steps=8", cwd=work)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert "resumed at step 4" in resumed.stderr and summary["pipeline"]["steps"] == 8
    # snapshots no one needs again are gone: kept are step 0 (the verdict's baseline), the kept index versions' (6, 8)
    # and those from the version the oldest kept checkpoint (6) resumes with; step 2's version is gone and older
    snapshots = {int(p.name[5:]) for p in (work / "run" / "snapshots").glob("step-*")}
    assert {0, 6, 8} <= snapshots and 2 not in snapshots, snapshots
    changed = marge("pretrain", "--config", str(TEMPLATE), "--single-process", "--device", "cpu", *SMALL,
                    "run.max_steps=8", "trainer.lr=0.01", cwd=work)
    assert changed.returncode != 0 and "trainer.lr: 0.001 -> 0.01" in changed.stderr, changed.stderr[-3000:]

    audit = marge("audit", "--run", "run", cwd=work, timeout=120)
    serve = marge("serve", "--run", "run", cwd=work, timeout=120)
    for answer in (audit, serve):
        lines = [line for line in answer.stderr.splitlines() + answer.stdout.splitlines() if line.strip()]
        assert len(lines) == 1 and "single-process" in lines[0] and "Traceback" not in answer.stderr, lines

    # what serves a single-process run: a serving index of the whole corpus (`marge serve --full-corpus` loads it)
    built = marge("index", "build", "--run", "run", "--target-recall", "0.5", cwd=work, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert json.loads(built.stdout.strip().splitlines()[-1])["documents"] == manifest["num_documents"]

    checkpoint = summary["checkpoint"]
    retrieval = marge("eval", "retrieval", "--pairs", str(work / "corpus" / manifest["heldout"]["pairs_file"]), "--checkpoint", checkpoint, "--layer", "g", "--json", cwd=work, timeout=300)
    assert retrieval.returncode == 0, retrieval.stderr[-3000:]
    loaded = subprocess.run([sys.executable, "-c", "import marge, sys; print(type(marge.load(sys.argv[1])).__name__)",
                             checkpoint], cwd=work, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": f"{REPO / 'shared'}:{REPO}"})
    assert loaded.stdout.strip() == "PretrainedModel", loaded.stderr[-3000:]
