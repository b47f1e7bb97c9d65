"""Length buckets (`trainer.length_buckets`, `marge.model.PackedLayout`): the same loss and gradients as the padded
batch, fewer FLOPs, and the vectorised host preparation equal to the row-by-row one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from marge.batch import Batch, SpecialTokens, as_decoder_input, as_encoder_input, as_labels
from marge.model import Marge, preset
from services.trainer.inputs import length_buckets, to_model_inputs

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


@pytest.mark.parametrize("attend_to,chunk,detach", [("linked", 0, False), ("all", 0, False), ("linked", 16, False),
                                                    ("all", 16, False), ("linked", 0, True)])
def test_length_buckets_give_the_padded_batchs_loss_and_gradients(attend_to, chunk, detach):
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=200, dropout=0.0, relevance_centering=True, relevance_layers=1,
                         relevance_pooling="mean")).train()
    model.loss_chunk_tokens = chunk
    batch = skewed_batch()
    padded = to_model_inputs(batch, SPECIALS, attend_to)
    packed = to_model_inputs(batch, SPECIALS, attend_to, max_buckets=3)
    assert packed.layout is not None and len(packed.layout.evidence_rows) == 3
    loss_padded, grads_padded = loss_and_gradients(model, padded, detach)
    loss_packed, grads_packed = loss_and_gradients(model, packed, detach)
    assert loss_packed == pytest.approx(loss_padded, rel=1e-6)
    assert grads_packed.keys() == grads_padded.keys() and "beta" in grads_packed
    scale = max(float(g.abs().max()) for g in grads_padded.values())
    for name, g in grads_padded.items():  # to rounding, against the largest gradient (k_proj.bias's is 0 in exact math)
        assert torch.allclose(grads_packed[name], g, rtol=1e-4, atol=1e-5 * scale), name


def test_length_buckets_follow_the_rows_order_and_mask_consistently():
    """Rows sorted by length; the masks permuted with them, so a target's links and its own document stay its own."""
    batch = skewed_batch(seed=1)
    padded = to_model_inputs(batch, SPECIALS, "linked")
    packed = to_model_inputs(batch, SPECIALS, "linked", max_buckets=4)
    lengths = (packed.labels_NT != 0).sum(1)
    assert bool((lengths[1:] >= lengths[:-1]).all())
    order_N = np.argsort([len(batch.doc_tokens[i]) for i in batch.targets], kind="stable")
    order_M = np.argsort([len(batch.doc_tokens[i]) for i in batch.evidence], kind="stable")
    assert torch.equal(packed.linked_NM, padded.linked_NM[order_N][:, order_M])
    assert torch.equal(packed.evidence_MS[:, :padded.evidence_MS.shape[1]], padded.evidence_MS[order_M])
    layout = packed.layout
    # every visible key slot points at a real token of a document the target may read
    rows, cols = layout.visible_NK.nonzero(as_tuple=True)
    docs = layout.key_doc_NK[rows, cols]
    assert bool(packed.allowed_NM[rows, docs].all())
    assert int(layout.visible_NK.sum()) == int(sum((packed.evidence_MS[packed.allowed_NM[i]] != 0).sum()
                                                   for i in range(len(lengths))))


def test_length_buckets_are_the_least_padding_split():
    rng = np.random.default_rng(0)
    for _ in range(30):
        lengths = np.sort(rng.integers(1, 70, size=rng.integers(1, 12)))
        for most in (1, 2, 3):
            buckets = length_buckets(lengths, most)
            assert 1 <= len(buckets) <= most and buckets[0][0] == 0 and buckets[-1][1] == len(lengths)
            assert all(a[1] == b[0] for a, b in zip(buckets, buckets[1:]))
            assert all(int(lengths[end - 1]) <= positions for _, end, positions in buckets)
            padded = sum((end - first) * positions for first, end, positions in buckets)

            def cost(cut_points):
                edges = [0, *cut_points, len(lengths)]
                return sum((b - a) * min(-(-int(lengths[b - 1]) // 8) * 8, int(lengths[-1]))
                           for a, b in zip(edges, edges[1:]) if b > a)
            best = min(cost(c) for k in range(most) for c in itertools.combinations(range(1, len(lengths)), k))
            assert padded == best


def test_length_buckets_execute_fewer_flops_on_a_skewed_batch():
    model = Marge(preset("tiny", vocab_size=200, dropout=0.0)).train()
    batch = skewed_batch(docs=120, targets=40)

    def flops(inputs) -> int:
        with FlopCounterMode(display=False) as counter:
            model(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout).loss.backward()
        return counter.get_total_flops()
    padded, packed = flops(to_model_inputs(batch, SPECIALS, "linked")), flops(to_model_inputs(batch, SPECIALS, "linked", 3))
    assert packed < 0.5 * padded, (packed, padded)


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
    packed = to_model_inputs(skewed_batch(), SPECIALS, "linked", 2)
    with pytest.raises(ValueError, match="return_logits"):
        model(**packed.as_kwargs(), layout=packed.layout, return_logits=True)


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
