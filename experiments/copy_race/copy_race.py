"""Copy race: does our decoder learn to read its evidence as fast as Hugging Face BART at equal shape?

Each target is a 48-token sequence and its only evidence document is the same sequence. Both
models train in one process on the same batches, with the same seed, optimizer and schedule; the script
prints the training loss (nats/token) at fixed steps and the seconds each run took, and writes a JSON.

Shape (both models, about 1.45M parameters at vocab 4000): d 128, 4 heads, 2 encoder layers (g = both),
2 decoder layers with cross-attention and none without, FFN 512, 64 positions, no dropout.

Our model is fed exactly as in training: a `Batch` with the 16 targets and their 16 evidence copies goes
through the trainer's objectives (`marge`, `attend_to: linked`) and `services.trainer.step.forward_backward`,
so every target cross-attends over its own evidence document's keys, gathered from the batch's concatenated
memory (`before:concat_memory` reads the whole memory with the other documents' keys masked instead). BART gets the same tensors: `input_ids` = the evidence row of each target,
`decoder_input_ids` = language token + target, labels = target + EOS, loss = mean NLL per token.

Optimizer (both models): `marge.model.optim.build_optimizer` (AdamW, weight decay 0.01 on matrices only,
none on biases, LayerNorms and embeddings; betas (0.9, 0.98), eps 1e-6), gradient-norm clipping at 1.0
through `services.trainer.step.optimizer_step`, constant learning rate 1e-3 with no warm-up unless a variant says
otherwise. `--optimizer torch-adamw` uses torch's AdamW defaults on every parameter (betas (0.9, 0.999),
eps 1e-8, weight decay 0.01) and no clipping instead.

Tasks (`--source`, `--evidence`): random tokens (default) or 48-token windows of the prepared demo corpus
(vocabulary = its tokenizer's); the evidence is the exact copy (default), BART's text infilling of it
(30% of the tokens masked in spans of Poisson(3) length, each span replaced by one mask token), or
`--evidence bart`: the `bart` objective's own noise with its defaults (services.trainer.noising: text
infilling + sentence permutation), i.e. a denoising race. With one linked document per target the
marge objective's relevance bias is the same on all of a target's keys, so our loss is the `bart` objective's
(tests/unit/test_objectives.py checks the two paths agree).

Variants (`--variants`) switch ONE thing of a model, for the diagnosis in experiments/copy_race/README.md; they are
built here, as subclasses or module swaps, and are not options of the model. `--list` prints them.
`before` is our model as it was before the embedding LayerNorm; `before:*` switch one thing of it.

    python -m experiments.copy_race                     # ours, before, BART: random tokens, 3 seeds, 700 updates
    python -m experiments.copy_race --source text --steps 700
    python -m experiments.copy_race --evidence infilled --steps 700
    python -m experiments.copy_race --source text --evidence bart --variants ours,bart --steps 700
    python -m experiments.copy_race --variants before,before:post_ln,bart:our_old_norms --steps 300 --jobs 2
    python -m experiments.copy_race --g-at-init         # how alike a fresh model's g vectors are
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from marge.contracts.batch import Batch, SpecialTokens
from marge.model.architecture import MargeConfig
from marge.model.layers import Attention, CrossMemory, DecoderLayer, EncodedEvidence, EncoderLayer
from marge.model.network import Marge
from services.trainer.config import TrainerConfig
from services.trainer.inputs import to_model_inputs
from services.trainer.noising import BartNoise, bart_noise, sentence_end_ids, text_infilling
from services.trainer.objectives import MargeObjectiveConfig, Objectives, ObjectivesConfig
from services.trainer.step import build_optimizer, build_scheduler, forward_backward, optimizer_step

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO / "data/prepared/demo"
DEFAULT_OUT = REPO / "experiments/copy_race/results/copy_race.json"

# The shape of the copy race.
D_MODEL, HEADS, LAYERS, FFN, POSITIONS = 128, 4, 2, 512, 64
RANDOM_VOCAB = 4000
TARGETS_PER_BATCH, TARGET_TOKENS = 16, 48
# Random-token task: ids below FIRST_RANDOM_TOKEN are specials, so a copy never contains one.
RANDOM_SPECIALS = SpecialTokens(pad_id=0, bos_id=1, eos_id=2, lang_ids={"xx": 3})
RANDOM_MASK_ID, FIRST_RANDOM_TOKEN = 4, 5
REPORT_STEPS = (25, 100, 200, 300, 500, 700)
LOSS_WINDOW = 10
"""The loss reported at step k is the mean training loss of steps k-9..k: one batch's loss is noisy."""


