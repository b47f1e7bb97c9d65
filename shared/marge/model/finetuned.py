"""Fine-tuned MARGE models: the classification head, the model directory, and a small API to use one.

    import marge.model.finetuned as mf
    model = mf.load("models/pawsx")                       # a `marge finetune` output (or a pre-training checkpoint)
    model.classify(["Save as Template"], ["Als Vorlage speichern"])   # [{"label": "translation", "score": 0.93}]
    model = mf.load("models/en-de")
    model.generate(["Saves the current document."], target_language="de", num_beams=6, no_repeat_ngram_size=8)

Tasks, as the paper fine-tunes (§3, following BART): for generation the input is encoded and the decoder
generates the output (this is `Marge` itself, its relevance bias constant with one evidence document per
output); for classification the input goes to both encoder and decoder and the decoder's final hidden state
(at the last EOS) feeds a classifier (`MargeForClassification`, BART's head: dense, tanh, out projection).

A fine-tuned model directory (written atomically by `marge finetune`, manifest last):

    model.safetensors     weights: the MARGE model's, plus `classifier.*` for classification
    model_config.json     the MARGE model's config (the same file a pre-training checkpoint has)
    finetune_config.json  task, label names and ids (`id2label`/`label2id`, as Hugging Face names them),
                          classifier settings, what it was fine-tuned from and how
    tokenizer.model/.json the tokenizer
    metrics.json          the validation metric per evaluation, the best one, training loss and speed
    manifest.json         format "marge-finetuned", sha256 of every file
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from marge.contracts.tasks import (
    ClassificationExample,
    EncodedExample,
    Example,
    GenerationExample,
    classification_inputs,
    encode_examples,
)
from marge.contracts.tokenizer import MargeTokenizer
from marge.model.architecture import MargeConfig
from marge.model.checkpoint import (
    CHECKPOINT_FORMAT,
    FINETUNED_FORMAT,
    config_from_saved,
    read_manifest,
    saved_config,
    write_manifest,
)
from marge.model.generate import GenerationConfig, translate
from marge.model.layers import pad_rows
from marge.model.network import Marge
from marge.model.restore import load_model

FINETUNED_FILES = ("model.safetensors", "model_config.json", "finetune_config.json", "tokenizer.model",
                   "tokenizer.json", "metrics.json")


# ----------------------------------------------------------------------------------------------------
# The classification model
# ----------------------------------------------------------------------------------------------------


class ClassificationHead(nn.Module):
    """BART's sentence-classification head: dropout, dense, tanh, dropout, projection to the classes."""

    def __init__(self, d_model: int, num_labels: int, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, num_labels)

    def forward(self, x_ND: Tensor) -> Tensor:
        return self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(x_ND)))))


@dataclass
class ClassifierOutput:
    loss: Tensor | None  # mean cross-entropy over the examples (None without labels)
    logits_NC: Tensor


def own_input_memory(model: Marge, encoder_input_NS: Tensor):
    """Encode each row and let decoder row i read only encoder row i: one evidence document per output, so
    the relevance bias is one constant per row and changes nothing (it is left at 0, with no g pass)."""
    evidence = model.encode_evidence(encoder_input_NS)
    n = encoder_input_NS.shape[0]
    own_NN = torch.eye(n, dtype=torch.bool, device=encoder_input_NS.device)
    return evidence, model.cross_memory(evidence, torch.zeros(n, n, device=encoder_input_NS.device), own_NN)


def own_input_allowed(encoder_input_NS: Tensor) -> Tensor:
    """The allowed mask of a generation batch: output i reads input i only."""
    return torch.eye(encoder_input_NS.shape[0], dtype=torch.bool, device=encoder_input_NS.device)


