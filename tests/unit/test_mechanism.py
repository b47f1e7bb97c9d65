"""What teaches g to retrieve (experiments/mechanism): the detach and freeze switches, the oracle with the loop's
budget, held-out data that training never saw, and statistics that do not call noise an effect.

The tests of this subject that need a server or take long are in tests/integration/test_mechanism_study.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from marge.model.architecture import preset
from marge.model.network import Marge
from services.trainer.objectives import MargeObjectiveConfig, ObjectivesConfig, apply_objective_settings

REPO = Path(__file__).resolve().parents[2]


def tiny_inputs(vocab: int = 100, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    evidence = torch.randint(5, vocab, (4, 9), generator=g)
    evidence[:, 0] = 1
    targets = torch.randint(5, vocab, (3, 9), generator=g)
    targets[:, 0] = 1
    decoder_in, labels = torch.randint(5, vocab, (3, 7), generator=g), torch.randint(5, vocab, (3, 7), generator=g)
    return dict(evidence_MS=evidence, target_enc_NS=targets, decoder_in_NT=decoder_in, labels_NT=labels,
                allowed_NM=torch.ones(3, 4, dtype=torch.bool))


def gradients(model: Marge, detach: bool) -> tuple[float, dict]:
    model.zero_grad()
    model.relevance_center.zero_()
    out = model(**tiny_inputs(), detach_relevance=detach)
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_detached_relevance_keeps_every_value_and_stops_only_the_gradient_through_f():
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=100, max_positions=32, relevance_pooling="mean", relevance_layers=1,
                 relevance_centering=True, tie_encoder_embeddings=False)
    model = Marge(cfg).train()
    loss, full = gradients(model, detach=False)
    loss_detached, detached = gradients(model, detach=True)
    assert loss_detached == loss  # beta * f still biases the attention: the same forward
    assert torch.equal(full["beta"], detached["beta"])  # beta's gradient needs f's value, not its graph
    # the decoder's own parameters see the same f, so the same gradient; g's layer gets less (no path through f)
    assert torch.allclose(full["decoder_norm.weight"], detached["decoder_norm.weight"])
    g_layer = "encoder_layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(full[g_layer], detached[g_layer])
    # the part that differs is exactly the gradient that reaches g through f: with beta at 0, f carries no signal
    with torch.no_grad():
        model.beta.zero_()
    _, zero_full = gradients(model, detach=False)
    _, zero_detached = gradients(model, detach=True)
    assert torch.allclose(zero_full[g_layer], zero_detached[g_layer], atol=1e-7)


def test_the_marge_objective_passes_the_switch_and_freezing_beta_takes_it_out_of_training(paragraph_corpus):
    from marge.contracts.batch import Batch
    from marge.contracts.corpus import Corpus
    from services.trainer.config import TrainerConfig
    from services.trainer.objectives import objectives_for
    from services.trainer.step import reference_train

    corpus = Corpus.open(paragraph_corpus)
    tokenizer = corpus.tokenizer()
    shard = corpus.read_shard(0)
    n = 6
    batch = Batch("b", 0, 0, shard.doc_ids[:n], tuple(shard.langs[:n]), tuple(shard.tokens[:n]),
                  np.array([0, 1, 2], dtype=np.int32), np.array([3, 4, 5], dtype=np.int32),
                  np.array([[0, 0], [1, 1], [2, 2]], dtype=np.int32), np.ones(3, dtype=np.float32))
    cfg = ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked", detach_relevance=True, train_beta=False))
    objectives = objectives_for(cfg, tokenizer)
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=tokenizer.vocab_size, max_positions=64))
    records = reference_train(model, [[batch], [batch]], objectives, TrainerConfig(lr=1e-2, warmup_steps=1), 2)
    assert [r.beta for r in records] == [[1.0], [1.0]] and not model.beta.requires_grad
    assert all(np.isfinite(r.loss) for r in records)
    assert apply_objective_settings(Marge(model.cfg), ObjectivesConfig()).beta.requires_grad  # the default trains beta


def test_the_budget_oracle_fills_the_loops_link_budget_with_translations_first(paragraph_corpus):
    from marge.contracts.corpus import Corpus
    from services.indexer.config import IndexerConfig
    from services.indexer.links import budget_aligned_links, version_links

    docs = Corpus.open(paragraph_corpus).read_shard(0)
    cfg = IndexerConfig(links="aligned", aligned_layout="budget", links_monolingual=2, links_crosslingual=4,
                        link_rule="document")
    first = budget_aligned_links(docs, cfg, np.random.default_rng([0, 0]))
    pos = {int(d): i for i, d in enumerate(docs.doc_ids)}
    rows = [(pos[int(t)], pos[int(e)], float(s), bool(c)) for t, e, s, c in
            zip(first["target_id"], first["evidence_id"], first["score"], first["cross_lingual"])]
    for i in range(len(docs)):
        mine = [r for r in rows if r[0] == i]
        mono = [r for r in mine if not r[3]]
        cross = [r for r in mine if r[3]]
        assert len(mono) <= 2 and all(docs.langs[e] == docs.langs[i] for _, e, _, _ in mono)
        others = int((docs.langs != docs.langs[i]).sum())
        assert len(cross) == min(4, others) and all(docs.langs[e] != docs.langs[i] for _, e, _, _ in cross)
        translations = [docs.translations(i, e) for _, e, _, _ in cross]
        assert translations == sorted(translations, reverse=True)  # aligned translations first, then random ones
        assert all(t == (s == 1.0) for t, (_, _, s, _) in zip(translations, cross))
    # a rebuild draws new random cross-lingual links and keeps the translations and the TF-IDF neighbours
    again = version_links(docs, np.zeros((len(docs), 4), dtype=np.float32), cfg, snapshot_step=250)
    later = {(int(t), int(e)) for t, e in zip(again["target_id"], again["evidence_id"])}
    before = {(int(t), int(e)) for t, e in zip(first["target_id"], first["evidence_id"])}
    kept = {(int(t), int(e)) for t, e, score, cross in
            zip(first["target_id"], first["evidence_id"], first["score"], first["cross_lingual"]) if score > 0 or not cross}
    assert kept <= later and later != before


def test_the_heldout_probe_is_disjoint_from_the_training_text(demo_raw):
    """The held-out pages are never training pages; the held-out pairs, and the mechanism study's targets, never
    have a text a training document has (boilerplate paragraphs that held-out pages share with training pages are
    dropped from the targets)."""
    from marge.contracts.corpus import split_paragraphs
    from marge.eval.evaluation import read_pairs

    training, heldout = ({r["group"]: r for r in map(json.loads, gzip.open(demo_raw / name, "rt", encoding="utf-8"))}
                         for name in ("documents.jsonl.gz", "heldout_documents.jsonl.gz"))
    training_rows = [json.loads(line) for line in gzip.open(demo_raw / "documents.jsonl.gz", "rt", encoding="utf-8")]
    assert not set(training) & set(heldout)
    seen = {(r["language"], p) for r in training_rows for p in split_paragraphs(r["text"])}
    for pair in read_pairs(demo_raw / "heldout_pairs.tsv"):
        assert not any((pair.src_lang, s) in seen for s in pair.sources)
        assert not any((pair.tgt_lang, t) in seen for t in pair.targets)
    overlap = sum(1 for r in map(json.loads, gzip.open(demo_raw / "heldout_documents.jsonl.gz", "rt", encoding="utf-8"))
                  for p in split_paragraphs(r["text"]) if (r["language"], p) in seen)
    assert overlap > 0  # held-out pages do share paragraphs with training pages: the probe must drop them


def test_mechanism_targets_drop_every_text_training_has(paragraph_corpus, demo_raw):
    from experiments.mechanism.measures import training_documents
    from marge.contracts.corpus import Corpus
    from services.trainer.health import build_aligned_probe

    corpus = Corpus.open(paragraph_corpus)
    tokenizer = corpus.tokenizer()
    seen = training_documents(corpus)
    # the paragraph corpus trains on 12 demo pages: held out from it, treat the whole demo training file as "held out"
    items = build_aligned_probe(demo_raw / "documents.jsonl.gz", tokenizer, 400, max_tokens=64, exclude=seen)
    assert items and not any((item.target_lang, tuple(item.target.tolist())) in seen for item in items)
    everything = build_aligned_probe(demo_raw / "documents.jsonl.gz", tokenizer, 400, max_tokens=64)
    assert len(everything) == 400 and len(items) == 400  # the draw continues past dropped targets
    assert {i.group for i in everything} != {i.group for i in items}


# ----------------------------------------------------------------------------------------------------
# The report's statistics
# ----------------------------------------------------------------------------------------------------


def test_the_bootstrap_resamples_pages_not_paragraphs():
    from marge.eval.evaluation import clustered_bootstrap

    # 20 pages of 50 paragraphs each; within a page every paragraph has the page's value: 20 observations, not 1,000
    rng = np.random.default_rng(0)
    page_values = rng.normal(0.0, 1.0, size=20)
    sums, counts = page_values * 50, np.full(20, 50.0)
    by_page = clustered_bootstrap(sums, counts)
    width = by_page["ci95"][1] - by_page["ci95"][0]
    assert width == pytest.approx(2 * 1.96 * page_values.std() / np.sqrt(20), rel=0.25)
    paragraphs = clustered_bootstrap(np.repeat(page_values, 50), np.ones(1000))
    assert paragraphs["ci95"][1] - paragraphs["ci95"][0] < width / 4  # as if 1,000 were independent


def test_the_committed_report_holds_the_schema_and_the_figures_the_readme_quotes():
    """experiments/mechanism/results/report.json is what a reader's script reads and what README.md quotes: every arm at
    equal updates over at least 3 seeds with all five evidence conditions, and the named contrasts."""
    report = json.loads((REPO / "experiments/mechanism/results/report.json").read_text(encoding="utf-8"))
    for name, arm in report["arms"].items():
        assert len(arm["seeds"]) >= 3, name
        assert {"none", "retrieved", "gold", "wrong_page", "self_copy"} <= set(arm["nll"]), name
        assert {"mean", "ci95"} <= set(arm["p_at_1"]) and {"mean", "ci95"} <= set(arm["p_at_1_init"]), name
        assert isinstance(arm["aux_loss"], bool) and isinstance(arm["detached_f"], bool) and arm["index"], name
        assert arm["aligned_link_precision"], name
    assert len({arm["updates"] for arm in report["arms"].values()}) == 1  # equal updates
    for name in ("beta_f_vs_detached_loop", "beta_f_vs_detached_loop_own_reads", "loop_vs_tfidf_frozen_own_reads"):
        contrast = report["contrasts"][name]
        lo, hi = contrast["ci95"]
        assert lo <= contrast["delta"] <= hi, name
        assert len(contrast["by_seed"]) >= 3, name
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    recipe = report["contrasts"]["beta_f_vs_detached_loop_own_reads"]
    quoted = f"{recipe['delta']:.3f} (95% CI {recipe['ci95'][0]:.3f} to {recipe['ci95'][1]:.3f})"
    assert quoted in readme, quoted


def test_the_study_page_quotes_every_row_of_the_committed_reports_tables():
    """experiments/mechanism/README.md holds the tables `python -m experiments.mechanism tables` prints from the
    committed report, row for row: no table figure on that page is copied by hand."""
    from experiments.mechanism.tables import markdown_tables

    report = json.loads((REPO / "experiments/mechanism/results/report.json").read_text(encoding="utf-8"))
    page = (REPO / "experiments/mechanism/README.md").read_text(encoding="utf-8")
    rows = [line for line in markdown_tables(report).splitlines() if line.startswith("| `")]
    assert len(rows) >= len(report["arms"]) + len(report["contrasts"])
    missing = [row for row in rows if row not in page]
    assert not missing, missing


# ----------------------------------------------------------------------------------------------------
# Where g's gradient comes from, and the levers on it
# ----------------------------------------------------------------------------------------------------


def crosslingual_batch(paragraph_corpus, n: int = 8):
    """A batch of the paragraph corpus: targets 0..n/2-1 each linked to two documents, in several languages."""
    from marge.contracts.batch import Batch
    from marge.contracts.corpus import Corpus

    corpus = Corpus.open(paragraph_corpus)
    shard = corpus.read_shard(0)
    half = n // 2
    edges = np.array([[t, e] for t in range(half) for e in (t, (t + 1) % half)], dtype=np.int32)
    batch = Batch("b", 0, 0, shard.doc_ids[:n], tuple(shard.langs[:n]), tuple(shard.tokens[:n]),
                  np.arange(half, dtype=np.int32), np.arange(half, n, dtype=np.int32), edges,
                  np.ones(len(edges), dtype=np.float32))
    return corpus.tokenizer(), batch


def tiny_model(vocab: int, **overrides) -> Marge:
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=vocab, max_positions=64, relevance_pooling="mean", relevance_layers=1,
                 relevance_centering=True, **overrides)
    return Marge(cfg).train()


def g_gradient(model: Marge, objectives, prepared) -> list[torch.Tensor]:
    from services.trainer.gradient_paths import relevance_parameters

    params = [p for ps in relevance_parameters(model).values() for p in ps]
    centre = model.relevance_center.clone()
    loss = objectives.losses(model, prepared, torch.device("cpu"), False).objective
    grads = torch.autograd.grad(loss, params)
    model.relevance_center.copy_(centre)
    return list(grads)


@pytest.mark.parametrize("tied", [True, False])
def test_the_f_share_of_gs_gradient_is_exactly_what_detaching_f_removes(paragraph_corpus, tied):
    from services.trainer.gradient_paths import gradient_paths
    from services.trainer.objectives import objectives_for

    tokenizer, batch = crosslingual_batch(paragraph_corpus)
    model = tiny_model(tokenizer.vocab_size, tie_encoder_embeddings=tied)
    with torch.no_grad():
        model.beta.fill_(3.0)  # a bias large enough that the f path is far from rounding
    attached = objectives_for(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked")), tokenizer)
    detached = objectives_for(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked", detach_relevance=True)),
                              tokenizer)
    prepared, prepared_detached = attached.prepare(batch, (0, 3, 0)), detached.prepare(batch, (0, 3, 0))
    full = g_gradient(model, attached, prepared)
    without_f = g_gradient(model, detached, prepared_detached)
    through_f = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(full, without_f)))
    whole = torch.sqrt(sum((a ** 2).sum() for a in full))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    centre, rng = model.relevance_center.clone(), torch.get_rng_state()

    paths = gradient_paths(model, attached, [prepared], torch.device("cpu"))
    assert paths["f_gradient_share"] == pytest.approx(float(through_f / whole), rel=1e-4)
    assert 0 < paths["f_gradient_share"] < 1 and paths["g_gradient_norm"] == pytest.approx(float(whole), rel=1e-5)
    assert 0 < paths["f_gradient_share_embedding"] and 0 < paths["f_gradient_share_layers"]
    # measuring changes nothing the run trains with: weights, gradients, the running centre, the random state
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    assert torch.equal(model.relevance_center, centre) and torch.equal(torch.get_rng_state(), rng)
    assert gradient_paths(model, detached, [prepared_detached], torch.device("cpu"))["f_gradient_share"] == 0.0


def test_relevance_distillation_trains_g_through_f_even_with_beta_f_detached(paragraph_corpus):
    from services.trainer.gradient_paths import gradient_paths
    from services.trainer.objectives import RelevanceDistillationConfig, objectives_for, relevance_distillation_loss

    tokenizer, batch = crosslingual_batch(paragraph_corpus)
    model = tiny_model(tokenizer.vocab_size)
    cfg = ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked", detach_relevance=True),
                           relevance_distillation=RelevanceDistillationConfig(weight=1.0, crosslingual_only=False))
    objectives = objectives_for(cfg, tokenizer)
    prepared = objectives.prepare(batch, (0, 0, 0))
    inputs = prepared.parts["marge"]
    out = model(**inputs.as_kwargs(), width=inputs.width, detach_relevance=True, reading=True)
    # the teacher: a distribution over the documents each target may read, with no gradient
    assert out.reading_NM is not None and not out.reading_NM.requires_grad
    assert torch.allclose(out.reading_NM.sum(1), torch.ones(len(out.reading_NM)))
    assert bool((out.reading_NM[~inputs.allowed_NM] == 0).all()) and bool((out.reading_NM[inputs.allowed_NM] > 0).all())
    # the same teacher on the unpadded layout
    from services.trainer.inputs import to_model_inputs

    unpadded = to_model_inputs(batch, tokenizer.specials, "linked", unpadded=True)
    out_unpadded = model(**unpadded.as_kwargs(), layout=unpadded.layout, detach_relevance=True, reading=True)
    assert torch.allclose(out_unpadded.reading_NM, out.reading_NM, atol=1e-5)
    # f matched to the teacher: zero loss when f's softmax is the teacher, positive otherwise
    teacher = out.reading_NM
    exact = torch.where(inputs.allowed_NM, teacher.clamp(min=1e-12).log() * 0.1, torch.zeros_like(teacher))
    assert float(relevance_distillation_loss(exact, teacher, inputs.allowed_NM, 0.1)) == pytest.approx(0, abs=1e-5)
    assert float(relevance_distillation_loss(torch.zeros_like(teacher), teacher, inputs.allowed_NM, 0.1)) > 0
    # with beta * f detached, the reconstruction sends g nothing through f; the distillation does
    losses = objectives.losses(model, prepared, torch.device("cpu"), False)
    assert set(losses.parts) == {"marge", "relevance_distillation"} and objectives.part_names == tuple(losses.parts)
    paths = gradient_paths(model, objectives, [prepared], torch.device("cpu"))
    assert paths["f_gradient_share"] == 0.0 and paths["distillation_gradient_share"] > 0


def test_crosslingual_candidates_leave_out_same_language_evidence(paragraph_corpus):
    from services.trainer.inputs import to_model_inputs

    tokenizer, batch = crosslingual_batch(paragraph_corpus)
    inputs = to_model_inputs(batch, tokenizer.specials, "linked")
    langs = np.asarray(batch.doc_langs, dtype=object)
    expected = langs[batch.targets][:, None] != langs[batch.evidence][None, :]
    assert torch.equal(inputs.crosslingual_NM, torch.from_numpy(expected.astype(bool)))


def test_f_detached_until_an_update_then_attached(paragraph_corpus):
    from services.trainer.objectives import objectives_for

    tokenizer, batch = crosslingual_batch(paragraph_corpus)
    cfg = ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked", detach_relevance_until=100))
    objectives = objectives_for(cfg, tokenizer)
    assert objectives.prepare(batch, (0, 99, 0)).parts["marge"].detach_relevance
    assert not objectives.prepare(batch, (0, 100, 0)).parts["marge"].detach_relevance
    assert cfg.marge is not None and cfg.marge.detached_at(99) and not cfg.marge.detached_at(100)
    with pytest.raises(Exception, match="detach_relevance_until"):
        MargeObjectiveConfig(detach_relevance_until=-1)


def test_beta_gets_a_learning_rate_of_its_own_only_when_asked():
    from services.trainer.config import TrainerConfig
    from services.trainer.step import build_optimizer, build_scheduler

    model = tiny_model(100)
    plain = build_optimizer(model, TrainerConfig(lr=1e-3))
    assert len(plain.param_groups) == 2
    scaled = build_optimizer(model, TrainerConfig(lr=1e-3, beta_lr_scale=20.0, warmup_steps=0))
    beta_group = [g for g in scaled.param_groups if any(p is model.beta for p in g["params"])]
    assert len(scaled.param_groups) == 3 and len(beta_group) == 1 and beta_group[0]["params"] == [model.beta]
    scheduler = build_scheduler(scaled, TrainerConfig(lr=1e-3, beta_lr_scale=20.0, warmup_steps=0), 10)
    scaled.step()  # (no gradients: nothing moves)
    scheduler.step()  # the schedule scales every group alike
    assert beta_group[0]["lr"] == pytest.approx(20 * scaled.param_groups[0]["lr"])
    with pytest.raises(Exception, match="beta_lr_scale"):
        TrainerConfig(beta_lr_scale=0)


def test_an_own_relevance_encoder_is_trained_by_f_alone_and_indexed_as_g(paragraph_corpus):
    from marge.model.network import RelevanceEncoder
    from services.trainer.gradient_paths import gradient_paths
    from services.trainer.inputs import to_model_inputs
    from services.trainer.objectives import objectives_for

    tokenizer, batch = crosslingual_batch(paragraph_corpus)
    model = tiny_model(tokenizer.vocab_size, own_relevance_encoder=True)
    tower = model.relevance_encoder
    assert tower is not None
    inputs = to_model_inputs(batch, tokenizer.specials, "linked")
    # the indexer's g is the tower's, and the memory's encoder layers play no part in it
    encoder = RelevanceEncoder.from_model(model).eval()
    model.eval()
    rows = inputs.evidence_MS
    assert torch.allclose(encoder(rows), model.relevance_vectors(rows), atol=1e-6)
    with torch.no_grad():
        model.encoder_layers[0].ffn.fc_in.weight.mul_(3.0)
        model.encoder_token_embedding.weight.mul_(2.0)
    assert torch.allclose(encoder(rows), model.relevance_vectors(rows), atol=1e-6)
    model.train()
    # with f detached and no loss on g, nothing reaches the tower; attached, all of g's gradient comes through f
    out = model(**inputs.as_kwargs(), width=inputs.width, detach_relevance=True)
    out.loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in tower.parameters())
    assert model.encoder_layers[0].ffn.fc_in.weight.grad.abs().sum() > 0  # the memory's layers still learn
    model.zero_grad()
    objectives = objectives_for(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked")), tokenizer)
    paths = gradient_paths(model, objectives, [objectives.prepare(batch, (0, 0, 0))], torch.device("cpu"))
    assert paths["f_gradient_share"] == pytest.approx(1.0, rel=1e-5) and paths["g_gradient_norm"] > 0
    # the unpadded layout gives the padded loss and the same gradient on the tower
    unpadded = to_model_inputs(batch, tokenizer.specials, "linked", unpadded=True)
    padded_out = model(**inputs.as_kwargs(), width=inputs.width)
    padded_grad = torch.autograd.grad(padded_out.loss, tower.layers[0].ffn.fc_in.weight)[0]
    real_out = model(**unpadded.as_kwargs(), layout=unpadded.layout)
    real_grad = torch.autograd.grad(real_out.loss, tower.layers[0].ffn.fc_in.weight)[0]
    assert real_out.loss.item() == pytest.approx(padded_out.loss.item(), rel=1e-5)
    assert torch.allclose(real_grad, padded_grad, rtol=1e-3, atol=1e-7)
