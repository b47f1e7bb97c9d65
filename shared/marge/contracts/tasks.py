"""Fine-tuning task data: the JSONL files `marge finetune` and `marge eval finetuned` read, checked line by line.

Two tasks, as the paper fine-tunes (§3 "Fine-tuning", following BART):

    generation       {"source": str, "target": str, "target_language": str}
                     the source goes to the encoder, the target comes out of the decoder (translation,
                     summarisation); `target_language` picks the decoder's first input (its language token)
    classification   {"text": str, "text_pair": str (optional), "label": str}
                     the input goes to both the encoder and the decoder; the decoder's final state is classified

Optional fields give the per-language breakdown of the metrics: `source_language` (generation), `language`
and `pair_language` (classification). Any other field is kept out of the way (ids, notes).

Every problem is reported with the file, the line and the field, before any training starts: a missing or
empty field, a label the model was not trained on, a language the tokenizer has no token for.

Framing (how an example becomes model input) is defined here once, next to `marge.contracts.batch`'s framing of
pre-training documents:

    generation       encoder: BOS source EOS          decoder: [target language] target    labels: target EOS
    classification   encoder: BOS text EOS pair EOS   decoder: the same tokens             class: state at the last EOS
                     (`pair_input: split`: encoder BOS text EOS, decoder BOS pair EOS)
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

from marge.contracts.batch import SpecialTokens, as_decoder_input, as_encoder_input, as_labels, max_text_tokens

TASKS = ("generation", "classification")


class TaskDataError(ValueError):
    """A task file that cannot be used; the message names the file, line and field."""


@dataclass(frozen=True)
class GenerationExample:
    source: str
    target: str
    target_language: str
    source_language: str | None = None
    where: str = ""
    """file:line, for messages."""

    @property
    def group(self) -> str:
        """The key of this example's per-language metrics: `src->tgt`, or the target language alone."""
        return f"{self.source_language}->{self.target_language}" if self.source_language else self.target_language


@dataclass(frozen=True)
class ClassificationExample:
    text: str
    label: str | None
    text_pair: str | None = None
    language: str | None = None
    pair_language: str | None = None
    where: str = ""

    @property
    def group(self) -> str | None:
        if self.language and self.pair_language:
            return f"{self.language}-{self.pair_language}"
        return self.language


Example = GenerationExample | ClassificationExample


@overload
def _text_field(row: dict, name: str, where: str, required: Literal[True] = ...) -> str: ...


@overload
def _text_field(row: dict, name: str, where: str, required: bool) -> str | None: ...


def _text_field(row: dict, name: str, where: str, required: bool = True) -> str | None:
    if name not in row or row[name] is None:
        if required:
            raise TaskDataError(f"{where}: field {name!r} is missing (fields present: {sorted(row)})")
        return None
    value = row[name]
    if not isinstance(value, str):
        raise TaskDataError(f"{where}: field {name!r} must be a string, got {type(value).__name__} {value!r}")
    if not value.strip():
        raise TaskDataError(f"{where}: field {name!r} is empty")
    return value


@overload
def _language_field(row: dict, name: str, where: str, languages: Iterable[str] | None,
                    required: Literal[True]) -> str: ...


@overload
def _language_field(row: dict, name: str, where: str, languages: Iterable[str] | None,
                    required: bool) -> str | None: ...


def _language_field(row: dict, name: str, where: str, languages: Iterable[str] | None,
                    required: bool) -> str | None:
    value = _text_field(row, name, where, required)
    if value is not None and languages is not None and value not in languages:
        raise TaskDataError(f"{where}: field {name!r} is {value!r}, a language the tokenizer has no token for "
                            f"(it knows {sorted(languages)}); use one of those or pre-train with that language")
    return value


def parse_example(row: object, task: str, where: str, languages: Iterable[str] | None = None,
                  require_label: bool = True) -> Example:
    """One JSONL row as an example of `task`; `languages` are the tokenizer's (None: not checked)."""
    if not isinstance(row, dict):
        raise TaskDataError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
    if task == "generation":
        return GenerationExample(
            source=_text_field(row, "source", where), target=_text_field(row, "target", where),
            target_language=_language_field(row, "target_language", where, languages, required=True),
            source_language=_text_field(row, "source_language", where, required=False), where=where)
    if task == "classification":
        label = row.get("label")
        if label is None and require_label:
            raise TaskDataError(f"{where}: field 'label' is missing (fields present: {sorted(row)})")
        if label is not None and (not isinstance(label, str) or not label.strip()):
            raise TaskDataError(f"{where}: field 'label' must be a non-empty string (labels are names, e.g. "
                                f"\"entailment\"), got {label!r}")
        return ClassificationExample(
            text=_text_field(row, "text", where), text_pair=_text_field(row, "text_pair", where, required=False),
            label=label, language=_text_field(row, "language", where, required=False),
            pair_language=_text_field(row, "pair_language", where, required=False), where=where)
    raise TaskDataError(f"unknown task {task!r}; choose one of {list(TASKS)}")


