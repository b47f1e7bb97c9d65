"""Fine-tuning (`marge finetune`, `marge eval finetuned`, `marge.model.finetuned`): the classification head, freezing,
a generation fine-tune that overfits, bad input, reloading, DDP on Ray Train.

These need a server or take long; the quick tests of this subject are in tests/unit/test_finetune.py (no server)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from marge.contracts.tasks import TaskDataError, read_task_file
from marge.model.architecture import preset
from marge.model.finetuned import MargeForClassification, load, own_input_memory
from marge.model.network import Marge
from services.cli import main
from services.finetune.run import FinetuneConfig, Finetuning, run_finetune

TASKS = Path(__file__).resolve().parents[2] / "data" / "demo" / "tasks"


@pytest.fixture(scope="module")
def checkpoint(small_corpus, tmp_path_factory) -> Path:
    """A tiny random-init MARGE saved as `marge pretrain` saves its checkpoints."""
    from marge.contracts.corpus import Corpus
    from marge.model.checkpoint import save_checkpoint
    from services.trainer.config import TrainerConfig
    from services.trainer.step import build_optimizer, build_scheduler

    tok = Corpus.open(small_corpus).tokenizer()
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=tok.vocab_size, max_positions=128))
    optimizer = build_optimizer(model, TrainerConfig())
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "step-00000000", model, optimizer,
                           build_scheduler(optimizer, TrainerConfig(), 10), 0, small_corpus, {})


def head_of(path: Path, n: int, tmp_path: Path, name: str, filter_=None) -> Path:
    rows = [line for line in path.read_text(encoding="utf-8").splitlines() if filter_ is None or filter_(json.loads(line))]
    out = tmp_path / name
    out.write_text("\n".join(rows[:n]) + "\n", encoding="utf-8")
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# --- the classification head ----------------------------------------------------------------------


def test_the_classifier_reads_the_input_in_encoder_and_decoder_and_classifies_the_final_decoder_state():
    torch.manual_seed(0)
    model = MargeForClassification(preset("tiny", vocab_size=300, max_positions=64), num_labels=3).eval()
    tokens = [[2, 11, 12, 13, 3, 21, 22, 3], [2, 31, 32, 3]]  # a pair (BOS a EOS b EOS) and a single text
    enc = dec = torch.nn.utils.rnn.pad_sequence([torch.tensor(t) for t in tokens], batch_first=True)
    last = torch.tensor([7, 3])
    logits = model(enc, dec, last).logits_NC

    # by hand: every row reads only its own encoding; the head sees the decoder's final state at the last EOS
    evidence, cross = own_input_memory(model, enc)
    states = model.decode(dec, evidence.memory_1LD, cross)
    expected = model.classifier(states[torch.arange(2), last])
    torch.testing.assert_close(logits, expected)
    # one row alone gives the same logits as in the padded batch
    alone = model(enc[1:, :4], dec[1:, :4], torch.tensor([3])).logits_NC
    torch.testing.assert_close(alone, logits[1:], rtol=1e-5, atol=1e-5)
    # the encoder matters (change only the encoder input) and so does the decoder (change only its input)
    other = enc.clone()
    other[0, 2] = 99
    assert not torch.allclose(model(other, dec, last).logits_NC[0], logits[0])
    assert not torch.allclose(model(enc, other, last).logits_NC[0], logits[0])
    # and the classifier is trainable end to end: a loss with labels, gradients into encoder and decoder
    out = model(enc, dec, last, torch.tensor([0, 2]))
    out.loss.backward()
    assert model.encoder_layers[0].ffn.fc_in.weight.grad.abs().sum() > 0
    assert model.decoder_layers[-1].ffn.fc_in.weight.grad.abs().sum() > 0


# --- freezing -----------------------------------------------------------------------------------------


def test_frozen_parameters_stay_unchanged_after_an_update_and_the_others_change(small_corpus, checkpoint, tmp_path):
    cfg = FinetuneConfig(task="generation", train=str(head_of(TASKS / "translation" / "train.jsonl", 8, tmp_path, "t.jsonl")),
                         out=str(tmp_path / "out"), checkpoint=str(checkpoint), steps=2, batch_size=4, lr=1e-2,
                         warmup_steps=0, freeze_embeddings=True, freeze_decoder_layers=2)
    run = Finetuning(cfg)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.update(0)
    after = run.model.state_dict()
    frozen = set(run.frozen)
    assert "embed_tokens.weight" in frozen
    assert {n for n in frozen if n.startswith("decoder_local_layers.0.")}  # the first decoder layer ...
    assert {n for n in frozen if n.startswith("decoder_layers.0.")}  # ... and the second (the first with cross-attention)
    assert not {n for n in frozen if n.startswith("decoder_layers.1.")}
    for name, p in run.model.named_parameters():
        if name in frozen:
            assert torch.equal(before[name], after[name]), f"{name} is frozen but changed"
        elif name.startswith(("encoder_layers.0.", "decoder_layers.1.")) and name.endswith("weight"):
            assert not torch.equal(before[name], after[name]), f"{name} is trainable but did not change"


# --- which examples an update takes ---------------------------------------------------------------------


# --- generation: overfit a tiny set, save, reload ---------------------------------------------------------


def test_a_generation_fine_tune_overfits_four_examples_and_reloads_to_identical_outputs(checkpoint, tmp_path):
    rows = [{"source": s, "target": t, "target_language": "de"} for s, t in
            [("Save as Template", "Als Vorlage speichern"), ("Choose File - Open", "Wählen Sie Datei - Öffnen"),
             ("Enter a name", "Geben Sie einen Namen ein"), ("Select a category", "Wählen Sie eine Kategorie")]]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "model"
    summary = run_finetune(FinetuneConfig(task="generation", train=str(train), valid=str(train), out=str(out),
                                          checkpoint=str(checkpoint), steps=150, batch_size=4, lr=3e-3, warmup_steps=10,
                                          eval_every=50, patience=0, seed=0))
    assert summary["train_loss_last"] < 0.1 < summary["train_loss_first"]
    model = load(out)
    outputs = model.generate([r["source"] for r in rows], target_language="de", num_beams=2)
    assert outputs == [r["target"] for r in rows]
    assert summary["best"]["chrf"] == pytest.approx(100.0)
    # the saved directory: safetensors, configs, tokenizer, metrics, a manifest over all of them
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "model_config.json", "finetune_config.json", "tokenizer.model", "tokenizer.json",
            "metrics.json", "manifest.json"} <= names
    again = load(out)
    assert again.generate([rows[1]["source"]], "de", num_beams=3) == model.generate([rows[1]["source"]], "de", num_beams=3)
    torch.testing.assert_close(dict(again.model.state_dict()), dict(model.model.state_dict()), rtol=0, atol=0)


# --- classification through the command line, and bad input ---------------------------------------------------


def pawsx_rows(split: str, n: int, language: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (TASKS / "pawsx" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
    rows = [r for r in rows if language is None or r["pair_language"] == language]
    per_label: dict[str, list[dict]] = {}
    for r in rows:
        per_label.setdefault(r["label"], []).append(r)
    return [r for pair in zip(*(v[: n // 2] for v in per_label.values())) for r in pair]


def test_classification_fine_tunes_saves_reloads_and_evaluates_from_the_command_line(checkpoint, tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", pawsx_rows("train", 32))
    valid = write_jsonl(tmp_path / "valid.jsonl", pawsx_rows("valid", 16))
    test = write_jsonl(tmp_path / "test.jsonl", pawsx_rows("test", 8, "de") + pawsx_rows("test", 8, "fr"))
    out = tmp_path / "clf"
    assert main(["finetune", "--task", "classification", "--checkpoint", str(checkpoint), "--train", str(train),
                 "--valid", str(valid), "--out", str(out), "--steps", "6", "--batch-size", "8", "--lr", "1e-3",
                 "--eval-every", "3", "--freeze", "embeddings"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 6 and summary["metric"] == "accuracy" and summary["best"]["step"] in (3, 6)
    assert summary["label_counts"] == {"other": 16, "translation": 16}
    config = json.loads((out / "finetune_config.json").read_text())
    assert config["id2label"] == {"0": "other", "1": "translation"} and config["task"] == "classification"

    assert main(["eval", "finetuned", "--model", str(out), "--data", str(test), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["by_language"]) == {"en-de", "en-fr"} and result["examples"] == 16
    assert 0 <= result["accuracy"] <= 1 and 0 <= result["macro_f1"] <= 1
    # reloaded twice: identical probabilities; the API's labels and scores agree with them
    a, b = load(out), load(out)
    texts, pairs = [r["text"] for r in pawsx_rows("test", 4)], [r["text_pair"] for r in pawsx_rows("test", 4)]
    np.testing.assert_array_equal(a.predict_proba(texts, pairs), b.predict_proba(texts, pairs))
    predictions = a.classify(texts, pairs)
    assert [p["label"] for p in predictions] == [a.labels[i] for i in a.predict_proba(texts, pairs).argmax(1)]
    with pytest.raises(ValueError, match="classify needs"):
        load(checkpoint).classify(texts)
    with pytest.raises(ValueError, match="is a classifier"):
        a.generate(texts, "de")


def test_bad_task_files_fail_with_file_line_and_field(checkpoint, tmp_path, capsys):
    languages = ["de", "en"]
    cases = {
        "missing": ({"source": "a", "target_language": "de"}, "generation", "field 'target' is missing"),
        "empty": ({"source": "  ", "target": "b", "target_language": "de"}, "generation", "field 'source' is empty"),
        "language": ({"source": "a", "target": "b", "target_language": "xx"}, "generation",
                     "'target_language' is 'xx', a language the tokenizer has no token for"),
        "nolabel": ({"text": "a"}, "classification", "field 'label' is missing"),
        "numeric": ({"text": "a", "label": 3}, "classification", "field 'label' must be a non-empty string"),
    }
    for name, (row, task, message) in cases.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", [{"source": "ok", "target": "ok", "target_language": "de"}
                                                         if task == "generation" else {"text": "ok", "label": "x"}, row])
        with pytest.raises(TaskDataError, match=f"{name}.jsonl:2: .*{message}"):
            read_task_file(path, task, languages)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a", "label": "x"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(TaskDataError, match="broken.jsonl:2: not valid JSON"):
        read_task_file(broken, "classification")
    # a label the model was not trained on, at test time
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"text": "a", "label": "translation"}, {"text": "b", "label": "maybe"}])
    with pytest.raises(TaskDataError, match=r"unknown.jsonl:2: label 'maybe' is not one the model was trained on"):
        read_task_file(unknown, "classification", labels=["other", "translation"])
    # through the command line: exit 2, one line naming the file and line, nothing written
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a", "label": "x"}, {"text": "", "label": "y"}])
    assert main(["finetune", "--task", "classification", "--checkpoint", str(checkpoint), "--train", str(bad),
                 "--out", str(tmp_path / "never"), "--steps", "1"]) == 2
    assert "bad.jsonl:2: field 'text' is empty" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    # an existing output folder is refused before anything loads
    (tmp_path / "exists").mkdir()
    assert main(["finetune", "--task", "classification", "--checkpoint", str(checkpoint), "--train", str(bad),
                 "--out", str(tmp_path / "exists"), "--steps", "1"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_a_fine_tuned_directory_serves_translate_and_retrieval_eval_as_its_marge_model(checkpoint, tmp_path, capsys):
    """`marge translate` and `marge eval retrieval` take fine-tuned folders; a classifier's head is left out,
    and translating with a classifier is refused with what to use instead."""
    from marge.model.restore import load_model

    train = write_jsonl(tmp_path / "train.jsonl", pawsx_rows("train", 8))
    out = tmp_path / "clf"
    run_finetune(FinetuneConfig(task="classification", train=str(train), out=str(out), checkpoint=str(checkpoint),
                                steps=1, batch_size=8))
    body = load_model(out)
    assert type(body) is Marge
    whole = load(out).model
    torch.testing.assert_close(body.state_dict()["embed_tokens.weight"], whole.state_dict()["embed_tokens.weight"])
    # continuing from the fine-tuned classifier keeps its head when the labels are the same
    again = Finetuning(FinetuneConfig(task="classification", train=str(train), out=str(tmp_path / "again"),
                                      checkpoint=str(out), steps=1, batch_size=8))
    assert again.origin.get("continued_classifier") is True
    torch.testing.assert_close(again.model.classifier.dense.weight, whole.classifier.dense.weight)
    assert main(["translate", "--checkpoint", str(out), "--tgt-lang", "de"]) == 2
    assert "fine-tuned for classification, which cannot translate" in capsys.readouterr().err


def test_two_ddp_workers_on_ray_train_reach_the_weights_of_one_process(checkpoint, tmp_path, ray_cluster):
    """--workers 2: each rank takes half of every update's examples; the mean cross-entropy of the two halves is
    the whole batch's, so DDP's averaged gradients equal one process's (no dropout anywhere)."""
    train = write_jsonl(tmp_path / "train.jsonl", pawsx_rows("train", 16))
    common = dict(task="classification", train=str(train), checkpoint=str(checkpoint), steps=3, batch_size=8,
                  lr=1e-3, warmup_steps=0, classifier_dropout=0.0)
    one = run_finetune(FinetuneConfig(**common, out=str(tmp_path / "one")))
    two = run_finetune(FinetuneConfig(**common, out=str(tmp_path / "two"), workers=2))
    assert two["workers"] == 2 and one["workers"] == 1
    a, b = load(tmp_path / "one").model.state_dict(), load(tmp_path / "two").model.state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    assert two["train_loss_first"] == pytest.approx(one["train_loss_first"], abs=0.02)