class MargeForClassification(Marge):
    """MARGE with a classifier on the decoder's final state at the input's last token (paper §3)."""

    def __init__(self, cfg: MargeConfig, num_labels: int, classifier_dropout: float = 0.0):
        super().__init__(cfg)
        if num_labels < 2:
            raise ValueError(f"a classifier needs at least 2 labels, got {num_labels}")
        self.classifier = ClassificationHead(cfg.d_model, num_labels, classifier_dropout)
        for module in self.classifier.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=cfg.init_std)
                nn.init.zeros_(module.bias)

    def forward(self, encoder_input_NS: Tensor, decoder_input_NT: Tensor, last_N: Tensor,  # type: ignore[override]
                label_ids_N: Tensor | None = None) -> ClassifierOutput:
        """encoder_input_NS and decoder_input_NT are the same framed tokens (`marge.contracts.tasks.classification_input`);
        last_N is each row's last real position (its final EOS)."""
        self._check_lengths(decoder_input_NT, "input")
        evidence, cross = own_input_memory(self, encoder_input_NS)
        states_NTD = self.decode(decoder_input_NT, evidence.memory_1LD, cross)
        final_ND = states_NTD[torch.arange(states_NTD.shape[0], device=states_NTD.device), last_N]
        logits_NC = self.classifier(final_ND).float()
        loss = None if label_ids_N is None else F.cross_entropy(logits_NC, label_ids_N)
        return ClassifierOutput(loss, logits_NC)


# ----------------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------------