def read_task_file(path: Path | str, task: str, languages: Iterable[str] | None = None,
                   labels: list[str] | None = None, require_label: bool = True) -> list[Example]:
    """Every example of a task JSONL file, validated. `labels`: the label set a trained model knows (a label
    outside it is an error naming the line); None accepts any label (training data defines the set)."""
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"{path}: no such file (a JSONL task file: one JSON object per line)")
    languages = None if languages is None else set(languages)
    examples: list[Example] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            example = parse_example(row, task, where, languages, require_label)
            if labels is not None and isinstance(example, ClassificationExample) and example.label is not None \
                    and example.label not in labels:
                raise TaskDataError(f"{where}: label {example.label!r} is not one the model was trained on "
                                    f"({sorted(labels)})")
            examples.append(example)
    if not examples:
        raise TaskDataError(f"{path}: no examples (the file is empty)")
    return examples


def label_set(examples: list[Example]) -> list[str]:
    """The labels of a training set, sorted (the class ids: label i is class i)."""
    labels = sorted({e.label for e in examples if isinstance(e, ClassificationExample) and e.label is not None})
    if len(labels) < 2:
        where = examples[0].where.rsplit(":", 1)[0] if examples else "the training file"
        raise TaskDataError(f"{where}: classification needs at least 2 distinct labels, found {labels}")
    return labels


def label_counts(examples: list[Example]) -> dict[str, int]:
    # Training examples always carry a label (read with require_label); the check only tells the type so.
    return dict(sorted(Counter(e.label for e in examples
                               if isinstance(e, ClassificationExample) and e.label is not None).items()))


# ----------------------------------------------------------------------------------------------------
# Framing: examples as token ids
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedExample:
    encoder_input: list[int]
    decoder_input: list[int]
    labels: list[int] | None = None
    """Generation: the decoder's targets (text, EOS)."""
    label_id: int | None = None
    """Classification: the class id."""


def truncate_pair(first: list[int], second: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Cut the longer of two token lists first until both fit `budget` (Hugging Face's `longest_first`)."""
    first, second = list(first), list(second)
    while len(first) + len(second) > budget:
        if len(first) >= len(second):
            first.pop()
        else:
            second.pop()
    return first, second


def encode_generation(example: GenerationExample, tokenizer, specials: SpecialTokens,
                      max_positions: int) -> EncodedExample:
    source = tokenizer.encode(example.source)[: max_text_tokens(max_positions)]
    target = tokenizer.encode(example.target)[: max_positions - 1]
    return EncodedExample(as_encoder_input(source, specials), as_decoder_input(target, example.target_language, specials),
                          labels=as_labels(target, specials))


PAIR_INPUTS = ("both", "split")
"""How a text pair enters the classifier. 'both' (the paper's recipe, BART's): the pair, joined, goes to the
encoder and to the decoder. 'split' (our option): the text goes to the encoder and the pair to the decoder,
the way MARGE pre-trains, a target read against its evidence. A single text is 'both' either way."""


def classification_input(text_ids: list[int], pair_ids: list[int] | None, specials: SpecialTokens,
                         max_positions: int) -> list[int]:
    """BOS text EOS [pair EOS], cut to fit: the sequence both the encoder and the decoder read."""
    if pair_ids is None:
        return as_encoder_input(text_ids[: max_text_tokens(max_positions)], specials)
    first, second = truncate_pair(text_ids, pair_ids, max_positions - 3)
    return [specials.bos_id, *first, specials.eos_id, *second, specials.eos_id]


def classification_inputs(text_ids: list[int], pair_ids: list[int] | None, specials: SpecialTokens,
                          max_positions: int, pair_input: str = "both") -> tuple[list[int], list[int]]:
    """(encoder input, decoder input) of one example; the classifier reads the decoder's last state."""
    if pair_ids is None or pair_input == "both":
        tokens = classification_input(text_ids, pair_ids, specials, max_positions)
        return tokens, tokens
    if pair_input != "split":
        raise ValueError(f"pair_input must be one of {list(PAIR_INPUTS)}, got {pair_input!r}")
    return (as_encoder_input(text_ids[: max_text_tokens(max_positions)], specials),
            as_encoder_input(pair_ids[: max_text_tokens(max_positions)], specials))


def encode_classification(example: ClassificationExample, tokenizer, specials: SpecialTokens, max_positions: int,
                          labels: list[str] | None, pair_input: str = "both") -> EncodedExample:
    pair = None if example.text_pair is None else tokenizer.encode(example.text_pair)
    encoder_input, decoder_input = classification_inputs(tokenizer.encode(example.text), pair, specials,
                                                         max_positions, pair_input)
    label_id = None if labels is None or example.label is None else labels.index(example.label)
    return EncodedExample(encoder_input, decoder_input, label_id=label_id)


def encode_examples(examples: list[Example], tokenizer, max_positions: int, labels: list[str] | None = None,
                    pair_input: str = "both") -> list[EncodedExample]:
    specials = tokenizer.specials
    out = []
    for e in examples:
        if isinstance(e, GenerationExample):
            out.append(encode_generation(e, tokenizer, specials, max_positions))
        else:
            out.append(encode_classification(e, tokenizer, specials, max_positions, labels, pair_input))
    return out