# ----------------------------------------------------------------------------------------------------
# Data: the same batches for every model and variant of a seed
# ----------------------------------------------------------------------------------------------------


@dataclass
class Task:
    source: str  # "random" or "text"
    evidence: str  # "copy" or "infilled"
    vocab_size: int
    specials: SpecialTokens
    mask_id: int  # the infilling's mask token: one that never occurs in a target
    text_windows: list[tuple[np.ndarray, str]] = field(default_factory=list)  # (48 tokens, language)
    sentence_ends: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    """Token ids that end a sentence (`--evidence bart` permutes sentences): the tokenizer's, none for random."""

    def batch(self, seed: int, step: int) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
        """Targets, their evidence documents and languages of one step: a function of (seed, step) only."""
        rng = np.random.default_rng([seed, step])
        if self.source == "random":
            targets = [rng.integers(FIRST_RANDOM_TOKEN, self.vocab_size, TARGET_TOKENS).astype(np.int32)
                       for _ in range(TARGETS_PER_BATCH)]
            langs = ["xx"] * TARGETS_PER_BATCH
        else:
            picks = rng.integers(len(self.text_windows), size=TARGETS_PER_BATCH)
            targets = [self.text_windows[i][0] for i in picks]
            langs = [self.text_windows[i][1] for i in picks]
        if self.evidence == "copy":
            evidence = [t.copy() for t in targets]
        elif self.evidence == "infilled":
            evidence = [text_infilling(t, 0.3, 3.0, self.mask_id, rng) for t in targets]
        else:  # the bart objective's own noise, with its defaults (infilling + sentence permutation)
            evidence = [bart_noise(t, BartNoise(), self.mask_id, self.sentence_ends, rng, self.vocab_size)
                        for t in targets]
        return targets, evidence, langs


def load_task(source: str, evidence: str, corpus_dir: Path) -> Task:
    if source == "random":
        return Task(source, evidence, RANDOM_VOCAB, RANDOM_SPECIALS, RANDOM_MASK_ID)
    from marge.contracts.corpus import Corpus

    if not (corpus_dir / "manifest.json").exists():
        sys.exit(f"no prepared corpus at {corpus_dir}: run `marge prepare data/demo/libreoffice-help/documents.jsonl.gz "
                 f"--out {corpus_dir} --vocab-size 8000` first")
    corpus = Corpus.open(corpus_dir)
    tokenizer = corpus.tokenizer()
    windows = []
    for shard in range(corpus.num_shards):
        docs = corpus.read_shard(shard)
        for tokens, lang in zip(docs.tokens, docs.langs):
            # Non-overlapping 48-token windows: every window is a real stretch of one document.
            for start in range(0, len(tokens) - TARGET_TOKENS + 1, TARGET_TOKENS):
                windows.append((np.asarray(tokens[start:start + TARGET_TOKENS], dtype=np.int32), str(lang)))
    # <unk> never comes out of the tokenizer (byte fallback): the objectives' mask token (SpecialTokens.mask_id)
    pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    return Task(source, evidence, tokenizer.vocab_size, tokenizer.specials, tokenizer.specials.mask_id, windows,
                sentence_end_ids(pieces))


def as_batch(targets: list[np.ndarray], evidence: list[np.ndarray], langs: list[str], step: int) -> Batch:
    """Documents 0..N-1 are the targets, N..2N-1 their evidence; target i is linked to evidence i only."""
    n = len(targets)
    return Batch(batch_id=f"copy-{step}", index_version=0, snapshot_step=0,
                 doc_ids=np.arange(2 * n, dtype=np.int64), doc_langs=tuple(langs + langs),
                 doc_tokens=tuple(targets) + tuple(evidence), targets=np.arange(n, dtype=np.int32),
                 evidence=np.arange(n, 2 * n, dtype=np.int32),
                 edges=np.stack([np.arange(n), np.arange(n)], 1).astype(np.int32),
                 edge_weights=np.ones(n, dtype=np.float32))