@dataclass
class TaskTensors:
    encoder_input_NS: Tensor
    decoder_input_NT: Tensor
    labels_NT: Tensor | None = None
    """Generation: the decoder's targets (padded with pad_id: ignored)."""
    last_N: Tensor | None = None
    """Classification: each row's last real decoder position."""
    label_ids_N: Tensor | None = None

    def to(self, device: torch.device | str) -> "TaskTensors":
        def moved(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return TaskTensors(self.encoder_input_NS.to(device), self.decoder_input_NT.to(device), moved(self.labels_NT),
                           moved(self.last_N), moved(self.label_ids_N))

    @property
    def num_rows(self) -> int:
        return self.encoder_input_NS.shape[0]


def collate(encoded: list[EncodedExample], pad_id: int) -> TaskTensors:
    """Pad a list of framed examples into one batch."""
    tensors = TaskTensors(pad_rows([e.encoder_input for e in encoded], pad_id),
                          pad_rows([e.decoder_input for e in encoded], pad_id))
    if encoded[0].labels is not None:
        # one task's examples: generation frames every one with labels
        tensors.labels_NT = pad_rows(cast(list[list[int]], [e.labels for e in encoded]), pad_id)
    else:
        tensors.last_N = torch.tensor([len(e.decoder_input) - 1 for e in encoded])
        if all(e.label_id is not None for e in encoded):
            tensors.label_ids_N = torch.tensor([e.label_id for e in encoded])
    return tensors


def task_loss(model: nn.Module, batch: TaskTensors) -> Tensor:
    """The fine-tuning loss of one batch: NLL per target token (generation) or cross-entropy per example.

    `model` may be wrapped in DDP: it is called, never reached into, so gradients are all-reduced."""
    if batch.labels_NT is not None:
        return model(batch.encoder_input_NS, None, batch.decoder_input_NT, batch.labels_NT,
                     own_input_allowed(batch.encoder_input_NS)).loss
    return model(batch.encoder_input_NS, batch.decoder_input_NT, batch.last_N, batch.label_ids_N).loss


# ----------------------------------------------------------------------------------------------------
# The model directory
# ----------------------------------------------------------------------------------------------------


def save_finetuned(directory: Path, model: Marge, tokenizer: MargeTokenizer, finetune_config: dict[str, Any],
                   metrics: dict[str, Any]) -> Path:
    """Write a fine-tuned model into `directory` (normally a temporary folder `atomic_directory` moves into
    place): weights, configs, tokenizer, metrics, and the manifest last."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
              str(directory / "model.safetensors"))
    (directory / "model_config.json").write_text(json.dumps(saved_config(model.cfg), indent=2) + "\n", encoding="utf-8")
    (directory / "finetune_config.json").write_text(json.dumps(finetune_config, indent=2) + "\n", encoding="utf-8")
    (directory / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    tokenizer.save(directory)
    write_manifest(directory, FINETUNED_FORMAT, FINETUNED_FILES, task=finetune_config["task"])
    return directory


def label_config(labels: list[str]) -> dict[str, Any]:
    return {"id2label": {str(i): label for i, label in enumerate(labels)},
            "label2id": {label: i for i, label in enumerate(labels)}}


def labels_of(finetune_config: dict[str, Any]) -> list[str]:
    id2label = finetune_config["id2label"]
    return [id2label[str(i)] for i in range(len(id2label))]


class FineTunedModel:
    """A model ready to use: `generate` for a generation model or a pre-training checkpoint, `classify` for a
    classifier. Hugging Face's names where the meaning is the same (num_beams, no_repeat_ngram_size)."""

    def __init__(self, model: Marge, tokenizer: MargeTokenizer, finetune_config: dict[str, Any] | None,
                 device: str | torch.device = "cpu", path: Path | None = None):
        self.model, self.tokenizer, self.device, self.path = model.to(device).eval(), tokenizer, device, path
        self.config = finetune_config or {}
        self.task: str | None = self.config.get("task")
        """'generation', 'classification', or None for a pre-training checkpoint (zero-shot generation)."""
        self.labels: list[str] | None = labels_of(self.config) if self.task == "classification" else None
        self.pair_input: str = self.config.get("pair_input", "both")
        """How text pairs are fed (`marge.contracts.tasks.PAIR_INPUTS`)."""

    def _class_labels(self) -> list[str]:
        """A classifier's labels (class i is label i); any other model is refused as `_require` refuses it."""
        self._require("classification")
        if self.labels is None:  # read with a classifier's config: None only for the other tasks
            raise ValueError(f"{self.path}: a classifier whose fine-tuning config names no labels")
        return self.labels

    def _require(self, task: str) -> None:
        if task == "classification" and self.task != "classification":
            raise ValueError(f"{self.path} is a {self.task or 'pre-training'} model: classify needs a model from "
                             "`marge finetune --task classification`")
        if task == "generation" and self.task == "classification":
            raise ValueError(f"{self.path} is a classifier: generate needs a generation model or a pre-training "
                             "checkpoint")

    def generate(self, texts: list[str] | str, target_language: str, num_beams: int = 6,
                 no_repeat_ngram_size: int = 8, max_length_a: float = 1.5, max_length_b: int = 10,
                 length_penalty: float = 1.0) -> list[str]:
        """The output text for each input (beam search; inputs longer than the encoder are cut into chunks whose
        outputs are joined, as `marge translate` does)."""
        self._require("generation")
        texts = [texts] if isinstance(texts, str) else list(texts)
        self.tokenizer.lang_id(target_language)  # an unknown language fails here, naming the known ones
        cfg = GenerationConfig(beam=num_beams, no_repeat_ngram=no_repeat_ngram_size, max_len_a=max_length_a,
                               max_len_b=max_length_b, length_penalty=length_penalty)
        return [translate(self.model, self.tokenizer, text, target_language, cfg, str(self.device)) for text in texts]

    @torch.no_grad()
    def predict_proba(self, texts: list[str] | str, pairs: list[str] | str | None = None,
                      batch_size: int = 32) -> np.ndarray:
        """Class probabilities (N x labels; column i is `labels[i]`)."""
        self._require("classification")
        texts = [texts] if isinstance(texts, str) else list(texts)
        pairs = [pairs] if isinstance(pairs, str) else pairs
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(pairs)} pairs: give one pair per text (or none)")
        specials, max_positions = self.tokenizer.specials, self.model.cfg.max_positions
        encoded_all = [EncodedExample(*classification_inputs(
            self.tokenizer.encode(t), None if pairs is None else self.tokenizer.encode(pairs[i]), specials,
            max_positions, self.pair_input)) for i, t in enumerate(texts)]
        out = []
        for start in range(0, len(encoded_all), batch_size):
            encoded = encoded_all[start:start + batch_size]
            batch = collate(encoded, specials.pad_id).to(self.device)
            out.append(torch.softmax(self.model(batch.encoder_input_NS, batch.decoder_input_NT, batch.last_N).logits_NC,
                                     dim=-1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, len(self._class_labels())))

    @torch.no_grad()
    def relevance(self, texts: list[str] | str, batch_size: int = 64) -> np.ndarray:
        """g of each text as the index stores it and the retrieval service searches it: unit vectors (N x d_model,
        float32), centred as the model centres; `relevance(a) @ relevance(b).T` is f, the relevance score."""
        from marge.model.embedding import encode_texts, relevance_unit_vectors

        texts = [texts] if isinstance(texts, str) else list(texts)
        rows = encode_texts(self.tokenizer, texts, self.model.cfg.max_positions)
        return relevance_unit_vectors(self.model, rows, self.tokenizer.specials, batch_size, str(self.device))

    @torch.no_grad()
    def embed(self, texts: list[str] | str, layer: int | None = None, batch_size: int = 64) -> np.ndarray:
        """The mean of encoder layer `layer`'s states over each text's tokens (N x d_model): the sentence vectors of
        the paper's zero-shot retrieval (§4.1; default layer 5, or the deepest the model has; 0 is the embeddings)."""
        from marge.model.embedding import encode_texts, mean_layer_vectors, resolve_layer

        texts = [texts] if isinstance(texts, str) else list(texts)
        rows = encode_texts(self.tokenizer, texts, self.model.cfg.max_positions)
        return mean_layer_vectors(self.model, rows, self.tokenizer.specials, resolve_layer(self.model, layer), batch_size,
                                  str(self.device))

    def classify(self, texts: list[str] | str, pairs: list[str] | str | None = None,
                 batch_size: int = 32) -> list[dict[str, Any]]:
        """The predicted label of each text (or text pair) and its probability, as Hugging Face's
        text-classification pipeline returns them: [{"label": ..., "score": ...}]."""
        probs = self.predict_proba(texts, pairs, batch_size)
        labels = self._class_labels()
        return [{"label": labels[int(p.argmax())], "score": float(p.max())} for p in probs]


