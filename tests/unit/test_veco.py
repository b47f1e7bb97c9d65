"""Properties of the VECO model and its CA-MLM loss (small configs, CPU).

The tests of this subject that need a server or take long are in tests/integration/test_veco_learning.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from marge.model.architecture import MargeConfig, preset
from marge.model.layers import EncoderLayer, pad_rows, run_layers
from marge.model.veco import (
    CA_MLM_TERMS,
    FAMILY,
    VECO_PRESETS,
    Veco,
    VecoConfig,
    build_veco_on_meta,
    count_veco_parameters,
    mlm_mask,
    veco_preset,
    veco_training_flops_per_token,
)

PAD, MASK = 0, 1


def small(**overrides) -> Veco:
    torch.manual_seed(0)
    return Veco(veco_preset("tiny", vocab_size=200, layers=3, **overrides)).eval()


def random_rows(rng: np.random.Generator, lengths, low: int = 5, high: int = 200) -> torch.Tensor:
    return pad_rows([rng.integers(low, high, size=n).tolist() for n in lengths], PAD)


def masked_pair(rng: np.random.Generator, x_lengths=(7, 12, 5), y_lengths=(9, 4, 11), share: float = 0.3):
    """Masked inputs and labels (pad where not masked) of random pairs whose sides differ in length."""
    def side(lengths):
        ins, labels = [], []
        for n in lengths:
            inp, lab = mlm_mask(rng.integers(5, 200, size=n), share, MASK, 5, 200, rng)
            ins.append(inp.tolist())
            labels.append(np.where(lab < 0, PAD, lab).tolist())
        return pad_rows(ins, PAD), pad_rows(labels, PAD)

    (x_in, x_labels), (y_in, y_labels) = side(x_lengths), side(y_lengths)
    return x_in, x_labels, y_in, y_labels


def pad_more(t: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([t, torch.full((t.shape[0], extra), PAD, dtype=t.dtype)], dim=1)


def cross_parameters(model: Veco):
    return [(name, p) for name, p in model.named_parameters() if ".cross_attn" in name]


# --- configuration -------------------------------------------------------------------------------


def test_config_validation_messages():
    with pytest.raises(ValueError, match=r"model\.d_model \(30\) must be divisible by model\.num_heads \(4\)"):
        veco_preset("tiny", d_model=30)
    with pytest.raises(ValueError, match=r"model\.layers must be a positive integer, got 0"):
        veco_preset("tiny", layers=0)
    with pytest.raises(ValueError, match=r"model\.dropout must be in \[0, 1\), got 1\.0"):
        veco_preset("tiny", dropout=1.0)
    with pytest.raises(ValueError, match=r"model\.pad_id \(8000\) must be a valid token id"):
        veco_preset("tiny", pad_id=8000)
    with pytest.raises(ValueError, match=r"model\.init_std must be > 0"):
        veco_preset("tiny", init_std=0.0)
    with pytest.raises(ValueError, match="unknown VECO model preset 'huge'"):
        veco_preset("huge")
    cfg = veco_preset("tiny")
    with pytest.raises(ValueError, match=r"model\.ffn must be a positive integer"):
        cfg.with_overrides(ffn=-1)  # overrides are validated too
    with pytest.raises(ValueError, match=r"unknown model config field\(s\) \['family'\]; known fields: \[.*'layers'"):
        VecoConfig.from_dict({**cfg.to_dict(), "family": FAMILY})
    assert VecoConfig.from_dict(cfg.to_dict()) == cfg
    assert FAMILY == "veco" and "family" not in cfg.to_dict()


def test_presets_match_marge_depths_and_the_paper_size():
    marge_depth = {name: preset(name).encoder_layers + preset(name).decoder_local_layers + preset(name).decoder_layers
                   for name in ("tiny", "base")}
    assert veco_preset("tiny").layers == 6 == marge_depth["tiny"]
    assert veco_preset("base").layers == marge_depth["base"]
    for name in VECO_PRESETS:
        cfg = veco_preset(name)
        model = build_veco_on_meta(cfg)
        assert len(model.layers) == cfg.layers and cfg.head_dim * cfg.num_heads == cfg.d_model
    # VECO-large: 662M parameters (paper Table 1; XLM-R's 250,002-token vocabulary and 514 positions give
    # it a few more embedding rows than this preset)
    assert count_veco_parameters(veco_preset("paper")) == pytest.approx(662e6, rel=0.01)
    tiny = veco_preset("tiny")
    assert count_veco_parameters(tiny) == sum(p.numel() for p in Veco(tiny).parameters())
    # the plug-in pass adds the cross-attention (4 d^2 per layer) to the plug-out pass
    d, layers = tiny.d_model, tiny.layers
    plug_out = layers * (4 * d * d + 2 * d * tiny.ffn)
    assert veco_training_flops_per_token(tiny, masked_share=0.0) == 6.0 * (2 * plug_out + layers * 4 * d * d)


# --- plug-out and plug-in ------------------------------------------------------------------------


def test_plug_out_is_a_plain_pre_layernorm_encoder():
    """encode(x) is marge's EncoderLayer stack run with the same weights: the cross-attention is not there."""
    model = small()
    cfg = model.cfg
    marge_cfg = MargeConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model, num_heads=cfg.num_heads,
                            encoder_layers=cfg.layers, encoder_ffn=cfg.ffn, relevance_layers=1,
                            decoder_local_ffn=1, decoder_layers=1, decoder_ffn=1, dropout=0.0)
    plain = torch.nn.ModuleList(EncoderLayer(marge_cfg) for _ in range(cfg.layers)).eval()
    for plain_layer, layer in zip(plain, model.layers):
        state = {k: v for k, v in layer.state_dict().items() if not k.startswith("cross_attn")}
        plain_layer.load_state_dict(state, strict=True)
    x = random_rows(np.random.default_rng(0), (7, 12, 5))
    with torch.no_grad():
        embedded = model.embedding_norm(model.embed_tokens(x) + model.positions(torch.arange(x.shape[1])))
        expected = model.final_norm(run_layers(embedded, plain, x != PAD))
        assert torch.equal(model.encode(x), expected)
        assert torch.equal(model.plug_out_features(x), expected)