# ----------------------------------------------------------------------------------------------------
# Our model and its diagnostic variants (built here, not options of the model)
# ----------------------------------------------------------------------------------------------------


def our_config(vocab_size: int, pad_id: int, **overrides) -> MargeConfig:
    return MargeConfig(vocab_size=vocab_size, d_model=D_MODEL, num_heads=HEADS, encoder_layers=LAYERS,
                       encoder_ffn=FFN, relevance_layers=LAYERS, decoder_local_layers=0, decoder_local_ffn=FFN,
                       decoder_layers=LAYERS, decoder_ffn=FFN, max_positions=POSITIONS, dropout=0.0,
                       attention_dropout=0.0, pad_id=pad_id, **overrides)


BEFORE_ISSUE_17 = {"embedding_layernorm": False}
"""Config overrides that rebuild our model as it was before the embedding LayerNorm (the diagnosis starts from it)."""


class PostNormEncoderLayer(EncoderLayer):
    """BART's placement: LayerNorm after each residual sum (same parameters, other order)."""

    def forward(self, x_BSD: Tensor, key_ok_B11S: Tensor) -> Tensor:
        k, v = self.self_attn.project_kv(x_BSD)
        x_BSD = self.self_attn_norm(x_BSD + self.self_attn(x_BSD, k, v, attn_bias=key_ok_B11S))
        return self.ffn_norm(x_BSD + self.ffn(x_BSD))


class PostNormDecoderLayer(DecoderLayer):
    def forward(self, x_NTD, memory_1LD, cross, beta, cache=None):
        if cache is not None:
            raise NotImplementedError("the copy race only trains; it never decodes incrementally")
        k, v = self.self_attn.project_kv(x_NTD)
        x_NTD = self.self_attn_norm(x_NTD + self.self_attn(x_NTD, k, v, is_causal=True))
        if self.cross_attn is not None:
            k_1HLE, v_1HLE = self.cross_attn.project_kv(memory_1LD)
            k, v = cross.gather(k_1HLE), cross.gather(v_1HLE)
            x_NTD = self.cross_attn_norm(x_NTD + self.cross_attn(x_NTD, k, v, attn_bias=cross.bias(beta)))
        return self.ffn_norm(x_NTD + self.ffn(x_NTD))


def use_post_norm(model: Marge) -> None:
    """Post-LN sublayers; the last sublayer's LayerNorm is then the final norm, so the extra one goes (as BART)."""
    for layer in model.encoder_layers:
        layer.__class__ = PostNormEncoderLayer
    for layer in [*model.decoder_local_layers, *model.decoder_layers]:
        layer.__class__ = PostNormDecoderLayer
    model.encoder_norm = nn.Identity()
    model.decoder_norm = nn.Identity()


class ScaledEmbeddingMarge(Marge):
    """Token embeddings multiplied by sqrt(d) (Vaswani et al.; fairseq's and BART's `scale_embedding`).
    A variant of `before`: it has no embedding LayerNorm to apply."""

    def _embed_encoder(self, tokens_RS: Tensor) -> Tensor:
        positions_S = torch.arange(tokens_RS.shape[1], device=tokens_RS.device)
        return (self.encoder_token_embedding(tokens_RS) * self.cfg.d_model ** 0.5
                + self.encoder_positions(positions_S))

    def _embed_decoder(self, decoder_in_NT: Tensor, start_position: int) -> Tensor:
        positions_T = torch.arange(start_position, start_position + decoder_in_NT.shape[1], device=decoder_in_NT.device)
        return self.embed_tokens(decoder_in_NT) * self.cfg.d_model ** 0.5 + self.decoder_positions(positions_T)