class PretrainedModel(FineTunedModel):
    """A pre-training checkpoint (`marge pretrain`), ready to use: g (`relevance`), sentence vectors (`embed`) and
    zero-shot generation (`generate`); `classify` needs `marge finetune --task classification` first."""

    def __init__(self, model: Marge, tokenizer: MargeTokenizer, device: str | torch.device = "cpu",
                 path: Path | None = None):
        super().__init__(model, tokenizer, None, device, path)

    def __repr__(self) -> str:
        return f"PretrainedModel({self.path}, d_model={self.model.cfg.d_model}, languages={self.tokenizer.languages})"


def load(directory: Path | str, device: str | torch.device = "cpu") -> FineTunedModel:
    """A fine-tuned model directory (`marge finetune`'s output, a `FineTunedModel`) or a pre-training checkpoint
    (a `PretrainedModel`), verified against its manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory, formats=(FINETUNED_FORMAT, CHECKPOINT_FORMAT))
    tokenizer = MargeTokenizer.load(directory)
    if manifest["format"] == CHECKPOINT_FORMAT:
        model = load_model(directory)
        if not isinstance(model, Marge):
            raise ValueError(f"{directory} holds a {type(model).__name__} model, an encoder without a MARGE decoder: "
                             "it cannot be used for generation or classification here")
        return PretrainedModel(model, tokenizer, device, directory)
    finetune_config = json.loads((directory / "finetune_config.json").read_text(encoding="utf-8"))
    cfg = config_from_saved(json.loads((directory / "model_config.json").read_text(encoding="utf-8")))
    if finetune_config["task"] == "classification":
        model = MargeForClassification(cfg, len(finetune_config["id2label"]), finetune_config["classifier_dropout"])
    else:
        model = Marge(cfg)
    model.load_state_dict(load_file(str(directory / "model.safetensors"), device="cpu"))
    return FineTunedModel(model, tokenizer, finetune_config, device, directory)


# ----------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------


def sacrebleu_tokenizer(language: str) -> str:
    """sacrebleu's own tokenizer for Chinese, characters for Japanese (mecab is not installed), 13a otherwise."""
    return {"zh": "zh", "ja": "char"}.get(language, "13a")