def test_plug_out_ignores_the_cross_attention_and_a_silent_module_changes_nothing():
    model = small()
    rng = np.random.default_rng(1)
    x, y = random_rows(rng, (7, 12, 5)), random_rows(rng, (9, 4, 11))
    with torch.no_grad():
        h_x = model.encode(x)
        h_y = model.encode(y)
        plugged_in = model.encode(x, h_y, y != PAD)
        assert not torch.allclose(plugged_in, h_x, atol=1e-4)  # plugged in, the module does something
        for _, p in cross_parameters(model):
            p.add_(torch.randn_like(p))
        assert torch.equal(model.encode(x), h_x)  # plugged out: no cross-attention weight is read
        for layer in model.layers:
            layer.cross_attn.out_proj.weight.zero_()
            layer.cross_attn.out_proj.bias.zero_()
        # plugged in, but a module that adds exactly zero: the plug-out states, bit for bit
        assert torch.equal(model.encode(x, h_y, y != PAD), h_x)


def test_plug_in_reads_the_paired_input():
    model = small()
    rng = np.random.default_rng(2)
    x, y = random_rows(rng, (7, 12, 5)), random_rows(rng, (9, 4, 11))
    y_changed = y.clone()
    y_changed[1, 2] = 5 if int(y[1, 2]) != 5 else 6
    with torch.no_grad():
        hs_x, hs_y = model.plug_in_features(x, y)
        hs_x2, _ = model.plug_in_features(x, y_changed)
    d = model.cfg.d_model
    assert hs_x.shape == (3, 12, 2 * d) and hs_y.shape == (3, 11, 2 * d)
    torch.testing.assert_close(hs_x[..., :d], model.encode(x), rtol=1e-5, atol=1e-5)  # [H; S]: H first
    assert torch.equal(hs_x2[..., :d], hs_x[..., :d])  # H_x never sees y
    change_BS = (hs_x2[..., d:] - hs_x[..., d:]).abs().amax(-1)
    assert float(change_BS[1].min()) > 1e-5  # every position of x's paired row reads the changed y ...
    assert torch.equal(change_BS[[0, 2]], torch.zeros_like(change_BS[[0, 2]]))  # ... and no other row does