class UntiedOutputMarge(Marge):
    """A separate output projection instead of the (tied) token embedding."""

    def add_output_projection(self) -> None:
        self.output_projection = nn.Linear(self.cfg.d_model, self.cfg.vocab_size, bias=False)
        nn.init.normal_(self.output_projection.weight, std=self.cfg.init_std)

    def logits(self, states_NTD: Tensor) -> Tensor:
        return self.output_projection(states_NTD)


def use_untied_output(model: Marge) -> None:
    model.__class__ = UntiedOutputMarge
    model.add_output_projection()


class SharedPositionsMarge(Marge):
    """The decoder reads the encoder's position table: position t means the same vector on both sides.
    A variant of `before`: it has no embedding LayerNorm to apply."""

    def _embed_decoder(self, decoder_in_NT: Tensor, start_position: int) -> Tensor:
        positions_T = torch.arange(start_position, start_position + decoder_in_NT.shape[1], device=decoder_in_NT.device)
        return self.embed_tokens(decoder_in_NT) + self.encoder_positions(positions_T)


def use_shared_positions(model: Marge) -> None:
    model.__class__ = SharedPositionsMarge
    del model.decoder_positions  # unused, so that it does not count as a parameter


class ConcatenatedMemoryMarge(Marge):
    """Each target cross-attends over the batch's whole concatenated memory (M*S keys) with every other
    document's keys masked: the model's layout before the gathered keys (now each target reads only its own keys)."""

    def cross_memory(self, evidence: EncodedEvidence, relevance_NM: Tensor, allowed_NM: Tensor) -> CrossMemory:
        return CrossMemory(None, relevance_NM[:, evidence.key_doc_L],
                           allowed_NM[:, evidence.key_doc_L] & evidence.key_ok_L[None, :])


class EagerAttention(Attention):
    """Softmax attention written out (no F.scaled_dot_product_attention), same maths."""

    def attend(self, q_BHQK, k_BHLK, v_BHLK, attn_bias=None, is_causal=False, real=None):
        if real is not None:
            raise ValueError("the written-out attention runs on padded rows only (trainer.unpadded off)")
        logits = q_BHQK @ k_BHLK.transpose(-1, -2) / q_BHQK.shape[-1] ** 0.5
        if attn_bias is not None:
            logits = logits.masked_fill(~attn_bias, float("-inf")) if attn_bias.dtype == torch.bool else logits + attn_bias
        if is_causal:
            q, k = logits.shape[-2:]
            future = torch.ones(q, k, dtype=torch.bool, device=logits.device).triu(k - q + 1)
            logits = logits.masked_fill(future, float("-inf"))
        out_BHQK = logits.softmax(-1) @ v_BHLK
        b, _, q, _ = out_BHQK.shape
        return self.out_proj(out_BHQK.transpose(1, 2).reshape(b, q, -1))


def use_eager_attention(model: nn.Module) -> None:
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = EagerAttention


def freeze_beta_at_zero(model: Marge) -> None:
    with torch.no_grad():
        model.beta.zero_()
    model.beta.requires_grad_(False)


def remove_final_norms(model: Marge) -> None:
    model.encoder_norm = nn.Identity()
    model.decoder_norm = nn.Identity()


def scale_embedding_init(model: Marge) -> None:
    """Token and position embeddings drawn with std d^-1/2 (fairseq's init) instead of 0.02."""
    with torch.no_grad():
        for emb in (model.embed_tokens, model.encoder_positions, model.decoder_positions):
            nn.init.normal_(emb.weight, std=model.cfg.d_model ** -0.5)
        model.embed_tokens.weight[model.cfg.pad_id].zero_()


@dataclass(frozen=True)
class Variant:
    name: str
    about: str
    family: str  # "ours" or "bart"
    config: dict = field(default_factory=dict)  # MargeConfig / BartConfig overrides
    modify: Callable[[nn.Module], None] | None = None  # module swaps after construction (and init)
    optim: dict = field(default_factory=dict)  # TrainerConfig overrides


def bart_without_embedding_norm(model) -> None:
    model.model.encoder.layernorm_embedding = nn.Identity()
    model.model.decoder.layernorm_embedding = nn.Identity()