def generation_scores(hypotheses: list[str], references: list[str], language: str) -> dict[str, float]:
    import sacrebleu

    hypotheses = [" ".join(h.split()) for h in hypotheses]
    references = [" ".join(r.split()) for r in references]
    return {"bleu": sacrebleu.corpus_bleu(hypotheses, [references], tokenize=sacrebleu_tokenizer(language)).score,
            "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score, "examples": len(hypotheses)}


def classification_scores(predicted: list[str], gold: list[str], labels: list[str]) -> dict[str, float]:
    from sklearn.metrics import f1_score

    return {"accuracy": float(np.mean([p == g for p, g in zip(predicted, gold)])),
            "macro_f1": float(f1_score(gold, predicted, labels=labels, average="macro", zero_division=0)),
            "examples": len(gold)}


def by_group(examples: list[Example]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        if e.group is not None:
            groups.setdefault(e.group, []).append(i)
    return dict(sorted(groups.items()))


def evaluate(model: FineTunedModel, examples: list[Example], num_beams: int = 6, no_repeat_ngram_size: int = 8,
             progress=None) -> dict[str, Any]:
    """Metrics of `model` on labelled examples: accuracy and macro-F1 (classification) or sacrebleu BLEU and
    chrF (generation), over all examples and per language where the data names languages (`by_language`).
    `progress(n)` is called as examples are done."""
    if isinstance(examples[0], ClassificationExample):
        # a task file holds one task's examples (read_task_file): all of them are the first one's kind
        classified = cast(list[ClassificationExample], examples)
        labels = model._class_labels()
        # a file where only some examples have a text_pair gives fewer pairs than texts, which predict_proba refuses
        probs = model.predict_proba([e.text for e in classified],
                                    None if classified[0].text_pair is None else
                                    [e.text_pair for e in classified if e.text_pair is not None])
        predicted = [labels[int(i)] for i in probs.argmax(1)]
        if progress:
            progress(len(examples))
        gold = [e.label for e in classified]
        if None in gold:
            raise ValueError(f"{classified[gold.index(None)].where}: no label; evaluation needs labelled examples")
        scored = cast(list[str], gold)  # checked just above
        result: dict[str, Any] = dict(classification_scores(predicted, scored, labels))
        result["by_language"] = {g: classification_scores([predicted[i] for i in idx], [scored[i] for i in idx],
                                                          labels) for g, idx in by_group(examples).items()}
        return result
    generated = cast(list[GenerationExample], examples)  # one task's examples, as above
    hypotheses = []
    for e in generated:
        hypotheses.extend(model.generate([e.source], e.target_language, num_beams, no_repeat_ngram_size))
        if progress:
            progress(1)
    languages = {e.target_language for e in generated}
    result = dict(generation_scores(hypotheses, [e.target for e in generated],
                                    next(iter(languages)) if len(languages) == 1 else "multi"))
    result["by_language"] = {g: generation_scores([hypotheses[i] for i in idx], [generated[i].target for i in idx],
                                                  generated[idx[0]].target_language)
                             for g, idx in by_group(examples).items()}
    result["hypotheses"] = hypotheses
    return result


def encode_for(model: FineTunedModel, examples: list[Example]) -> list[EncodedExample]:
    """Framed examples for `model` (labels as its class ids)."""
    if isinstance(examples[0], GenerationExample):
        return encode_examples(examples, model.tokenizer, model.model.cfg.max_positions)
    return encode_examples(examples, model.tokenizer, model.model.cfg.max_positions, model.labels, model.pair_input)
