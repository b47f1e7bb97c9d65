"""Bucketed attention blocks (`trainer.bucket_rows`, `trainer.bucket_width`, `services.trainer.inputs.AttentionLayout`):
the loss, gradients and reading distribution of the exact block, and a bounded set of attention shapes over batches
of varied sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from marge.model.architecture import preset
from marge.model.network import Marge
from services.trainer.inputs import AttentionLayout, to_model_inputs
from tests.unit.test_unpadded import SPECIALS, loss_and_gradients, skewed_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from recipe_efficiency import AttentionCalls  # noqa: E402  (benchmarks/ is not a package)

BUCKETS = AttentionLayout(rows=16, width=32)


def tiny(pooling: str = "mean") -> Marge:
    torch.manual_seed(0)
    return Marge(preset("tiny", vocab_size=200, dropout=0.0, relevance_centering=True, relevance_layers=1,
                        relevance_pooling=pooling)).train()


@pytest.mark.parametrize("attend_to,key_bias,detach", [("linked", "folded", False), ("all", "folded", False),
                                                       ("linked", "mask", False), ("all", "mask", True)])
def test_a_bucketed_block_gives_the_exact_blocks_loss_and_gradients(attend_to, key_bias, detach):
    from services.trainer.config import TrainerConfig
    from services.trainer.step import apply_execution_settings

    model = apply_execution_settings(tiny(), TrainerConfig(key_bias=key_bias))
    batch = skewed_batch(docs=37, targets=13)
    exact = to_model_inputs(batch, SPECIALS, attend_to, unpadded=True)
    bucketed = to_model_inputs(batch, SPECIALS, attend_to, unpadded=True, attention=BUCKETS)
    layout = bucketed.layout
    assert layout is not None and exact.layout is not None
    # the blocks really are larger: rows and widths rounded up, key slots too
    assert (layout.evidence.block_rows, layout.evidence.width) == (32, 64) != (exact.layout.evidence.block_rows,
                                                                             exact.layout.evidence.width)
    assert layout.decoder.block_rows == 16 and layout.visible_NK.shape[0] == 16
    assert layout.visible_NK.shape[1] % 32 == 0 and layout.visible_NK.shape[1] > exact.layout.visible_NK.shape[1]
    loss_exact, grads_exact = loss_and_gradients(model, exact, detach)
    loss_bucketed, grads_bucketed = loss_and_gradients(model, bucketed, detach)
    assert loss_bucketed == pytest.approx(loss_exact, rel=1e-6)
    assert grads_bucketed.keys() == grads_exact.keys() and "beta" in grads_bucketed
    for name, g in grads_exact.items():  # each against its own size: beta's (~1e-6 at init) included
        own = float(g.abs().max()) if not name.endswith("k_proj.bias") else max(float(x.abs().max())
                                                                                  for x in grads_exact.values())
        assert torch.allclose(grads_bucketed[name], g, rtol=1e-4, atol=1e-5 * own), name


def test_a_bucketed_block_reads_the_same_evidence():
    model = tiny().eval()
    batch = skewed_batch(seed=2, docs=37, targets=13)
    reads = []
    for buckets in (AttentionLayout(), BUCKETS):
        inputs = to_model_inputs(batch, SPECIALS, "linked", unpadded=True, attention=buckets)
        with torch.no_grad():
            out = model(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout, reading=True)
        reads.append(out.reading_NM)
    assert reads[0] is not None and reads[1] is not None and reads[1].shape == (13, reads[0].shape[1])
    torch.testing.assert_close(reads[1], reads[0], rtol=1e-5, atol=1e-6)


def test_the_denoising_views_bucketed_give_the_same_loss():
    from services.trainer.objectives import DenoisingContrastiveConfig, DenoisingContrastiveObjective

    model = tiny()
    cfg = DenoisingContrastiveConfig(weight=0.3, extra_documents=0)
    losses = []
    for buckets in (AttentionLayout(), BUCKETS):
        objective = DenoisingContrastiveObjective(cfg, SPECIALS, True, buckets)
        views = objective.prepare(skewed_batch(), np.random.default_rng(3))
        assert views["first_real"].block_rows % (buckets.rows or 1) == 0
        losses.append(float(objective.loss(model, views).loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def attention_shapes(model: Marge, batches, buckets: AttentionLayout) -> set:
    """The (q, k) shapes of every attention call the forward makes over these batches (the benchmarks' census,
    `AttentionCalls`)."""
    with AttentionCalls() as calls, torch.no_grad():
        for batch in batches:
            inputs = to_model_inputs(batch, SPECIALS, "linked", unpadded=True, attention=buckets)
            model(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout)
    return {(q, k) for _, q, k, *_ in calls.calls}


def test_buckets_bound_the_attention_shapes_over_batches_of_varied_sizes():
    model = tiny()
    rng = np.random.default_rng(0)
    batches = [skewed_batch(seed=s, docs=int(rng.integers(30, 60)), targets=int(rng.integers(8, 20)))
               for s in range(12)]
    exact = attention_shapes(model, batches, AttentionLayout())
    bucketed = attention_shapes(model, batches, AttentionLayout(rows=32, width=32))
    # every batch has its own exact shapes; bucketed, a few cover them all (evidence rows: 32 or 64; targets' rows
    # 32; widths 32 or 64; key slots a few multiples of 32)
    assert len(exact) >= 3 * 12 * 0.8, len(exact)
    assert len(bucketed) <= 12, sorted(bucketed)
    assert all(q[0] % 32 == 0 and q[2] % 32 == 0 and k[2] % 32 == 0 for q, k in bucketed)


def test_trainer_config_refuses_a_negative_bucket():
    from marge.contracts.config import FieldError
    from services.trainer.config import TrainerConfig

    with pytest.raises(FieldError, match="bucket_rows"):
        TrainerConfig(bucket_rows=-1)


def decoder_states(model: Marge, inputs) -> torch.Tensor:
    got: list[torch.Tensor] = []
    hook = model.decoder_norm.register_forward_hook(lambda module, args, out: got.append(out))
    try:
        with torch.no_grad():
            model(**inputs.as_kwargs(), width=inputs.width, layout=inputs.layout)
    finally:
        hook.remove()
    return got[0]


@pytest.mark.parametrize("attend_to,rows,width", [("linked", 0, 0), ("all", 0, 0), ("linked", 16, 32)])
def test_packed_cross_attention_gives_the_gathered_values(attend_to, rows, width):
    """FlexAttention has no CPU backward: here the decoder's states (beta raised so that a 1% error in beta * f
    moves them), the gradients on a GPU (below)."""
    model = tiny()
    with torch.no_grad():
        model.beta.fill_(5.0)
    batch = skewed_batch(seed=4, docs=300, targets=100)
    gathered = to_model_inputs(batch, SPECIALS, attend_to, unpadded=True, attention=AttentionLayout(rows, width))
    packed = to_model_inputs(batch, SPECIALS, attend_to, unpadded=True,
                             attention=AttentionLayout(rows, width, packed_cross=True))
    assert gathered.layout is not None and gathered.layout.packed is None
    assert packed.layout is not None and packed.layout.packed is not None
    states = decoder_states(model, packed)
    torch.testing.assert_close(states, decoder_states(model, gathered), rtol=1e-5, atol=2e-6)
    with torch.no_grad():  # beta * f reaches the packed path: another beta, other states
        model.beta.fill_(0.0)
    assert not torch.allclose(decoder_states(model, packed), states, atol=1e-3)


def test_the_packed_tiles_hold_every_key_a_target_reads_and_skip_the_rest():
    from marge.model.layers import PACK_BLOCK

    batch = skewed_batch(seed=5, docs=400, targets=150, links=2)
    inputs = to_model_inputs(batch, SPECIALS, "linked", unpadded=True, attention=AttentionLayout(packed_cross=True))
    assert inputs.layout is not None and inputs.layout.packed is not None
    packed = inputs.layout.packed
    n, m = inputs.allowed_NM.shape
    readable = torch.zeros(n + 1, m + 1, dtype=torch.bool)
    readable[:n, :m] = inputs.allowed_NM
    needed_QL = readable[packed.target_Q][:, packed.doc_L]  # every (query, key) a target may read
    tiles = needed_QL.reshape(len(packed.target_Q) // PACK_BLOCK, PACK_BLOCK, len(packed.doc_L) // PACK_BLOCK,
                              PACK_BLOCK).any(3).any(1)
    listed = torch.zeros_like(tiles)
    for q, count in enumerate(packed.kv_blocks[0, 0].tolist()):
        listed[q, packed.kv_indices[0, 0, q, :count].long()] = True
    assert torch.equal(listed, tiles)  # exactly the tiles holding a readable pair: none missed, none extra
    assert int(packed.kv_blocks.sum()) < tiles.numel()  # some tiles skipped
    assert int((packed.target_Q < n).sum()) == int((inputs.labels_NT != SPECIALS.pad_id).sum())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs a GPU")
def test_packed_cross_attention_gives_the_gathered_loss_and_gradients_on_a_gpu():
    model = tiny().cuda()
    batch = skewed_batch(seed=4, docs=300, targets=100)
    figures = []
    for packed in (False, True):
        inputs = to_model_inputs(batch, SPECIALS, "linked", unpadded=True,
                                 attention=AttentionLayout(packed_cross=packed)).to("cuda")
        figures.append(loss_and_gradients(model, inputs))
    (loss_gathered, grads_gathered), (loss_packed, grads_packed) = figures
    assert loss_packed == pytest.approx(loss_gathered, rel=1e-5)
    assert grads_packed.keys() == grads_gathered.keys() and "beta" in grads_packed
    scale = max(float(g.abs().max()) for g in grads_gathered.values())
    for name, g in grads_gathered.items():
        own = scale if name.endswith("k_proj.bias") else float(g.abs().max())
        assert torch.allclose(grads_packed[name], g, rtol=1e-3, atol=1e-4 * own), name


def test_packed_cross_attention_is_refused_where_it_cannot_train():
    from marge.contracts.config import ConfigError, FieldError
    from services.driver.config import load_config
    from services.trainer.config import TrainerConfig

    with pytest.raises(FieldError, match="cross_attention.*unpadded"):
        TrainerConfig(cross_attention="packed")
    repo = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError, match="cross_attention=packed trains only on a GPU"):
        load_config(repo / "deploy/configs/tiny.yaml", ["trainer.unpadded=true", "trainer.cross_attention=packed"])