def before(**config) -> dict:
    return {**BEFORE_ISSUE_17, **config}


VARIANTS = {v.name: v for v in [
    Variant("ours", "our Marge as the library builds it now (embedding LayerNorm)", "ours"),
    Variant("before", "our Marge before the embedding LayerNorm: pre-LN", "ours", config=before()),
    Variant("before:embedding_ln", "+ LayerNorm on token + position embedding (BART's layernorm_embedding): "
            "the fix, = ours", "ours", config=before(embedding_layernorm=True)),
    Variant("before:post_ln", "post-LN sublayers (BART's placement), final norms dropped", "ours", config=before(),
            modify=use_post_norm),
    Variant("before:bart_norms", "post-LN + embedding LayerNorm: BART's whole norm scheme", "ours",
            config=before(embedding_layernorm=True), modify=use_post_norm),
    Variant("before:no_final_norm", "no final LayerNorm after encoder and decoder", "ours", config=before(),
            modify=remove_final_norms),
    Variant("before:embed_scale", "token embeddings x sqrt(d)", "ours", config=before(),
            modify=lambda m: setattr(m, "__class__", ScaledEmbeddingMarge)),
    Variant("before:embed_init", "token/position embeddings init std d^-1/2 (fairseq's) instead of 0.02", "ours",
            config=before(), modify=scale_embedding_init),
    Variant("before:init_std_0.01", "every weight init std 0.01 instead of 0.02", "ours",
            config=before(init_std=0.01)),
    Variant("before:untied_output", "separate output projection (away from BART)", "ours", config=before(),
            modify=use_untied_output),
    Variant("before:untied_encoder", "encoder gets its own token embedding (tie_encoder_embeddings=false)", "ours",
            config=before(tie_encoder_embeddings=False)),
    Variant("before:shared_positions", "one position table for encoder and decoder", "ours", config=before(),
            modify=use_shared_positions),
    Variant("before:beta0", "relevance bias off: beta frozen at 0", "ours", config=before(), modify=freeze_beta_at_zero),
    Variant("before:concat_memory", "each target attends over all M*S keys of the batch, others masked", "ours",
            config=before(), modify=lambda m: setattr(m, "__class__", ConcatenatedMemoryMarge)),
    Variant("before:eager_attention", "written-out softmax attention instead of SDPA", "ours", config=before(),
            modify=use_eager_attention),
    Variant("before:lr3e-3", "learning rate 3e-3", "ours", config=before(), optim={"lr": 3e-3}),
    Variant("before:lr3e-4", "learning rate 3e-4", "ours", config=before(), optim={"lr": 3e-4}),
    Variant("before:warmup100", "100 steps of linear warm-up", "ours", config=before(), optim={"warmup_steps": 100}),
    Variant("ours:embed_init", "the fix + embeddings init std d^-1/2", "ours", modify=scale_embedding_init),
    Variant("bart", "BartForConditionalGeneration (post-LN, layernorm_embedding, tied)", "bart"),
    Variant("bart:no_embedding_ln", "BART without layernorm_embedding (toward ours)", "bart",
            modify=bart_without_embedding_norm),
    Variant("bart:our_old_norms", "BART with our norms before the embedding LayerNorm: pre-LN, final LayerNorms, no "
            "layernorm_embedding", "bart", modify=lambda m: bart_pre_norm(m, embedding_norm=False)),
    Variant("bart:pre_ln", "BART with pre-LN and final LayerNorms, layernorm_embedding kept (mBART's norms, "
            "= ours now)", "bart", modify=lambda m: bart_pre_norm(m, embedding_norm=True)),
    Variant("bart:concat_memory", "BART reading the concatenated memory with other documents' keys masked", "bart"),
    Variant("bart:eager_attention", "BART with attn_implementation='eager'", "bart",
            config={"attn_implementation": "eager"}),
    Variant("bart:lr3e-3", "learning rate 3e-3", "bart", optim={"lr": 3e-3}),
]}


# ----------------------------------------------------------------------------------------------------
# BART
# ----------------------------------------------------------------------------------------------------


