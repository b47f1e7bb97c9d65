"""Unpadded batches (`trainer.unpadded`, `marge.model.layers.UnpaddedLayout`): the same loss and gradients as the padded
batch, fewer FLOPs, and the vectorised host preparation equal to the row-by-row one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from marge.contracts.batch import Batch, SpecialTokens, as_decoder_input, as_encoder_input, as_labels
from marge.model.architecture import preset
from marge.model.network import Marge
from services.trainer.inputs import to_model_inputs

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]

SPECIALS = SpecialTokens(pad_id=0, bos_id=2, eos_id=3, lang_ids={"en": 10, "de": 11, "fr": 12})


def skewed_batch(seed: int = 0, docs: int = 60, targets: int = 20, links: int = 4) -> Batch:
    """Many short documents and a few long ones (a recipe batch's shape); each target linked to `links` others."""
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(docs) < 0.85, rng.integers(1, 20, size=docs), rng.integers(30, 60, size=docs))
    tokens = tuple(rng.integers(20, 200, size=n).astype(np.int32) for n in lengths)
    evidence = np.arange(targets - 5, docs, dtype=np.int32)  # some targets are evidence too (their own is masked)
    edges = np.array([(t, e) for t in range(targets) for e in rng.choice(len(evidence), size=links, replace=False)],
                     dtype=np.int32)
    return Batch("skewed", 0, 0, np.arange(docs, dtype=np.int64), tuple(["en", "de", "fr"][i % 3] for i in range(docs)),
                 tokens, np.arange(targets, dtype=np.int32), evidence, edges, np.ones(len(edges), dtype=np.float32))


def loss_and_gradients(model: Marge, inputs, detach: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    model.relevance_center.zero_()
    out = model(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout, detach_relevance=detach)
    out.loss.backward()
    return float(out.loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attend_to,chunk,detach,pooling", [("linked", 0, False, "mean"), ("all", 0, False, "mean"),
                                                            ("linked", 16, False, "mean"), ("all", 16, False, "bos"),
                                                            ("linked", 0, True, "bos")])
def test_unpadded_gives_the_padded_batchs_loss_and_gradients(attend_to, chunk, detach, pooling):
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=200, dropout=0.0, relevance_centering=True, relevance_layers=1,
                         relevance_pooling=pooling)).train()
    model.loss_chunk_tokens = chunk
    batch = skewed_batch()
    padded = to_model_inputs(batch, SPECIALS, attend_to)
    unpadded = to_model_inputs(batch, SPECIALS, attend_to, unpadded=True)
    assert unpadded.layout is not None and (unpadded.layout.key_index_NK is None) == (attend_to == "all")
    loss_padded, grads_padded = loss_and_gradients(model, padded, detach)
    loss_unpadded, grads_unpadded = loss_and_gradients(model, unpadded, detach)
    assert loss_unpadded == pytest.approx(loss_padded, rel=1e-6)
    assert grads_unpadded.keys() == grads_padded.keys() and "beta" in grads_unpadded
    scale = max(float(g.abs().max()) for g in grads_padded.values())
    for name, g in grads_padded.items():  # to rounding, against the largest gradient (k_proj.bias's is 0 in exact math)
        assert torch.allclose(grads_unpadded[name], g, rtol=1e-4, atol=1e-5 * scale), name


def test_the_denoising_views_unpadded_give_the_same_loss_and_gradients():
    from services.trainer.objectives import DenoisingContrastiveConfig, DenoisingContrastiveObjective

    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=200, dropout=0.0, relevance_layers=1, relevance_pooling="mean")).train()
    cfg = DenoisingContrastiveConfig(weight=0.3, extra_documents=0)
    figures = []
    for unpadded in (False, True):
        views = DenoisingContrastiveObjective(cfg, SPECIALS, unpadded).prepare(skewed_batch(), np.random.default_rng(3))
        assert ("first_real" in views) == unpadded
        model.zero_grad(set_to_none=True)
        loss = DenoisingContrastiveObjective(cfg, SPECIALS, unpadded).loss(model, views).loss
        loss.backward()
        figures.append((float(loss.detach()), model.encoder_layers[0].ffn.fc_in.weight.grad.clone()))
    assert figures[1][0] == pytest.approx(figures[0][0], rel=1e-6)
    assert torch.allclose(figures[1][1], figures[0][1], rtol=1e-4, atol=1e-6)