def test_early_stopping_stops_after_patience_evaluations_without_a_better_metric(checkpoint, tmp_path):
    from services.finetune.run import Evaluation

    train = write_jsonl(tmp_path / "train.jsonl", pawsx_rows("train", 8))
    run = Finetuning(FinetuneConfig(task="classification", train=str(train), valid=str(train), out=str(tmp_path / "o"),
                                    checkpoint=str(checkpoint), steps=10, batch_size=8, patience=2))
    for step, accuracy in [(1, 0.5), (2, 0.75), (3, 0.7), (4, 0.75)]:
        run.evaluations.append(Evaluation(step, {"accuracy": accuracy}))
        if run.best is None or accuracy > run.best.metrics["accuracy"]:
            run.best = run.evaluations[-1]
        assert run.should_stop() == (step == 4), step  # update 2's 0.75 is not beaten by 0.7, then 0.75


def test_the_finetune_experiment_compares_each_checkpoint_with_random_init_and_keeps_finished_systems(
        checkpoint, tmp_path, capsys, monkeypatch):
    tasks = tmp_path / "tasks"
    (tasks / "pawsx").mkdir(parents=True)
    write_jsonl(tasks / "pawsx" / "train.jsonl", pawsx_rows("train", 16))
    write_jsonl(tasks / "pawsx" / "valid.jsonl", pawsx_rows("valid", 8))
    write_jsonl(tasks / "pawsx" / "test.jsonl", pawsx_rows("test", 4, "de") + pawsx_rows("test", 4, "ru"))
    from experiments.command import run_study
    from experiments.finetune.__main__ import cmd_experiment_finetune, parser

    def main(argv: list[str]) -> int:
        return run_study(parser(), cmd_experiment_finetune, argv)

    args = ["--checkpoint", f"pretrained={checkpoint}", "--tasks", str(tasks),
            "--out", str(tmp_path / "report"), "--work", str(tmp_path / "work"), "--only", "pawsx",
            "--steps", "pawsx=2"]
    assert main(args) == 0
    table = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [(r["system"], r["task"], r["updates"]) for r in table] == [("pretrained", "pawsx", 2),
                                                                       ("random_init", "pawsx", 2)]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    for row in report["rows"]:
        assert set(row["test"]["by_language"]) == {"en-de", "en-ru"}
        assert row["zero_shot_accuracy_mean"] == row["test"]["by_language"]["en-ru"]["accuracy"]
        assert row["command"].startswith("marge finetune --task classification") and "--freeze zero-shot" in row["command"]
    assert "--random-init" in report["rows"][1]["command"]
    # run again: both systems are kept, nothing is fine-tuned a second time
    import experiments.finetune.harness as experiment

    monkeypatch.setattr(experiment, "run_finetune", lambda cfg: pytest.fail(f"{cfg.out} fine-tuned again"))
    assert main(args) == 0
    assert json.loads((tmp_path / "report" / "report.json").read_text())["rows"] == report["rows"]