def bart_pre_norm(model, embedding_norm: bool) -> None:
    """BART's layers switched to pre-LN (same parameters, other order), with a final LayerNorm after each
    stack as pre-LN needs; `embedding_norm=False` also drops layernorm_embedding."""
    from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer

    class PreNormBartEncoderLayer(BartEncoderLayer):
        def forward(self, hidden_states, attention_mask, **kwargs):
            h, _ = self.self_attn(self.self_attn_layer_norm(hidden_states), attention_mask=attention_mask, **kwargs)
            hidden_states = hidden_states + h
            hidden_states = hidden_states + self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(hidden_states))))
            return self.stack_norm(hidden_states) if hasattr(self, "stack_norm") else hidden_states

    class PreNormBartDecoderLayer(BartDecoderLayer):
        def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                    past_key_values=None, use_cache=True, **kwargs):
            h, _ = self.self_attn(self.self_attn_layer_norm(hidden_states), past_key_values=past_key_values,
                                  attention_mask=attention_mask, **kwargs)
            hidden_states = hidden_states + h
            h, _ = self.encoder_attn(self.encoder_attn_layer_norm(hidden_states), key_value_states=encoder_hidden_states,
                                     attention_mask=encoder_attention_mask, past_key_values=past_key_values, **kwargs)
            hidden_states = hidden_states + h
            hidden_states = hidden_states + self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(hidden_states))))
            return self.stack_norm(hidden_states) if hasattr(self, "stack_norm") else hidden_states

    for stack, layer_class in ((model.model.encoder, PreNormBartEncoderLayer),
                               (model.model.decoder, PreNormBartDecoderLayer)):
        for layer in stack.layers:
            layer.__class__ = layer_class
        stack.layers[-1].stack_norm = nn.LayerNorm(D_MODEL)  # the final norm of a pre-LN stack
        if not embedding_norm:
            stack.layernorm_embedding = nn.Identity()


def build_bart(task: Task, overrides: dict) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    specials = task.specials
    first_lang = min(specials.lang_ids.values())
    config = BartConfig(
        vocab_size=task.vocab_size, d_model=D_MODEL, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
        max_position_embeddings=POSITIONS, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        activation_function="gelu", init_std=0.02, scale_embedding=False, tie_word_embeddings=True,
        pad_token_id=specials.pad_id, bos_token_id=specials.bos_id, eos_token_id=specials.eos_id,
        decoder_start_token_id=first_lang, forced_eos_token_id=None,
        attn_implementation=overrides.get("attn_implementation", "sdpa"))
    return BartForConditionalGeneration(config)


def bart_loss(model: nn.Module, inputs, pad_id: int, concat_memory: bool) -> Tensor:
    """Mean NLL per target token, with the same tensors our model gets."""
    own_N = inputs.allowed_NM.float().argmax(1)  # the one evidence document each target may read
    evidence_NS = inputs.evidence_MS[own_N]
    if not concat_memory:
        logits = model(input_ids=evidence_NS, attention_mask=evidence_NS != pad_id,
                       decoder_input_ids=inputs.decoder_in_NT, use_cache=False).logits
    else:
        states_MSD = model.model.encoder(input_ids=inputs.evidence_MS,
                                         attention_mask=inputs.evidence_MS != pad_id).last_hidden_state
        m, s, d = states_MSD.shape
        n = inputs.decoder_in_NT.shape[0]
        memory_NLD = states_MSD.reshape(1, m * s, d).expand(n, -1, -1)
        key_doc_L = torch.arange(m).repeat_interleave(s)
        visible_NL = inputs.allowed_NM[:, key_doc_L] & (inputs.evidence_MS != pad_id).reshape(1, -1)
        states_NTD = model.model.decoder(input_ids=inputs.decoder_in_NT, encoder_hidden_states=memory_NLD,
                                         encoder_attention_mask=visible_NL.long(), use_cache=False).last_hidden_state
        logits = model.lm_head(states_NTD) + model.final_logits_bias
    return F.cross_entropy(logits.float().transpose(1, 2), inputs.labels_NT, ignore_index=pad_id)


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------