def test_padding_changes_no_state_and_no_loss():
    model = small()
    rng = np.random.default_rng(3)
    x_in, x_labels, y_in, y_labels = masked_pair(rng)
    with torch.no_grad():
        hs_x, hs_y = model.plug_in_features(x_in, y_in)
        hs_x_padded, hs_y_padded = model.plug_in_features(pad_more(x_in, 5), pad_more(y_in, 3))
        ref = model.ca_mlm(x_in, x_labels, y_in, y_labels)
        padded = model.ca_mlm(pad_more(x_in, 5), pad_more(x_labels, 5), pad_more(y_in, 3), pad_more(y_labels, 3))
    for states, states_padded, tokens in ((hs_x, hs_x_padded, x_in), (hs_y, hs_y_padded, y_in)):
        real = tokens != PAD
        torch.testing.assert_close(states_padded[:, : tokens.shape[1]][real], states[real], rtol=1e-5, atol=1e-5)
    for name in CA_MLM_TERMS:
        torch.testing.assert_close(padded.parts[name], ref.parts[name], rtol=1e-5, atol=1e-5)
    assert int(padded.masked_tokens) == int(ref.masked_tokens)


# --- the CA-MLM loss -----------------------------------------------------------------------------


def test_ca_mlm_is_the_four_term_definition():
    model = small()
    x_in, x_labels, y_in, y_labels = masked_pair(np.random.default_rng(4))
    out = model.ca_mlm(x_in, x_labels, y_in, y_labels)
    assert set(out.parts) == set(CA_MLM_TERMS) and not any(t.requires_grad for t in out.parts.values())
    torch.testing.assert_close(out.loss.detach(), torch.stack([out.parts[n] for n in CA_MLM_TERMS]).mean())
    assert int(out.masked_tokens) == int((x_labels != PAD).sum() + (y_labels != PAD).sum())
    with torch.no_grad():  # the definition, four separate `encode` calls
        h_x, h_y = model.encode(x_in), model.encode(y_in)
        s_x, s_y = model.encode(x_in, h_y, y_in != PAD), model.encode(y_in, h_x, x_in != PAD)

        def nll(states, labels):
            return F.cross_entropy(model.mlm_logits(states).transpose(1, 2), labels, ignore_index=PAD)

        expected = {"x_self": nll(h_x, x_labels), "x_cross": nll(s_x, x_labels),
                    "y_self": nll(h_y, y_labels), "y_cross": nll(s_y, y_labels)}
    for name in CA_MLM_TERMS:
        torch.testing.assert_close(out.parts[name], expected[name], rtol=1e-5, atol=1e-5)
    assert out.parts["x_self"].item() == pytest.approx(np.log(200), rel=0.1)  # a fresh model guesses


def test_cross_attention_is_trained_only_by_the_cross_terms():
    model = small()
    batch = masked_pair(np.random.default_rng(5))
    terms, _ = model.ca_mlm_terms(*batch)
    (terms["x_self"] + terms["y_self"]).backward()
    for name, p in cross_parameters(model):
        assert p.grad is None or not p.grad.any(), name
    assert model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    terms, _ = model.ca_mlm_terms(*batch)
    terms["x_cross"].backward()
    for layer in model.layers:
        for proj in (layer.cross_attn.q_proj, layer.cross_attn.v_proj, layer.cross_attn.out_proj):
            assert proj.weight.grad.abs().sum() > 0


