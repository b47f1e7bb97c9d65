"""Properties of the MARGE model (tiny preset, CPU).

The tests of this subject that need a server or take long are in tests/integration/test_model_learning.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_inputs import SPECIALS, make_batch, tiny

from marge.contracts.config import ConfigError
from marge.model.architecture import MargeConfig, preset
from marge.model.layers import CrossMemory
from marge.model.network import Marge
from marge.model.sizes import build_on_meta, count_parameters
from services.trainer.config import TrainerConfig
from services.trainer.inputs import to_model_inputs

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def pad_more(t: torch.Tensor, extra: int, pad: int = 0) -> torch.Tensor:
    return torch.cat([t, torch.full((t.shape[0], extra), pad, dtype=t.dtype)], dim=1)


def test_shapes_and_finite_loss():
    model = tiny()
    inputs = to_model_inputs(make_batch(np.random.default_rng(0)), SPECIALS)
    out = model(**inputs.as_kwargs(), return_logits=True)
    n, t = inputs.decoder_in_NT.shape
    assert out.logits_NTV.shape == (n, t, 200)
    assert out.relevance_NM.shape == (2, 3)
    assert out.nll_per_target_N.shape == (2,) and out.tokens_per_target_N.tolist() == [8, 13]
    assert torch.isfinite(out.loss) and out.loss.item() == pytest.approx(math.log(200), rel=0.2)


def test_target_never_attends_to_itself():
    inputs = to_model_inputs(make_batch(np.random.default_rng(0)), SPECIALS)
    # target 1 is document 1, which is also evidence 0
    assert inputs.allowed_NM.tolist() == [[True, True, True], [False, True, True]]


def test_padding_invariance():
    model = tiny()
    inputs = to_model_inputs(make_batch(np.random.default_rng(1)), SPECIALS)
    ref = model(**inputs.as_kwargs())
    padded = dict(inputs.as_kwargs())
    for name, extra in (("evidence_MS", 5), ("target_enc_NS", 3), ("decoder_in_NT", 4), ("labels_NT", 4)):
        padded[name] = pad_more(padded[name], extra)
    out = model(**padded)
    torch.testing.assert_close(out.nll_per_target_N, ref.nll_per_target_N, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.relevance_NM, ref.relevance_NM, rtol=1e-5, atol=1e-6)


def test_relevance_is_a_true_cosine():
    model = tiny()
    rng = np.random.default_rng(2)
    inputs = to_model_inputs(make_batch(rng), SPECIALS)
    out = model(**inputs.as_kwargs())
    g_x = model.relevance_vectors(inputs.target_enc_NS)
    g_z = model.relevance_vectors(inputs.evidence_MS)
    expected = F.cosine_similarity(g_x[:, None, :], g_z[None, :, :], dim=-1)
    torch.testing.assert_close(out.relevance_NM, expected, rtol=1e-5, atol=1e-6)
    assert out.relevance_NM.abs().max() <= 1.0 + 1e-6
    # target 1 is evidence 0: the same document has cosine 1 with itself
    assert out.relevance_NM[1, 0].item() == pytest.approx(1.0, abs=1e-5)
    # g is the BOS state after exactly `relevance_layers` encoder layers
    deeper = model.encoder_states(inputs.evidence_MS, model.cfg.relevance_layers + 1)[:, 0]
    assert not torch.allclose(deeper, g_z)


def plain_cross_attention_reference(model: Marge, inputs) -> torch.Tensor:
    """Loss computed with textbook attention (no relevance term) over the concatenated evidence."""
    evidence = model.encode_evidence(inputs.evidence_MS)
    visible_NL = inputs.allowed_NM[:, evidence.key_doc_L] & evidence.key_ok_L[None, :]

    def attend(layer_attn, x_NTD, mem_NLD, visible):
        q = layer_attn.split_heads(layer_attn.q_proj(x_NTD))
        k = layer_attn.split_heads(layer_attn.k_proj(mem_NLD))
        v = layer_attn.split_heads(layer_attn.v_proj(mem_NLD))
        logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if visible is not None:
            logits = logits.masked_fill(~visible, float("-inf"))
        out = logits.softmax(-1) @ v
        return layer_attn.out_proj(out.transpose(1, 2).reshape(x_NTD.shape))

    dec = inputs.decoder_in_NT
    n, t = dec.shape
    x = model.decoder_embedding_norm(model.embed_tokens(dec) + model.decoder_positions(torch.arange(t)))
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    mem = evidence.memory_1LD.expand(n, -1, -1)
    for layer in [*model.decoder_local_layers, *model.decoder_layers]:
        h = layer.self_attn_norm(x)
        x = x + attend(layer.self_attn, h, h, causal)
        if layer.cross_attn is not None:
            x = x + attend(layer.cross_attn, layer.cross_attn_norm(x), mem, visible_NL[:, None, None, :])
        x = x + layer.ffn(layer.ffn_norm(x))
    logits = model.logits(model.decoder_norm(x))
    return F.cross_entropy(logits.transpose(1, 2), inputs.labels_NT, ignore_index=0)


@pytest.mark.parametrize("attend_to", ["all", "linked"])
def test_beta_zero_is_plain_cross_attention_over_the_concatenation(attend_to):
    # So that beta != 0 visibly moves the loss in a fresh model: g mean-pooled, because the BOS-pooled g of
    # a fresh model is nearly one vector for every document (the normalised BOS embedding dominates the BOS
    # state), and cross-attention outputs scaled up, because at init they add little to the unit-scale
    # residual stream (training grows them). 'linked' makes each target read its own gathered keys.
    model = tiny(beta_init=0.0, relevance_pooling="mean")
    batch = make_batch(np.random.default_rng(3), lengths=(7, 12, 5, 9, 6), targets=(0, 1), evidence=(1, 2, 3, 4),
                       edges=[[0, 0], [0, 3], [1, 1], [1, 2]])
    inputs = to_model_inputs(batch, SPECIALS, attend_to)
    with torch.no_grad():
        for layer in model.decoder_layers:
            layer.cross_attn.out_proj.weight.mul_(30.0)
        out = model(**inputs.as_kwargs())
        torch.testing.assert_close(out.loss, plain_cross_attention_reference(model, inputs), rtol=1e-5, atol=1e-5)
        # and with beta != 0 the relevance term matters
        model.beta.fill_(3.0)
        assert not torch.allclose(model(**inputs.as_kwargs()).loss, out.loss)


def test_gradient_reaches_relevance_layers_through_beta_f():
    """g(x) of the targets influences the loss only through beta * f: its gradient must reach the
    first `relevance_layers` encoder layers when beta != 0, and vanish when beta == 0."""
    inputs = to_model_inputs(make_batch(np.random.default_rng(4)), SPECIALS)

    def target_path_grad(beta: float) -> tuple[torch.Tensor, torch.Tensor]:
        model = tiny(beta_init=beta).train()
        full = torch.autograd.grad(model(**inputs.as_kwargs()).loss, list(model.encoder_layers.parameters()),
                                   allow_unused=True)
        original = model.relevance_vectors
        calls = {"n": 0}

        def detach_targets(tokens, rows=None):
            calls["n"] += 1
            return original(tokens, rows).detach()  # only the target pass goes through relevance_vectors

        model.relevance_vectors = detach_targets
        no_target = torch.autograd.grad(model(**inputs.as_kwargs()).loss, list(model.encoder_layers.parameters()),
                                        allow_unused=True)
        assert calls["n"] == 1
        diff = [(a if a is not None else 0) - (b if b is not None else 0) for a, b in zip(full, no_target)]
        n_rel = sum(1 for _ in model.encoder_layers[: model.cfg.relevance_layers].parameters())
        rel = torch.stack([torch.as_tensor(d).abs().sum() for d in diff[:n_rel]])
        above = torch.stack([torch.as_tensor(d).abs().sum() for d in diff[n_rel:]])
        return rel, above

    rel, above = target_path_grad(2.0)
    assert (rel > 0).any() and rel.sum() > 1e-6
    assert above.sum() == 0  # layers above g see nothing of the target pass
    rel0, _ = target_path_grad(0.0)
    assert rel0.sum() == 0
    # beta itself is trained
    model = tiny().train()
    model(**inputs.as_kwargs()).loss.backward()
    assert model.beta.grad is not None and model.beta.grad.abs().item() > 0


def test_evidence_with_minus_infinite_bias_has_no_effect():
    rng = np.random.default_rng(5)
    batch = make_batch(rng, lengths=(6, 8, 10, 7, 9), targets=(0,), evidence=(1, 2, 3, 4))
    model = tiny()
    inputs = to_model_inputs(batch, SPECIALS)
    with torch.no_grad():
        # drop evidence document 2 from the batch entirely...
        keep = [0, 1, 3]
        reduced = dict(inputs.as_kwargs(), evidence_MS=inputs.evidence_MS[keep], allowed_NM=inputs.allowed_NM[:, keep])
        ref = model(**reduced).loss
        # ...or keep it and drive its relevance bias to -inf
        original = model.relevance

        def minus_inf_for_doc2(gx, gz):
            f = original(gx, gz).clone()
            f[:, 2] = float("-inf")
            return f

        model.relevance = minus_inf_for_doc2
        torch.testing.assert_close(model(**inputs.as_kwargs()).loss, ref, rtol=1e-5, atol=1e-5)
        model.relevance = original
        masked = dict(inputs.as_kwargs(), allowed_NM=inputs.allowed_NM.clone())
        masked["allowed_NM"][:, 2] = False
        torch.testing.assert_close(model(**masked).loss, ref, rtol=1e-5, atol=1e-5)
        # the document did matter while visible
        assert not torch.allclose(model(**inputs.as_kwargs()).loss, ref)


def test_a_target_without_visible_evidence_is_an_error():
    model = tiny()
    inputs = to_model_inputs(make_batch(np.random.default_rng(6)), SPECIALS)
    bad = dict(inputs.as_kwargs(), allowed_NM=torch.zeros_like(inputs.allowed_NM))
    with pytest.raises(ValueError, match="no evidence"):
        model(**bad)


def test_decoder_is_causal():
    model = tiny()
    inputs = to_model_inputs(make_batch(np.random.default_rng(7)), SPECIALS)
    out = model(**inputs.as_kwargs(), return_logits=True)
    changed = dict(inputs.as_kwargs())
    changed["decoder_in_NT"] = inputs.decoder_in_NT.clone()
    changed["decoder_in_NT"][:, 4:] = 42
    out2 = model(**changed, return_logits=True)
    torch.testing.assert_close(out.logits_NTV[:, :4], out2.logits_NTV[:, :4])
    assert not torch.allclose(out.logits_NTV[:, 4:], out2.logits_NTV[:, 4:])


@pytest.mark.parametrize("attend_to", ["all", "linked"])
def test_kv_cached_decoding_equals_full_decoding(attend_to):
    model = tiny(relevance_pooling="mean")
    batch = make_batch(np.random.default_rng(8), edges=[[0, 0], [1, 1], [1, 2]])
    inputs = to_model_inputs(batch, SPECIALS, attend_to)
    with torch.no_grad():
        evidence = model.encode_evidence(inputs.evidence_MS)
        rel = model.relevance(model.relevance_vectors(inputs.target_enc_NS), evidence.relevance_MD)
        cross = model.cross_memory(evidence, rel, inputs.allowed_NM)
        assert (cross.key_index_NK is None) == (attend_to == "all")
        full = model.logits(model.decode(inputs.decoder_in_NT, evidence.memory_1LD, cross))
        caches = model.new_caches()
        steps = []
        # a two-token prefix first (a forced prefix), then one token at a time
        steps.append(model.logits(model.decode(inputs.decoder_in_NT[:, :2], evidence.memory_1LD, cross, caches, 0)))
        for pos in range(2, inputs.decoder_in_NT.shape[1]):
            steps.append(model.logits(model.decode(inputs.decoder_in_NT[:, pos:pos + 1], evidence.memory_1LD, cross,
                                                   caches, pos)))
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
        # several new positions at once on top of a non-empty cache use a lower-right causal mask
        caches = model.new_caches()
        a = model.logits(model.decode(inputs.decoder_in_NT[:, :3], evidence.memory_1LD, cross, caches, 0))
        b = model.logits(model.decode(inputs.decoder_in_NT[:, 3:7], evidence.memory_1LD, cross, caches, 3))
        torch.testing.assert_close(torch.cat([a, b], dim=1), full[:, :7], rtol=1e-4, atol=1e-5)


def test_gathered_keys_equal_the_masked_shared_memory():
    """Each target reading only its visible documents' keys (gathered) gives the decoder states of every
    target reading the whole concatenated memory with the others masked, relevance bias included."""
    model = tiny(relevance_pooling="mean", beta_init=2.0)
    batch = make_batch(np.random.default_rng(19), lengths=(7, 12, 5, 9, 6, 8), targets=(0, 5),
                       evidence=(1, 2, 3, 4), edges=[[0, 0], [1, 2]])
    inputs = to_model_inputs(batch, SPECIALS, "linked")
    allowed = inputs.allowed_NM.clone()
    allowed[1, 3] = True  # target 1 sees two documents, target 0 one: unequal widths, padded slots
    with torch.no_grad():
        evidence = model.encode_evidence(inputs.evidence_MS)
        rel = model.relevance(model.relevance_vectors(inputs.target_enc_NS), evidence.relevance_MD)
        gathered = model.cross_memory(evidence, rel, allowed)
        assert gathered.key_index_NK is not None and gathered.key_index_NK.shape[1] == 2 * inputs.evidence_MS.shape[1]
        shared = CrossMemory(None, rel[:, evidence.key_doc_L], allowed[:, evidence.key_doc_L] & evidence.key_ok_L[None])
        a = model.decode(inputs.decoder_in_NT, evidence.memory_1LD, gathered)
        b = model.decode(inputs.decoder_in_NT, evidence.memory_1LD, shared)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_matches_fp32():
    model = tiny()
    inputs = to_model_inputs(make_batch(np.random.default_rng(9)), SPECIALS)
    with torch.no_grad():
        ref = model(**inputs.as_kwargs()).loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**inputs.as_kwargs())
    assert torch.isfinite(out.loss)
    assert out.loss.item() == pytest.approx(ref.item(), rel=0.02)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs.as_kwargs()).loss
    loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_paper_preset_has_963m_parameters():
    n = count_parameters(build_on_meta(preset("paper")))
    assert abs(n - 963e6) / 963e6 <= 0.02, n


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="relevance_layers"):
        preset("tiny", relevance_layers=9)
    with pytest.raises(ValueError, match="num_heads"):
        preset("tiny", d_model=65)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("huge")
    with pytest.raises(ValueError, match="unknown model config field"):
        MargeConfig.from_dict({**preset("tiny").to_dict(), "depth": 3})
    # a retired option loads while off (the model it describes exists) and is refused while on
    assert MargeConfig.from_dict({**preset("tiny").to_dict(), "relevance_distill_weight": 0.0}) == preset("tiny")
    with pytest.raises(ValueError, match="relevance_distill_weight, an option that no longer exists"):
        MargeConfig.from_dict({**preset("tiny").to_dict(), "relevance_distill_weight": 0.5})


def test_mean_pooled_relevance_is_a_padding_invariant_cosine():
    model = tiny(relevance_pooling="mean")
    inputs = to_model_inputs(make_batch(np.random.default_rng(11)), SPECIALS)
    out = model(**inputs.as_kwargs())
    states = model.encoder_states(inputs.target_enc_NS, model.cfg.relevance_layers)
    ok = (inputs.target_enc_NS != 0).unsqueeze(-1).float()
    g_x = (states * ok).sum(1) / ok.sum(1)
    g_z = model.relevance_vectors(inputs.evidence_MS)
    torch.testing.assert_close(out.relevance_NM, F.cosine_similarity(g_x[:, None], g_z[None], dim=-1), rtol=1e-5, atol=1e-6)
    padded = dict(inputs.as_kwargs(), evidence_MS=pad_more(inputs.evidence_MS, 4), target_enc_NS=pad_more(inputs.target_enc_NS, 2))
    torch.testing.assert_close(model(**padded).relevance_NM, out.relevance_NM, rtol=1e-5, atol=1e-6)


def test_self_evidence_adds_a_linked_noised_copy_and_anneals():
    from services.trainer.objectives import SelfEvidenceConfig, noised, with_self_evidence

    batch = make_batch(np.random.default_rng(14), lengths=(20, 8, 10, 7), targets=(0, 3), evidence=(1, 2))
    cfg = SelfEvidenceConfig(prob=1.0, until=100, deletion=0.3)
    out = with_self_evidence(batch, cfg, step=0, rng=np.random.default_rng(0))
    assert out.num_evidence == batch.num_evidence + 2 and len(out.edges) == len(batch.edges) + 2
    for t in range(2):
        copy = out.doc_tokens[out.evidence[out.edges[len(batch.edges) + t][1]]]
        original = batch.doc_tokens[batch.targets[t]]
        assert set(copy.tolist()) <= set(original.tolist()) and len(copy) < len(original) + 1
    inputs = to_model_inputs(out, SPECIALS)
    assert inputs.linked_NM[0, -2] and inputs.linked_NM[1, -1] and inputs.allowed_NM.all()
    assert cfg.prob_at(50) == 0.5 and cfg.prob_at(100) == 0.0
    assert with_self_evidence(batch, cfg, step=100, rng=np.random.default_rng(0)) is batch
    assert len(noised(np.arange(100, dtype=np.int32), cfg.deletion, cfg.shuffle_window, np.random.default_rng(1))) < 90


def test_untied_encoder_embeddings_feed_encoder_and_snapshot():
    from marge.model.network import RelevanceEncoder

    model = tiny(tie_encoder_embeddings=False)
    assert model.encoder_embed_tokens is not None and model.encoder_token_embedding is not model.embed_tokens
    inputs = to_model_inputs(make_batch(np.random.default_rng(16)), SPECIALS)
    encoder = RelevanceEncoder.from_model(model)
    torch.testing.assert_close(encoder(inputs.evidence_MS), model.relevance_vectors(inputs.evidence_MS))
    assert count_parameters(model) == count_parameters(tiny()) + 200 * 64
    model(**inputs.as_kwargs()).loss.backward()
    assert model.encoder_embed_tokens.weight.grad.abs().sum() > 0


def test_relevance_encoder_carries_the_embedding_layernorm():
    from marge.model.architecture import PRESETS
    from marge.model.network import RelevanceEncoder, relevance_state_dict

    assert PRESETS["paper"]["embedding_layernorm"] is False  # our choice where the paper is silent: stated, measured
    inputs = to_model_inputs(make_batch(np.random.default_rng(18)), SPECIALS)
    for embedding_layernorm in (True, False):
        model = tiny(embedding_layernorm=embedding_layernorm)
        if embedding_layernorm:
            layer0 = model.encoder_states(inputs.evidence_MS, 0)  # LayerNorm at init: zero mean, unit variance
            torch.testing.assert_close(layer0.mean(-1), torch.zeros(layer0.shape[:2]), atol=1e-5, rtol=0)
            # not exactly 1: LayerNorm's eps (1e-5) is a few % of the variance of std-0.02 embeddings
            torch.testing.assert_close(layer0.var(-1, unbiased=False), torch.ones(layer0.shape[:2]), atol=0.05, rtol=0)
            with torch.no_grad():  # trained-looking norm parameters, so that a snapshot without them would differ
                model.encoder_embedding_norm.weight.uniform_(0.5, 1.5)
                model.encoder_embedding_norm.bias.uniform_(-0.5, 0.5)
        else:
            assert model.encoder_embedding_norm is None and model.decoder_embedding_norm is None
        encoder = RelevanceEncoder(model.cfg)
        encoder.load_state_dict(relevance_state_dict(model))  # strict: every tensor g needs, and no other
        torch.testing.assert_close(encoder(inputs.evidence_MS), model.relevance_vectors(inputs.evidence_MS))
        for layer in (0, 1):
            torch.testing.assert_close(encoder.encoder_states(inputs.evidence_MS, layer),
                                       model.encoder_states(inputs.evidence_MS, layer))


def test_a_config_saved_before_the_embedding_layernorm_loads_as_the_model_it_was():
    saved = preset("tiny", vocab_size=200).to_dict()
    del saved["embedding_layernorm"]
    assert not MargeConfig.from_dict(saved).embedding_layernorm
    assert MargeConfig.from_dict(preset("tiny", vocab_size=200).to_dict()).embedding_layernorm


def test_chunked_loss_equals_the_full_loss_and_its_gradients():
    """model.loss_chunk_tokens changes memory, not the loss: the same per-target NLL and the same gradient of
    every parameter (chunks of 7 rows: the last chunk is a partial one), with and without gradients."""
    inputs = to_model_inputs(make_batch(np.random.default_rng(5), lengths=(9, 14, 6, 11), targets=(0, 1, 3)), SPECIALS)
    n, t = inputs.decoder_in_NT.shape
    assert (n * t) % 7
    full, chunked = tiny().train(), tiny().train()
    chunked.loss_chunk_tokens = 7
    out_full, out_chunked = full(**inputs.as_kwargs()), chunked(**inputs.as_kwargs())
    torch.testing.assert_close(out_chunked.nll_per_target_N, out_full.nll_per_target_N, rtol=1e-6, atol=1e-6)
    out_full.loss.backward()
    out_chunked.loss.backward()
    for (name, a), b in zip(full.named_parameters(), chunked.parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None, name
        else:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(chunked(**inputs.as_kwargs()).loss, full(**inputs.as_kwargs()).loss)
    assert chunked(**inputs.as_kwargs(), return_logits=True).logits_NTV.shape == (n, t, 200)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        TrainerConfig(loss_chunk_tokens=-1)


def test_the_loss_chunking_is_a_trainer_setting_a_saved_model_config_drops():
    from services.driver.config import load_config
    from services.trainer.step import apply_execution_settings

    saved = {**preset("tiny", vocab_size=200).to_dict(), "loss_chunk_tokens": 512}  # as older versions saved it
    assert MargeConfig.from_dict(saved) == preset("tiny", vocab_size=200)
    model = apply_execution_settings(tiny(), TrainerConfig(loss_chunk_tokens=64))
    assert model.loss_chunk_tokens == 64
    with pytest.raises(ConfigError, match="model.loss_chunk_tokens is an execution setting.*trainer.loss_chunk_tokens"):
        load_config(REPO / "deploy/configs/tiny.yaml", ["model.loss_chunk_tokens=64"]).model_config(200)