def build_model(variant: Variant, task: Task, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if variant.family == "ours":
        model = Marge(our_config(task.vocab_size, task.specials.pad_id, **variant.config))
    else:
        model = build_bart(task, variant.config)
    if variant.modify is not None:
        variant.modify(model)
    return model.train()


def optimizer_for(model: nn.Module, kind: str, optim: TrainerConfig):
    if kind == "marge":
        optimizer = build_optimizer(model, optim)
    else:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=optim.lr)
    return optimizer, build_scheduler(optimizer, optim, 10**9)  # constant rate: annealing never starts


def train(variant: Variant, task: Task, seed: int, steps: int, optimizer_kind: str, lr: float) -> dict:
    model = build_model(variant, task, seed)
    optim_values = dict(lr=lr, warmup_steps=0, clip_norm=1.0 if optimizer_kind == "marge" else 0.0)
    optim = TrainerConfig(**{**optim_values, **variant.optim})
    objectives = Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked")), task.specials)
    optimizer, scheduler = optimizer_for(model, optimizer_kind, optim)
    parameters = sum(p.numel() for p in model.parameters())
    device = torch.device("cpu")
    losses = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        targets, evidence, langs = task.batch(seed, step)
        batch = as_batch(targets, evidence, langs, step)
        if variant.family == "ours":
            loss = float(forward_backward(model, objectives, objectives.prepare(batch, (seed, step)), 1.0, device)[0])
        else:
            inputs = to_model_inputs(batch, task.specials, attend_to="linked")
            loss_t = bart_loss(model, inputs, task.specials.pad_id, variant.name == "bart:concat_memory")
            loss_t.backward()
            loss = float(loss_t.detach())
        optimizer_step(model, optimizer, scheduler, optim.clip_norm)
        if not math.isfinite(loss):
            raise FloatingPointError(f"{variant.name} seed {seed}: loss {loss} at step {step}")
        losses.append(loss)
    seconds = time.perf_counter() - started
    return {"variant": variant.name, "seed": seed, "parameters": parameters, "seconds": round(seconds, 2),
            "losses": [round(x, 4) for x in losses]}


def loss_at(losses: list[float], step: int) -> float:
    window = losses[max(0, step - LOSS_WINDOW):step]
    return sum(window) / len(window)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summarise(runs: list[dict], report_steps: list[int]) -> dict[str, dict]:
    summary: dict[str, dict] = {}
    for name in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == name]
        per_step = {}
        for step in report_steps:
            values = [loss_at(r["losses"], step) for r in mine if len(r["losses"]) >= step]
            if values:
                per_step[str(step)] = {"mean": round(float(np.mean(values)), 3),
                                       "per_seed": [round(v, 3) for v in values]}
        summary[name] = {"about": VARIANTS[name].about, "parameters": mine[0]["parameters"],
                         "seconds_mean": round(float(np.mean([r["seconds"] for r in mine])), 1),
                         "steps": len(mine[0]["losses"]), "loss": per_step}
    return summary


def print_table(summary: dict[str, dict], report_steps: list[int]) -> None:
    steps = [s for s in report_steps if any(str(s) in v["loss"] for v in summary.values())]
    width = max(len(n) for n in summary) + 2
    print(f"{'variant':<{width}}" + "".join(f"{s:>8}" for s in steps) + f"{'seconds':>9}{'params':>10}")
    for name, v in summary.items():
        cells = "".join(f"{v['loss'][str(s)]['mean']:>8.2f}" if str(s) in v["loss"] else f"{'':>8}" for s in steps)
        print(f"{name:<{width}}{cells}{v['seconds_mean']:>9.1f}{v['parameters']:>10,}")