def test_cross_terms_train_through_the_paired_states():
    """No stop-gradient on H^L (paper Eq. 3 trains theta_s by all four terms): x_cross's gradient reaches the
    parameters through y's plug-out pass too, as in the four-`encode` definition."""
    model = small()
    x_in, x_labels, y_in, y_labels = masked_pair(np.random.default_rng(8))
    h_y = model.encode(y_in)
    s_x = model.encode(x_in, h_y, y_in != PAD)
    assert torch.autograd.grad(s_x.sum(), h_y, retain_graph=True)[0].abs().sum() > 0
    expected = F.cross_entropy(model.mlm_logits(s_x).transpose(1, 2), x_labels, ignore_index=PAD)
    params = [p for _, p in model.named_parameters()]
    expected_grads = torch.autograd.grad(expected, params)
    terms, _ = model.ca_mlm_terms(x_in, x_labels, y_in, y_labels)
    for (name, _), got, want in zip(model.named_parameters(), torch.autograd.grad(terms["x_cross"], params),
                                    expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


def test_inputs_are_checked():
    model = small()
    x_in, x_labels, y_in, y_labels = masked_pair(np.random.default_rng(6))
    with pytest.raises(ValueError, match="same number of rows"):
        model.ca_mlm(x_in, x_labels, y_in[:2], y_labels[:2])
    with pytest.raises(ValueError, match="x input .* and labels .* differ"):
        model.ca_mlm(x_in, x_labels[:, :3], y_in, y_labels)
    empty = x_in.clone()
    empty[1] = PAD
    with pytest.raises(ValueError, match="every x row needs at least one non-padding token"):
        model.ca_mlm(empty, x_labels, y_in, y_labels)
    with pytest.raises(ValueError, match="exceeds model.max_positions=512"):
        model.encode(torch.ones(1, 513, dtype=torch.long))


# --- masking -------------------------------------------------------------------------------------


def test_mlm_mask_statistics_and_determinism():
    rng = np.random.default_rng(7)
    chosen = total = masked = randomised = kept = 0
    for _ in range(1500):
        tokens = rng.integers(5, 100, size=int(rng.integers(20, 200)))
        inputs, labels = mlm_mask(tokens, 0.15, MASK, 1000, 2000, rng)
        at = labels >= 0
        assert np.array_equal(labels[at], tokens[at]) and np.array_equal(inputs[~at], tokens[~at])
        total += len(tokens)
        chosen += int(at.sum())
        masked += int((inputs[at] == MASK).sum())
        randomised += int(((inputs[at] >= 1000) & (inputs[at] < 2000)).sum())  # outside the tokens' range
        kept += int((inputs[at] == tokens[at]).sum())
    assert masked + randomised + kept == chosen
    assert chosen / total == pytest.approx(0.15, abs=0.015)
    assert masked / chosen == pytest.approx(0.8, abs=0.03)
    assert randomised / chosen == pytest.approx(0.1, abs=0.03)
    assert kept / chosen == pytest.approx(0.1, abs=0.03)

    tokens = np.arange(5, 105)
    a = mlm_mask(tokens, 0.15, MASK, 5, 200, np.random.default_rng(11))
    b = mlm_mask(tokens, 0.15, MASK, 5, 200, np.random.default_rng(11))
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    for n in (1, 3):  # a short row still gets one prediction
        assert (mlm_mask(np.arange(5, 5 + n), 0.15, MASK, 5, 200, rng)[1] >= 0).sum() == 1
    assert len(mlm_mask(np.zeros(0, dtype=np.int64), 0.15, MASK, 5, 200, rng)[1]) == 0
    with pytest.raises(ValueError, match="mask share must be in"):
        mlm_mask(tokens, 0.0, MASK, 5, 200, rng)
    with pytest.raises(ValueError, match="1-D integer array"):
        mlm_mask(tokens.reshape(10, 10), 0.15, MASK, 5, 200, rng)


# --- learning ------------------------------------------------------------------------------------


def test_encoder_states_sweep_the_plugged_out_layers_as_retrieval_evaluation_expects():
    """`marge.eval.evaluation` sweeps `encoder_states(tokens, layer)` over `encoder_layers` in either family."""
    torch.manual_seed(0)
    model = Veco(veco_preset("tiny", vocab_size=50, max_positions=32)).eval()
    tokens = torch.tensor([[2, 11, 12, 13, 3], [2, 14, 15, 3, 0]])
    assert len(model.encoder_layers) == 6
    assert torch.allclose(model.encoder_states(tokens), model.encode(tokens))
    assert not torch.allclose(model.encoder_states(tokens, 6), model.encode(tokens))  # no final norm, as Marge
    assert model.encoder_states(tokens, 0).shape == (2, 5, model.cfg.d_model)


def test_asking_a_veco_model_for_g_names_what_to_read_instead():
    """VECO has no relevance encoder: retrieval by g is refused with the layers it can be read from, not an
    AttributeError from deep inside the model."""
    from marge.contracts.batch import SpecialTokens
    from marge.model.embedding import has_relevance_encoder, relevance_unit_vectors

    model = small()
    assert not has_relevance_encoder(model)
    with pytest.raises(ValueError, match=r"Veco model has no relevance encoder g: .*health\.eval_layer: 0\.\.3"):
        relevance_unit_vectors(model, [[2, 11, 12, 3]], SpecialTokens(pad_id=PAD, bos_id=2, eos_id=3, lang_ids={}))
