"""Fine-tuning (`marge finetune`, `marge eval finetuned`, `marge.model.finetuned`): the classification head, freezing,
a generation fine-tune that overfits, bad input, reloading, DDP on Ray Train.

The tests of this subject that need a server or take long are in tests/integration/test_finetune_training.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from marge.contracts.tasks import encode_examples
from marge.model.architecture import preset
from marge.model.finetuned import collate, task_loss
from marge.model.network import Marge
from services.finetune.run import ExampleOrder, freeze

TASKS = Path(__file__).resolve().parents[2] / "data" / "demo" / "tasks"


# --- the classification head ----------------------------------------------------------------------


def test_a_pair_is_framed_bos_text_eos_pair_eos_and_cut_longest_first(small_corpus):
    from marge.contracts.corpus import Corpus
    from marge.contracts.tasks import classification_input, truncate_pair

    assert truncate_pair([1] * 10, [2] * 3, 8) == ([1] * 5, [2] * 3)
    assert truncate_pair([1] * 4, [2] * 6, 6) == ([1] * 3, [2] * 3)
    specials = Corpus.open(small_corpus).tokenizer().specials
    row = classification_input([7, 8, 9, 10], [20, 21], specials, max_positions=7)
    assert row == [specials.bos_id, 7, 8, specials.eos_id, 20, 21, specials.eos_id]


# --- freezing -----------------------------------------------------------------------------------------


def test_freezing_more_decoder_layers_than_the_model_has_is_an_error_naming_the_count():
    model = Marge(preset("tiny", vocab_size=300, max_positions=64))
    with pytest.raises(ValueError, match="at most the model's 3 decoder layers"):
        freeze(model, embeddings=False, decoder_layers=4)


def test_freeze_options_parse_the_papers_zero_shot_recipe():
    from services.finetune.options import parse_freeze

    assert parse_freeze(["zero-shot"]) == (True, 0, True)
    assert parse_freeze(["embeddings,decoder-layers=2"]) == (True, 2, False)
    assert parse_freeze(None) == (False, 0, False)
    with pytest.raises(ValueError, match="not known"):
        parse_freeze(["encoder"])


# --- which examples an update takes ---------------------------------------------------------------------


def test_ranks_split_each_update_and_every_epoch_covers_every_example_once():
    order = ExampleOrder(num_examples=10, batch_size=4, seed=3)
    for update in range(6):
        whole = order.indices(update)
        assert order.indices(update, 0, 2) + order.indices(update, 1, 2) == whole
    stream = [i for u in range(5) for i in order.indices(u)]  # 20 positions = 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # a fresh permutation each epoch
    assert ExampleOrder(10, 4, 3).indices(4) == order.indices(4)  # a pure function of (seed, update, rank)


# --- generation: overfit a tiny set, save, reload ---------------------------------------------------------


# --- classification through the command line, and bad input ---------------------------------------------------


def test_task_loss_through_collate_is_the_marge_loss_with_one_source_per_target(small_corpus):
    """Generation fine-tuning is MARGE's own loss with each output reading only its own input."""
    from marge.contracts.corpus import Corpus
    from marge.contracts.tasks import GenerationExample

    tok = Corpus.open(small_corpus).tokenizer()
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=tok.vocab_size, max_positions=64)).eval()
    examples = [GenerationExample("Save as Template", "Als Vorlage speichern", "de"),
                GenerationExample("Enter a name for the template.", "Geben Sie einen Namen ein.", "de")]
    encoded = encode_examples(examples, tok, 64)
    batch = collate(encoded, tok.specials.pad_id)
    one_by_one = [task_loss(model, collate([e], tok.specials.pad_id)) * len(e.labels) for e in encoded]
    tokens = sum(len(e.labels) for e in encoded)
    torch.testing.assert_close(task_loss(model, batch), sum(one_by_one) / tokens, rtol=1e-5, atol=1e-5)