def print_g_at_init(documents: int = 32, seed: int = 0) -> None:
    """How alike a fresh model's g vectors are across random documents, before and after the fix: the
    off-diagonal cosines between `documents` random 48-token documents, for BOS and mean pooling."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(FIRST_RANDOM_TOKEN, RANDOM_VOCAB, (documents, TARGET_TOKENS))
    rows = torch.as_tensor(np.concatenate([np.full((documents, 1), RANDOM_SPECIALS.bos_id), tokens,
                                           np.full((documents, 1), RANDOM_SPECIALS.eos_id)], 1))
    off_diagonal = ~torch.eye(documents, dtype=torch.bool)
    for name, overrides in (("before", BEFORE_ISSUE_17), ("ours", {})):
        for pooling in ("bos", "mean"):
            torch.manual_seed(seed)
            model = Marge(our_config(RANDOM_VOCAB, RANDOM_SPECIALS.pad_id, relevance_pooling=pooling, **overrides))
            with torch.no_grad():
                g = F.normalize(model.eval().relevance_vectors(rows), dim=-1)
            cosines = (g @ g.T)[off_diagonal]
            print(f"{name:<7} g pooled by {pooling:<4}: cosine between documents {cosines.mean():.5f} "
                  f"+- {cosines.std():.5f}")


def _train_in_worker(job: tuple) -> dict:
    variant_name, task, seed, steps, optimizer_kind, lr = job
    torch.set_num_threads(1)  # --jobs N runs N trainings side by side, one core each
    return train(VARIANTS[variant_name], task, seed, steps, optimizer_kind, lr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.copy_race", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="ours,before,bart", help="comma-separated; --list shows them")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--source", choices=["random", "text"], default="random")
    parser.add_argument("--evidence", choices=["copy", "infilled", "bart"], default="copy",
                        help="the exact copy, BART's text infilling, or the bart objective's whole noise")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="prepared corpus for --source text")
    parser.add_argument("--optimizer", choices=["marge", "torch-adamw"], default="marge")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of one training (with --jobs 1)")
    parser.add_argument("--jobs", type=int, default=1, help="trainings run side by side, one thread each")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--list", action="store_true", help="print the variants and exit")
    parser.add_argument("--g-at-init", action="store_true", help="print how alike fresh g vectors are, and exit")
    args = parser.parse_args(argv)
    if args.list:
        for v in VARIANTS.values():
            print(f"{v.name:<26} {v.about}")
        return
    if args.g_at_init:
        print_g_at_init()
        return
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; --list shows the known ones")
    torch.set_num_threads(args.threads)
    task = load_task(args.source, args.evidence, args.corpus)
    report_steps = sorted({*[s for s in REPORT_STEPS if s <= args.steps], args.steps})
    result = {
        "command": " ".join(["python", "-m", "experiments.copy_race", *(argv if argv is not None else sys.argv[1:])]),
        "commit": git_commit(), "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads_per_training": 1 if args.jobs > 1 else args.threads, "trainings_side_by_side": args.jobs,
        "task": {"source": args.source, "evidence": args.evidence, "vocab_size": task.vocab_size,
                 "targets_per_batch": TARGETS_PER_BATCH, "target_tokens": TARGET_TOKENS},
        "optimizer": args.optimizer, "lr": args.lr, "seeds": args.seeds, "steps": args.steps,
        "loss_window": LOSS_WINDOW,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    jobs = [(name, task, seed, args.steps, args.optimizer, args.lr) for seed in args.seeds for name in names]
    runs = []

    def record(run: dict) -> None:
        runs.append(run)
        curve = "  ".join(f"{s}:{loss_at(run['losses'], s):.2f}" for s in report_steps)
        print(f"seed {run['seed']}  {run['variant']:<24} {curve}  ({run['seconds']:.1f} s)", flush=True)
        # Rewritten after every training, so that an interrupted sweep keeps what it finished.
        ordered = sorted(runs, key=lambda r: (names.index(r["variant"]), r["seed"]))
        args.out.write_text(json.dumps({**result, "summary": summarise(ordered, report_steps), "runs": ordered},
                                       indent=1) + "\n")

    if args.jobs == 1:
        for job in jobs:
            record(train(VARIANTS[job[0]], *job[1:]))
    else:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for future in as_completed([pool.submit(_train_in_worker, job) for job in jobs]):
                record(future.result())
    ordered = sorted(runs, key=lambda r: (names.index(r["variant"]), r["seed"]))
    print(f"\nmean over seeds {args.seeds} (loss = mean of the {LOSS_WINDOW} training losses ending at the step)")
    print_table(summarise(ordered, report_steps), report_steps)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