def test_each_target_reads_exactly_the_real_keys_of_its_documents():
    batch = skewed_batch(seed=1)
    inputs = to_model_inputs(batch, SPECIALS, "linked", unpadded=True)
    layout = inputs.layout
    lengths_M = (inputs.evidence_MS != 0).sum(1)
    assert int(layout.evidence.index_U.numel()) == int(lengths_M.sum())  # the memory: real tokens only
    rows, cols = layout.visible_NK.nonzero(as_tuple=True)
    docs = layout.key_doc_NK[rows, cols]
    assert bool(inputs.allowed_NM[rows, docs].all())
    for i in range(inputs.allowed_NM.shape[0]):  # every key of every document it may read, once, and nothing else
        seen = layout.key_index_NK[i][layout.visible_NK[i]]
        wanted = torch.cat([layout.evidence.first_R[j] + torch.arange(int(lengths_M[j]))
                            for j in inputs.allowed_NM[i].nonzero().flatten().tolist()])
        assert torch.equal(seen.sort().values, wanted.sort().values)
    # the real-token index of every block points at its non-padding entries
    for real, block in ((layout.evidence, inputs.evidence_MS), (layout.targets, inputs.target_enc_NS),
                        (layout.decoder, inputs.labels_NT)):
        assert torch.equal(real.take(block), block[block != 0])


def test_unpadded_executes_fewer_flops_on_a_skewed_batch():
    model = Marge(preset("tiny", vocab_size=200, dropout=0.0)).train()
    batch = skewed_batch(docs=120, targets=40)

    def flops(inputs) -> int:
        with FlopCounterMode(display=False) as counter:
            model(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout).loss.backward()
        return counter.get_total_flops()
    padded = flops(to_model_inputs(batch, SPECIALS, "linked"))
    unpadded = flops(to_model_inputs(batch, SPECIALS, "linked", unpadded=True))
    assert unpadded < 0.5 * padded, (unpadded, padded)


def test_vectorised_rows_equal_the_row_by_row_inputs():
    batch = skewed_batch(seed=2)
    inputs = to_model_inputs(batch, SPECIALS, "all")

    def rows(lists):
        width = max(len(r) for r in lists)
        return torch.tensor([list(r) + [0] * (width - len(r)) for r in lists])
    assert torch.equal(inputs.evidence_MS, rows([as_encoder_input(batch.doc_tokens[i], SPECIALS) for i in batch.evidence]))
    assert torch.equal(inputs.target_enc_NS, rows([as_encoder_input(batch.doc_tokens[i], SPECIALS) for i in batch.targets]))
    assert torch.equal(inputs.decoder_in_NT, rows([as_decoder_input(batch.doc_tokens[i], batch.doc_langs[i], SPECIALS)
                                                   for i in batch.targets]))
    assert torch.equal(inputs.labels_NT, rows([as_labels(batch.doc_tokens[i], SPECIALS) for i in batch.targets]))
    assert inputs.evidence_MS.dtype == torch.long


def test_a_layout_does_not_return_logits():
    model = Marge(preset("tiny", vocab_size=200)).eval()
    unpadded = to_model_inputs(skewed_batch(), SPECIALS, "linked", unpadded=True)
    with pytest.raises(ValueError, match="return_logits"):
        model(**unpadded.as_kwargs(), layout=unpadded.layout, return_logits=True)


def test_ranks_share_one_running_centre_of_g():
    """DDP broadcasts no buffers (`DDP_SETTINGS`): after each update every rank's running centre is the ranks' mean."""
    from services.trainer.loop import share_relevance_center
    from services.trainer.step import DDP_SETTINGS

    assert DDP_SETTINGS["broadcast_buffers"] is False
    ranks = [Marge(preset("tiny", vocab_size=50, relevance_centering=True)) for _ in range(2)]
    for k, model in enumerate(ranks):
        model.relevance_center.fill_(float(k + 1))  # each rank moved its own centre
    sent = [torch.cat([m.relevance_center.double(), torch.ones(1, dtype=torch.float64)]) for m in ranks]
    for model in ranks:  # all_reduce(sum) across the two ranks, as `reduce` does in place
        share_relevance_center(model, lambda values: values.copy_(sent[0] + sent[1]))
    for model in ranks:
        assert torch.allclose(model.relevance_center, torch.full_like(model.relevance_center, 1.5))
    alone = Marge(preset("tiny", vocab_size=50, relevance_centering=True))
    alone.relevance_center.fill_(0.25)
    share_relevance_center(alone, lambda values: None)  # one process: its own centre
    assert torch.allclose(alone.relevance_center, torch.full_like(alone.relevance_center, 0.25))


