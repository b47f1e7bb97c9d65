"""`marge eval retrieval|translate`, `marge translate` and `marge report` on a small real checkpoint and run."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from marge.contracts.train_log import TRAIN_LOG, TrainLog, UpdateRecord
from services.cli import main


@pytest.fixture(scope="module")
def trained(small_corpus, tmp_path_factory, demo_raw):
    """A run directory and checkpoint from a few in-process steps on the small corpus."""
    from marge.contracts.corpus import Corpus
    from marge.model.architecture import preset
    from marge.model.checkpoint import save_checkpoint
    from marge.model.network import Marge
    from marge.model.snapshot import load_relevance_encoder, publish_snapshot
    from services.batcher.config import BatcherConfig
    from services.batcher.core import DocumentStore, epoch_batches
    from services.indexer.config import IndexerConfig
    from services.indexer.core import index_corpus
    from services.trainer.config import TrainerConfig
    from services.trainer.objectives import Objectives, ObjectivesConfig
    from services.trainer.step import Trainee, build_optimizer, build_scheduler, train_step

    root = tmp_path_factory.mktemp("trained")
    run = root / "run"
    corpus = Corpus.open(small_corpus)
    tok = corpus.tokenizer()
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=tok.vocab_size, max_positions=128))
    snap = publish_snapshot(run / "snapshots", model, 0, tok.sha256)
    index = index_corpus(corpus, load_relevance_encoder(snap), tok.specials, run / "index", 0, 0, IndexerConfig())
    batches = list(epoch_batches(index, DocumentStore(corpus), BatcherConfig(max_tokens=400), 0))[:16]
    cfg = TrainerConfig(lr=2e-3, warmup_steps=2)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, 8)
    objectives = Objectives(ObjectivesConfig(), tok.specials)
    records = [train_step(Trainee.in_process(model, optimizer, scheduler, objectives, cfg, torch.device("cpu")),
                          batches[i:i + 2], i // 2)
               for i in range(0, 16, 2)]
    publish_snapshot(run / "snapshots", model, 8, tok.sha256)
    log = TrainLog(run / TRAIN_LOG)
    for r in records:
        log.append(UpdateRecord(step=r.step + 1, loss=r.loss, lr=r.lr, grad_norm=r.grad_norm, batch_ids=r.batch_ids,
                                beta=r.beta, index_versions=r.index_versions, snapshot_steps=r.snapshot_steps,
                                objectives=r.objectives, target_tokens=r.target_tokens, step_seconds=r.seconds))
    pairs = root / "pairs.tsv"
    lines = (demo_raw / "heldout_pairs.tsv").read_text(encoding="utf-8").splitlines()
    by_lang: dict[str, list[str]] = {}
    for line in lines:
        by_lang.setdefault(line.split("\t")[2], []).append(line)
    pairs.write_text("".join(line + "\n" for lang in ("de", "zh") for line in by_lang[lang][:30]), encoding="utf-8")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"corpus": str(small_corpus), "heldout_pairs": str(pairs)},
                                                     "indexer": {"links_monolingual": 4, "links_crosslingual": 4,
                                                                 "candidates_per_language": 32}}))
    checkpoint = save_checkpoint(root / "checkpoint", model, optimizer, scheduler, 8, small_corpus,
                                 {"consumed_batches": [b.batch_id for b in batches], "tokens_seen": 0})
    docs = root / "docs.jsonl.gz"
    with gzip.open(demo_raw / "heldout_documents.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    groups = sorted({r["group"] for r in rows if r["language"] == "de"})[:3]
    with gzip.open(docs, "wt", encoding="utf-8") as f:
        for r in rows:
            if r["group"] in groups and r["language"] in ("en", "de"):
                f.write(json.dumps({**r, "text": r["text"][:200]}, ensure_ascii=False) + "\n")
    return {"run": run, "checkpoint": checkpoint, "pairs": pairs, "docs": docs, "corpus": small_corpus}


def run_json(args: list[str], capsys) -> dict:
    assert main(args) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_retrieval_json_and_compare(trained, capsys):
    tfidf = run_json(["eval", "retrieval", "--pairs", str(trained["pairs"]), "--tfidf", "--json"], capsys)
    assert set(tfidf) == {"en->de", "de->en", "en->zh", "zh->en"}
    assert all(0 <= v <= 1 for v in tfidf.values()) and tfidf["en->de"] > 1 / 30
    model = run_json(["eval", "retrieval", "--pairs", str(trained["pairs"]), "--checkpoint", str(trained["checkpoint"]),
                      "--json", "--layer", "2"], capsys)
    assert set(model) == set(tfidf)
    both = run_json(["eval", "retrieval", "--pairs", str(trained["pairs"]), "--checkpoint", str(trained["checkpoint"]),
                     "--compare", "--json", "--margin"], capsys)
    assert set(both) == {"trained", "random_init", "tfidf"} and set(both["random_init"]) == set(tfidf)
    assert main(["eval", "retrieval", "--pairs", str(trained["pairs"]), "--checkpoint", str(trained["checkpoint"])]) == 0
    table = capsys.readouterr().out
    assert "en->zh" in table and "mean" in table


def test_eval_retrieval_errors(trained, tmp_path, capsys):
    assert main(["eval", "retrieval", "--pairs", str(trained["pairs"])]) == 2
    assert "give --checkpoint PATH" in capsys.readouterr().err
    assert main(["eval", "retrieval", "--pairs", str(trained["pairs"]), "--checkpoint", str(tmp_path)]) == 2
    assert "not a complete MARGE checkpoint" in capsys.readouterr().err


def test_eval_translate_and_translate(trained, capsys, monkeypatch, tmp_path):
    from marge.eval.evaluation import read_document_pairs
    from marge.model.finetuned import generation_scores

    hypotheses = tmp_path / "hyp.txt"
    monkeypatch.setenv("MARGE_PROGRESS", "bar")  # as on a terminal: a bar while it translates, not minutes of silence
    assert main(["eval", "translate", "--checkpoint", str(trained["checkpoint"]), "--docs", str(trained["docs"]),
                 "--src", "en", "--tgt", "de", "--beam", "2", "--max-len-a", "0.2", "--max-len-b", "5", "--json",
                 "--out", str(hypotheses)]) == 0
    printed = capsys.readouterr()
    result = json.loads(printed.out.strip().splitlines()[-1])
    assert "translating en->de" in printed.err and "/3 " in printed.err  # the documents to go
    assert result["documents"] == 3 and result["beam"] == 2
    # the scores are sacrebleu's of the translations it wrote against the documents' references
    references = [ref for _, ref in read_document_pairs(Path(trained["docs"]), "en", "de", None)][:3]
    written = hypotheses.read_text(encoding="utf-8").splitlines()
    assert len(written) == 3
    expected = generation_scores(written, references, "de")
    assert result["bleu"] == pytest.approx(expected["bleu"]) and result["chrf"] == pytest.approx(expected["chrf"])
    monkeypatch.setattr("sys.stdin", io.StringIO("Open the file.\nChoose Format - Cells.\n"))
    assert main(["translate", "--checkpoint", str(trained["checkpoint"]), "--tgt-lang", "de", "--beam", "2",
                 "--max-len-b", "4", "--max-len-a", "0"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2  # one line per input line (a barely trained model may say little)


def test_report_writes_link_matrix_and_curves(trained, tmp_path, capsys):
    out = tmp_path / "report"
    report = run_json(["report", "--run", str(trained["run"]), "--out", str(out), "--max-snapshots", "2"], capsys)
    for name in ("link_matrix.csv", "link_matrix.png", "curves.png", "report.json"):
        assert (out / name).stat().st_size > 0
    shares = np.array(report["link_matrix"])
    np.testing.assert_allclose(shares.sum(axis=1), 1.0, atol=1e-3)
    assert len(report["languages"]) >= 8
    assert [c["step"] for c in report["snapshot_p_at_1"]] == [0, 8]
    rows = (out / "link_matrix.csv").read_text().splitlines()
    assert rows[0].startswith("target_lang,") and len(rows) == len(report["languages"]) + 1
    # the matrix of a checkpoint's own index
    report = run_json(["report", "--run", str(trained["run"]), "--out", str(tmp_path / "r2"), "--checkpoint",
                       str(trained["checkpoint"]), "--max-snapshots", "1"], capsys)
    assert report["source"].startswith("index of checkpoint")
    assert report["refresh"]["per_version"] == []  # this run's indexer wrote no build records


def test_report_shows_what_each_index_refresh_cost(trained, tmp_path, capsys):
    import shutil

    from marge.eval.refresh import append_build

    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    append_build(run, {"version": 0, "snapshot_step": 0, "started_unix": 0.0, "finished_unix": 1.0, "seconds": 1.0,
                       "indexer_workers": 1})
    report = run_json(["report", "--run", str(run), "--out", str(tmp_path / "r"), "--max-snapshots", "1"], capsys)
    # the fixture's updates trained on version 0 from update 1; no shard list recorded, none trained by a sampled build
    assert report["refresh"]["per_version"] == [{"version": 0, "snapshot_step": 0, "build_seconds": 1.0,
                                                 "indexer_workers": 1, "steps_during_build": 0, "first_use_step": 1,
                                                 "shards_embedded": None, "shards_trained": 0,
                                                 "staleness_at_first_use": 1}]
    assert (tmp_path / "r" / "curves.png").stat().st_size > 0


def test_a_veco_checkpoint_is_evaluated_for_retrieval_and_refused_for_translation(small_corpus, few_pairs, tmp_path,
                                                                                 capsys, monkeypatch):
    """`load_model` builds a VECO checkpoint as `Veco`: the retrieval sweep takes it, translation says why not."""
    from marge.contracts.corpus import Corpus
    from marge.model.checkpoint import save_checkpoint
    from marge.model.veco import Veco, veco_preset
    from services.trainer.config import TrainerConfig
    from services.trainer.step import build_optimizer, build_scheduler

    torch.manual_seed(0)
    model = Veco(veco_preset("tiny", vocab_size=Corpus.open(small_corpus).tokenizer().vocab_size, max_positions=128))
    optimizer = build_optimizer(model, TrainerConfig())
    checkpoint = save_checkpoint(tmp_path / "veco", model, optimizer, build_scheduler(optimizer, TrainerConfig(), 10),
                                 0, small_corpus, {})
    both = run_json(["eval", "retrieval", "--checkpoint", str(checkpoint), "--pairs", str(few_pairs), "--layer", "2",
                     "--compare", "--json"], capsys)  # random init: a fresh Veco of the checkpoint's shape
    assert "en->de" in both["trained"] and set(both["random_init"]) == set(both["trained"])
    assert all(0 <= v <= 1 for v in both["trained"].values())
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello.\n"))
    assert main(["translate", "--checkpoint", str(checkpoint), "--tgt-lang", "de"]) != 0
    assert "holds a Veco model, an encoder that cannot generate" in capsys.readouterr().err


def test_the_python_api_example_in_the_docs_runs(trained, capsys):
    """docs/python-api.md's example, run as written on a small checkpoint (only the checkpoint path changed)."""
    import re

    from marge.eval.evaluation import read_pairs

    doc = (Path(__file__).resolve().parents[2] / "docs" / "python-api.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    code = re.sub(r'checkpoint = ".*"', f"checkpoint = {str(trained['checkpoint'])!r}", code)
    exec(compile(code, "docs/python-api.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("f = ") and -1.0 <= float(out[0][4:]) <= 1.0
    assert out[1] == "(1, 64)" and len(out) == 3

    import marge

    model = marge.load(trained["checkpoint"])
    assert type(model).__name__ == "PretrainedModel" and model.task is None and "PretrainedModel(" in repr(model)
    pairs = read_pairs(trained["pairs"], model.tokenizer.languages)[0]
    g = model.relevance(pairs.sources[:4])
    assert g.shape == (4, model.model.cfg.d_model) and np.allclose(np.linalg.norm(g, axis=1), 1.0, atol=1e-5)
    from marge.model.embedding import encode_texts, relevance_unit_vectors

    rows = encode_texts(model.tokenizer, pairs.sources[:4], model.model.cfg.max_positions)
    assert np.allclose(g, relevance_unit_vectors(model.model, rows, model.tokenizer.specials), atol=1e-6)
