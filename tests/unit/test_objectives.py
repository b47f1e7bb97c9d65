"""Objectives as plug-ins (services.trainer.objectives): what each needs from the stages, what it makes of a batch,
and the losses it adds. Pure CPU, the `tiny`-shaped models, the small demo corpus.

The tests of this subject that need a server or take long are in tests/integration/test_objectives_training.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from objective_inputs import SENTENCE_END, SPECIALS, VOCAB, objectives, toy_batch, toy_objectives

from marge.contracts.config import ConfigError
from marge.contracts.corpus import Corpus
from marge.contracts.slots import BatchId, Slots, VersionPlan
from marge.model.architecture import preset
from marge.model.network import Marge
from services.batcher.config import BatcherConfig, BatchShape
from services.batcher.core import DocumentStore, corpus_epoch_batches
from services.batcher.schedule import BatchSchedule
from services.driver.config import load_config
from services.trainer.noising import SENTENCE_END_CHARACTERS
from services.trainer.objectives import (
    BartObjectiveConfig,
    MargeObjectiveConfig,
    VecoObjectiveConfig,
    objectives_for,
    split_in_halves,
)


def marge_model() -> Marge:
    torch.manual_seed(0)
    return Marge(preset("tiny", vocab_size=VOCAB, max_positions=64)).eval()


# --- settings: what each objective needs ------------------------------------------------------------


def test_naming_no_main_objective_trains_marge_and_naming_some_trains_exactly_those():
    assert objectives().enabled == ("marge",)
    assert objectives(self_evidence={"prob": 0.5, "until": 10}).enabled == ("marge", "self_evidence")
    bart = objectives(bart={"weight": 1.0})
    assert bart.enabled == ("bart",) and bart.primary == "bart"
    assert not bart.needs_index and bart.batches == "documents" and bart.model_family == "marge"
    veco = objectives(veco={})
    assert veco.model_family == "veco" and not veco.needs_index
    assert objectives(veco={"pairs": "index"}).needs_index
    mixture = objectives(marge={}, bart={"weight": 0.5})
    assert mixture.primary == "marge" and mixture.batches == "retrieval" and mixture.extra_target_passes == 1


@pytest.mark.parametrize("sections, message", [
    ({"veco": {}, "bart": {}}, "cannot share a run with marge or bart"),
    ({"bart": {}, "denoising_contrastive": {"weight": 0.3}}, "auxiliary of the marge objective"),
    ({"bart": {"text_infilling": 1.5}}, "objectives.bart.text_infilling must be in [0.0, 1.0], got 1.5"),
    ({"veco": {"pairs": "bitext"}}, "objectives.veco.pairs must be one of ['halves', 'index']"),
    ({"veco": {"mask_share": 0}}, "objectives.veco.mask_share must be > 0"),
])
def test_bad_objectives_are_refused_naming_the_field(sections, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        objectives(**sections)


def test_shipped_bart_and_veco_configs_need_no_index_and_veco_gets_its_own_model():
    bart = load_config("deploy/configs/tiny-bart.yaml")
    assert bart.version_plan() == VersionPlan.without_index() and bart.batch_shape().kind == "documents"
    assert type(bart.model_config(8000)).__name__ == "MargeConfig"
    veco = load_config("deploy/configs/tiny-veco.yaml")
    assert type(veco.model_config(8000)).__name__ == "VecoConfig" and veco.model_config(8000).layers == 6
    with pytest.raises(ConfigError, match="unknown model field.*relevance_layers.*veco"):
        load_config("deploy/configs/tiny-veco.yaml", ["model.relevance_layers=1"])


# --- the batcher: documents without an index, and the budget of a mixture ---------------------------


def test_document_batches_cover_each_document_once_per_pass_under_the_budget(small_corpus):
    docs = DocumentStore(Corpus.open(small_corpus))
    shape, cfg = BatchShape("documents"), BatcherConfig(max_tokens=400)
    batches = list(corpus_epoch_batches(docs, cfg, shape, epoch=0, seed=3))
    seen = [int(b.doc_ids[i]) for b in batches for i in b.targets]
    fitting = {d for s in docs.shard_numbers for d, n in docs.shard(s).lengths().items()
               if shape.document_cost(n) <= 400}
    assert sorted(seen) == sorted(fitting)
    for b in batches:
        assert sum(shape.document_cost(len(b.doc_tokens[i])) for i in b.targets) <= 400
        assert list(b.targets) == list(b.evidence) and b.index_version == -1
    again = list(corpus_epoch_batches(docs, cfg, shape, epoch=0, seed=3))
    assert [b.batch_id for b in again] == [b.batch_id for b in batches]
    assert [b.batch_id for b in corpus_epoch_batches(docs, cfg, shape, epoch=1, seed=3)][:3] != \
        [b.batch_id for b in batches][:3]


def test_schedule_without_an_index_resumes_on_the_same_batches(small_corpus):
    docs = DocumentStore(Corpus.open(small_corpus))
    slots = Slots(2, 1)

    def schedule():
        return BatchSchedule(docs, BatcherConfig(max_tokens=400), 0, slots, VersionPlan.without_index(),
                             lambda v: pytest.fail("a run without an index loads no version"), BatchShape("documents"))

    straight = [b.batch_id for _, b in zip(range(40), (b for _, b in schedule().batches(0)))]
    resumed = [b.batch_id for _, b in zip(range(20), (b for _, b in schedule().batches(20)))]
    assert resumed == straight[20:]
    parsed = [BatchId.parse(i) for i in straight]
    assert all(p is not None and p.version == 0 for p in parsed)  # the protocol's ids, version 0: no index


# --- what each objective makes of a batch -----------------------------------------------------------


def test_bart_inputs_are_noised_copies_each_target_sees_only_its_own():
    batch = toy_batch(np.random.default_rng(0))
    prepared = toy_objectives(objectives(bart={})).prepare(batch, (0, 0, 0)).parts["bart"]
    assert torch.equal(prepared["allowed_NM"], torch.eye(3, dtype=torch.bool))
    for row, t in enumerate(batch.targets):
        source = [x for x in prepared["evidence_MS"][row].tolist() if x != SPECIALS.pad_id][1:-1]
        original = batch.doc_tokens[t].tolist()
        assert source != original and SPECIALS.mask_id in source  # 30% infilled: never the clean text
        assert prepared["labels_NT"][row, : len(original)].tolist() == original
    again = toy_objectives(objectives(bart={})).prepare(batch, (0, 0, 0)).parts["bart"]
    assert torch.equal(again["evidence_MS"], prepared["evidence_MS"])  # seeded by (seed, step, slot)


def test_bart_loss_without_relevance_equals_the_biased_loss_when_each_target_sees_one_document():
    """With one visible document per target, beta * f shifts all of a target's logits equally: the model's
    relevance-free path (no g pass) must give the same loss."""
    batch = toy_batch(np.random.default_rng(1))
    inputs = toy_objectives(objectives(bart={})).prepare(batch, (0, 0, 0)).parts["bart"]
    model = marge_model()
    from marge.contracts.batch import as_encoder_input
    from marge.model.layers import pad_rows

    targets_enc = pad_rows([as_encoder_input(batch.doc_tokens[t], SPECIALS) for t in batch.targets], 0)
    free = model(inputs["evidence_MS"], None, inputs["decoder_in_NT"], inputs["labels_NT"], inputs["allowed_NM"])
    biased = model(inputs["evidence_MS"], targets_enc, inputs["decoder_in_NT"], inputs["labels_NT"],
                   inputs["allowed_NM"])
    assert float(free.loss.detach()) == pytest.approx(float(biased.loss.detach()), abs=1e-5)
    assert torch.count_nonzero(free.relevance_NM) == 0


def test_veco_halves_split_at_the_sentence_end_nearest_the_middle():
    tokens = np.array([10, 11, SENTENCE_END, 12, 13, 14, SENTENCE_END, 15, 16, 17, 18, 19, 20], dtype=np.int32)
    x, y = split_in_halves(tokens, np.array([SENTENCE_END]))
    assert x.tolist() == [10, 11, SENTENCE_END, 12, 13, 14, SENTENCE_END] and x.size + y.size == tokens.size
    x, y = split_in_halves(np.arange(10, 20, dtype=np.int32), np.array([SENTENCE_END]))
    assert len(x) == len(y) == 5  # no sentence end: the middle


def test_veco_index_pairs_take_each_targets_strongest_cross_lingual_link():
    batch = toy_batch(np.random.default_rng(2))
    objective = toy_objectives(objectives(veco={"pairs": "index"})).plugins[0]
    pairs = objective.pairs(batch)
    assert len(pairs) == 3
    for (x, y), t in zip(pairs, batch.targets):
        assert np.array_equal(x, batch.doc_tokens[t]) and np.array_equal(y, batch.doc_tokens[3])  # weight 100: e=0


def test_veco_labels_only_where_tokens_were_chosen():
    batch = toy_batch(np.random.default_rng(3))
    parts = toy_objectives(objectives(veco={"mask_share": 0.3})).prepare(batch, (0, 0, 0)).parts["veco"]
    for side in ("x", "y"):
        inputs, labels = parts[f"{side}_in_BS"], parts[f"{side}_labels_BS"]
        chosen = labels != SPECIALS.pad_id
        assert chosen.any() and not chosen[:, 0].any()  # never BOS
        unchanged = ~chosen & (inputs != SPECIALS.pad_id)
        assert not (inputs[unchanged] == SPECIALS.mask_id).any()  # masks only at chosen positions


# --- losses ------------------------------------------------------------------------------------------


def test_mixture_sums_weighted_losses_and_logs_each():
    batch = toy_batch(np.random.default_rng(4))
    cfg = objectives(marge={"weight": 1.0}, bart={"weight": 0.5})
    plugins = toy_objectives(cfg)
    prepared = plugins.prepare(batch, (0, 0, 0))
    losses = plugins.losses(marge_model(), prepared, torch.device("cpu"), bf16=False)
    assert set(losses.parts) == {"marge", "bart"}
    assert float(losses.objective.detach()) == pytest.approx(
        float(losses.parts["marge"]) + 0.5 * float(losses.parts["bart"]), rel=1e-6)
    assert int(losses.target_tokens) == sum(len(batch.doc_tokens[t]) + 1 for t in batch.targets)


def test_objectives_for_reads_sentence_ends_and_vocabulary_from_the_tokenizer(small_corpus):
    tokenizer = Corpus.open(small_corpus).tokenizer()
    plugins = objectives_for(objectives(bart={}), tokenizer)
    bart = plugins.plugins[0]
    assert bart.vocab_size == tokenizer.vocab_size and len(bart.sentence_ends) > 0
    assert all(tokenizer.sp.id_to_piece(int(i)).endswith(tuple(SENTENCE_END_CHARACTERS)) for i in bart.sentence_ends)
    assert tokenizer.sp.piece_to_id(".") in bart.sentence_ends or tokenizer.sp.piece_to_id("▁.") in bart.sentence_ends
    assert tokenizer.specials.mask_id == tokenizer.sp.unk_id()
    assert tokenizer.specials.mask_id not in {t for ids in tokenizer.encode_batch(["Hello world. 你好"]) for t in ids}


def test_marge_objective_config_defaults_are_the_papers():
    assert MargeObjectiveConfig().attend_to == "all"
    assert BartObjectiveConfig().text_infilling == 0.3 and BartObjectiveConfig().poisson_lambda == 3.0
    assert BartObjectiveConfig().document_rotation == 0.0 and BartObjectiveConfig().sentence_permutation == 1.0
    assert VecoObjectiveConfig().mask_share == 0.15