def test_the_trainers_step_trains_the_same_unpadded():
    """`train_step` (the single process's and the reference loop's update) with `trainer.unpadded`: the same losses
    and weights as padded, the recipe's auxiliaries included."""
    from services.trainer.config import TrainerConfig
    from services.trainer.objectives import (
        DenoisingContrastiveConfig,
        MargeObjectiveConfig,
        Objectives,
        ObjectivesConfig,
        SelfEvidenceConfig,
    )
    from services.trainer.step import reference_train

    batches = [[skewed_batch(seed=s)] for s in range(3)]
    runs = []
    for unpadded in (False, True):
        torch.manual_seed(0)
        model = Marge(preset("tiny", vocab_size=200, dropout=0.0, relevance_centering=True, relevance_layers=1,
                             relevance_pooling="mean"))
        objectives = Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked"),
                                                 self_evidence=SelfEvidenceConfig(prob=0.5, until=100),
                                                 denoising_contrastive=DenoisingContrastiveConfig(weight=0.3,
                                                                                                  extra_documents=4)),
                                SPECIALS, unpadded=unpadded)
        prepared = objectives.prepare(batches[0][0], (0, 0, 0))
        assert (prepared.parts["marge"].layout is not None) == unpadded
        assert ("first_real" in prepared.parts["denoising_contrastive"]) == unpadded
        records = reference_train(model, batches, objectives, TrainerConfig(lr=1e-3, warmup_steps=0), 3)
        runs.append(([r.loss for r in records], model.decoder_layers[0].ffn.fc_in.weight.detach().clone()))
    assert runs[1][0] == pytest.approx(runs[0][0], rel=1e-5)
    assert torch.allclose(runs[1][1], runs[0][1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("path", ["mask", "flex"])
@pytest.mark.parametrize("unpadded,attend_to", [(False, "linked"), (True, "linked"), (True, "all")])
def test_every_key_bias_path_gives_the_folded_loss_and_gradients(path, unpadded, attend_to):
    """trainer.key_bias: beta * f (and the encoder's padding) added by SDPA's mask or by FlexAttention's score_mod,
    heads 64 wide, equals the folded path's loss and every gradient (g's layers and beta included). FlexAttention
    has no CPU backward: there each cross-attention's output is compared without gradients (beta raised so that a
    1% error in beta * f fails; the loss at init barely moves with it), and the gradients only on a GPU."""
    from services.trainer.config import TrainerConfig
    from services.trainer.step import apply_execution_settings

    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=200, dropout=0.0, relevance_centering=True, relevance_layers=1)).train()
    inputs = to_model_inputs(skewed_batch(), SPECIALS, attend_to, unpadded=unpadded)
    trains = path != "flex" or torch.cuda.is_available()
    device = "cuda" if path == "flex" and trains else "cpu"
    model, inputs = model.to(device), inputs.to(device)
    if not trains:  # the loss barely moves with beta * f at init: compare what each cross-attention returns
        outputs: list[torch.Tensor] = []
        for layer in model.decoder_layers:
            layer.cross_attn.register_forward_hook(lambda module, args, out: outputs.append(out))
        with torch.no_grad():
            model.beta.fill_(5.0)  # beta * f large enough that a 1% error in it moves the outputs
            model(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout)
            folded, outputs[:] = list(outputs), []
            apply_execution_settings(model, TrainerConfig(key_bias=path))
            model(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout)
        assert len(outputs) == len(folded) == len(model.decoder_layers)
        for a, b in zip(outputs, folded):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        return
    loss_folded, grads_folded = loss_and_gradients(model, inputs)
    apply_execution_settings(model, TrainerConfig(key_bias=path))
    loss_other, grads_other = loss_and_gradients(model, inputs)
    assert loss_other == pytest.approx(loss_folded, rel=1e-5)
    assert grads_other.keys() == grads_folded.keys() and "beta" in grads_other
    scale = max(float(g.abs().max()) for g in grads_folded.values())
    for name, g in grads_folded.items():  # each against its own size (beta's is ~1e-6 at init): a 1% change of
        # beta * f fails; a key projection's bias gets 0 in exact math, rounding against the largest gradient
        own = scale if name.endswith("k_proj.bias") else float(g.abs().max())
        assert torch.allclose(grads_other[name], g, rtol=1e-4, atol=1e-5 * own), name


def test_flex_key_bias_refuses_attention_dropout_up_front():
    from marge.contracts.config import ConfigError
    from services.driver.config import load_config

    with pytest.raises(ConfigError, match="trainer.key_bias=flex has no attention dropout.*model.attention_dropout"):
        load_config(REPO / "deploy/configs/tiny.yaml", ["trainer.key_bias=flex", "model.attention_dropout=0.1"])
    with pytest.raises(ValueError, match="key_bias"):
        load_config(REPO / "deploy/configs/tiny.yaml", ["trainer.key_bias=fused"])
