"""The mechanism study's arms: the settings every arm shares, each arm's own (its index, the auxiliary loss, whether
f is detached) and the named contrasts the report states. Read by the harness that runs the arms and by the report
that puts them together (`experiments.mechanism.harness`, `experiments.mechanism.report`)."""

from __future__ import annotations

from dataclasses import dataclass

COMMON = (
    "objectives.self_evidence=null",
    "indexer.reindex_every=100",
    "batcher.index_lag=100",
    "indexer.lexical_until=800",
    "trainer.snapshot_every=100",
    "trainer.checkpoint_every=250",
    "trainer.keep_checkpoints=1000",
    "run.progress_every_s=120",
    "health.aligned_probe_size=0",
)
"""Settings every arm shares (the arm's own come after them). The index is rebuilt every 100 updates and each
version serves from 100 updates after its snapshot; lambda of the lexical bootstrap reaches 0 at update 800, so the
versions ranked by g alone (snapshots 800 on) train updates 900 to the end: 40% of a 1,500-update run. The aligned
probe is measured after training, on every checkpoint, with the other held-out measures
(`experiments.mechanism.measures`), not during it."""

FROZEN = "indexer.reindex_every=1000000"
NO_AUX = "objectives.denoising_contrastive=null"
DETACHED = "objectives.marge.detach_relevance=true"
UNTIED = "model.tie_encoder_embeddings=false"
"""g's token embedding apart from the decoder's input and output one, which the language-model loss shapes."""
OWN_G = "model.own_relevance_encoder=true"
"""g an encoder of its own (embeddings and layer), which only f trains: neither the memory the decoder reads nor its
language model reaches it."""
BETA_ROOM = ("model.beta_init=4.0", "trainer.beta_lr_scale=10")
"""Room for beta * f: beta starts at 4 instead of 1 and learns 10x faster than the rest (at the recipe's lr it could
rise by at most ~2.2 in 1,500 updates, and it rose at 74-89% of that)."""
READS = ("objectives.self_evidence={prob: 0.5, until: 500, deletion: 0.3}", "objectives.marge.detach_relevance_until=500")
"""A decoder that reads its evidence as text before g's path matters: a noised copy of the target among the evidence
of half the targets, annealed to none by update 500, with f detached over those updates (so that g is not rewarded
for recognising a document's own copy), then attached."""
DISTIL = ("objectives.relevance_distillation={weight: 0.3, temperature: 0.1}",)
"""Extension beyond the paper: f matched to which cross-lingual evidence the decoder reads (ADist)."""
TFIDF_FROZEN = ("indexer.links=tfidf", "indexer.bootstrap=none", "indexer.lexical_weight=0", "indexer.lexical_until=0",
                FROZEN)
ALIGNED = ("indexer.links=aligned", "indexer.aligned_layout=budget", "indexer.bootstrap=none",
           "indexer.lexical_weight=0", "indexer.lexical_until=0")
PAPER = ("indexer.bootstrap=none", "indexer.lexical_weight=0", "indexer.lexical_until=0", "indexer.link_rule=shard",
         "indexer.links_monolingual=4", "indexer.links_crosslingual=4", "objectives.marge.attend_to=all",
         "model.relevance_pooling=bos", "model.relevance_centering=false", NO_AUX)
"""The paper's choices where it speaks (paper §2.2-2.4, §3) at the recipe's size: no auxiliary loss, no
self-evidence, no lexical bootstrap, g the BOS state (after the first of tiny's 3 encoder layers: the paper's 4 of
12), no centring, shard-wide top-k links (4 + 4 per document on average), every target reads all of its batch's
evidence. Kept from the recipe, as in every arm: paragraph documents, the tiny model, lr 1e-3 (the paper's 1e-4 is
for 963M parameters), rebuilds every 250 updates (the paper's 10k is 2% of its run; 250 is 17% of 1,500)."""


@dataclass(frozen=True)
class Arm:
    name: str
    index: str
    aux_loss: bool
    detached_f: bool
    overrides: tuple[str, ...]
    why: str
    lever: str = ""
    """The lever on g this arm tries ('' for the study's base arms): its pair differs only in `detached_f`."""


ARMS = (
    Arm("loop", "loop", False, False, (NO_AUX,),
        "the loop without the auxiliary loss: reconstruction is g's only teacher"),
    Arm("loop_detached", "loop", False, True, (NO_AUX, DETACHED),
        "the same with f detached: what g learns without beta * f"),
    Arm("tfidf_frozen", "tfidf_frozen", False, False, (*TFIDF_FROZEN, NO_AUX),
        "good, unlabelled evidence that g never chooses, no auxiliary loss"),
    Arm("tfidf_frozen_detached", "tfidf_frozen", False, True, (*TFIDF_FROZEN, NO_AUX, DETACHED),
        "the same with f detached"),
    Arm("loop_aux", "loop", True, False, (),
        "the loop with the auxiliary loss (the recipe without self-evidence)"),
    Arm("loop_aux_detached", "loop", True, True, (DETACHED,),
        "the same with f detached: what the auxiliary loss and the memory give g without beta * f"),
    Arm("tfidf_frozen_aux", "tfidf_frozen", True, False, TFIDF_FROZEN,
        "a frozen TF-IDF index with the auxiliary loss: what the loss alone gives g"),
    Arm("aligned", "aligned", False, False, (*ALIGNED, NO_AUX),
        "aligned translations in the loop's link budget, rebuilt: the decoder's ceiling (uses labels)"),
    Arm("paper", "paper", False, False, PAPER,
        "the paper's loop: random-init first index, g alone, no auxiliary loss"),
    Arm("loop_untied", "loop", False, False, (NO_AUX, UNTIED),
        "the loop with g's own token embedding (not the decoder's): does beta * f teach g more?", "untied"),
    Arm("loop_untied_detached", "loop", False, True, (NO_AUX, UNTIED, DETACHED),
        "the same with f detached", "untied"),
    Arm("loop_own", "loop", False, False, (NO_AUX, OWN_G),
        "the loop with g an encoder of its own, trained by f alone", "own_g"),
    Arm("loop_own_detached", "loop", False, True, (NO_AUX, OWN_G, DETACHED),
        "the same with f detached: g stays as initialised", "own_g"),
    Arm("loop_own_reads", "loop", False, False, (NO_AUX, OWN_G, *READS),
        "g an encoder of its own, left as initialised until the decoder has learned to read (self-evidence and f "
        "detached to update 500), then trained by f", "own_g+reads_text"),
    Arm("tfidf_frozen_own_reads", "tfidf_frozen", False, False, (*TFIDF_FROZEN, NO_AUX, OWN_G, *READS),
        "loop_own_reads with a frozen TF-IDF index that g never chooses: what g's own index adds", "own_g+reads_text"),
    Arm("loop_own_reads_aux", "loop", True, False, (OWN_G, *READS),
        "loop_own_reads with the auxiliary loss on g", "own_g+reads_text"),
    Arm("loop_own_reads_aux_detached", "loop", True, True, (OWN_G, *READS, DETACHED),
        "the same with f detached: what the auxiliary loss alone gives g's own encoder", "own_g+reads_text"),
    Arm("tfidf_frozen_own", "tfidf_frozen", False, False, (*TFIDF_FROZEN, NO_AUX, OWN_G),
        "loop_own with a frozen TF-IDF index that g never chooses: what g's own index adds", "own_g"),
    Arm("loop_own_aux", "loop", True, False, (OWN_G,), "loop_own with the auxiliary loss on g", "own_g"),
    Arm("loop_own_aux_detached", "loop", True, True, (OWN_G, DETACHED),
        "the same with f detached: what the auxiliary loss alone gives g's own encoder", "own_g"),
    Arm("loop_beta", "loop", False, False, (NO_AUX, *BETA_ROOM),
        "the loop with room for beta * f (beta from 4, its own 10x learning rate)", "beta_room"),
    Arm("loop_beta_detached", "loop", False, True, (NO_AUX, *BETA_ROOM, DETACHED),
        "the same with f detached", "beta_room"),
    Arm("loop_reads", "loop", False, False, (NO_AUX, *READS),
        "the loop after a decoder taught to read its evidence as text (self-evidence to update 500, f detached "
        "until then)", "reads_text"),
    Arm("loop_reads_detached", "loop", False, True, (NO_AUX, *READS, DETACHED),
        "the same with f detached throughout", "reads_text"),
    Arm("loop_distil", "loop", False, False, (NO_AUX, *DISTIL),
        "the loop with f distilled from the decoder's cross-lingual reading (an extension beyond the paper)",
        "distillation"),
    Arm("loop_distil_detached", "loop", False, True, (NO_AUX, *DISTIL, DETACHED),
        "the same with beta * f detached: the distillation alone teaches g through f", "distillation"),
)
ARM_NAMES = tuple(a.name for a in ARMS)

CONTRASTS = {
    "beta_f_vs_detached_loop": ("loop", "loop_detached",
                                "what reconstruction teaches g through beta * f in the loop"),
    "beta_f_vs_detached_tfidf": ("tfidf_frozen", "tfidf_frozen_detached",
                                 "what beta * f teaches g when the evidence is good but unlabelled"),
    "beta_f_beyond_aux": ("loop_aux", "loop_aux_detached",
                          "what beta * f teaches g in the loop on top of the auxiliary loss"),
    "loop_vs_tfidf_frozen": ("loop", "tfidf_frozen",
                             "what g's own index adds to g over a frozen TF-IDF index, no auxiliary loss"),
    "loop_vs_lexical_frozen": ("loop_aux", "tfidf_frozen_aux",
                               "g's own index against a frozen TF-IDF index, both with beta * f and the auxiliary loss"),
    "aux_loss_in_loop": ("loop_aux", "loop", "what the auxiliary loss adds to g in the loop"),
    "beta_f_vs_detached_loop_untied": ("loop_untied", "loop_untied_detached",
                                       "what beta * f teaches g when g's token embedding is its own"),
    "untied_vs_tied_loop": ("loop_untied", "loop", "what an embedding of g's own adds to the loop's g"),
    "beta_f_vs_detached_loop_own": ("loop_own", "loop_own_detached",
                                    "what beta * f teaches g when f is its only teacher (g an encoder of its own)"),
    "own_vs_shared_loop": ("loop_own", "loop", "what an encoder of g's own adds to the loop's g"),
    "beta_f_vs_detached_loop_own_reads": ("loop_own_reads", "loop_own_detached",
                                          "what beta * f teaches an encoder of g's own once the decoder reads (the "
                                          "control is loop_own_detached: with f detached nothing reaches g's own "
                                          "encoder in either run, so its g is each seed's initial g)"),
    "own_reads_vs_own_loop": ("loop_own_reads", "loop_own",
                              "what leaving g's own encoder untouched until the decoder reads adds"),
    "loop_vs_tfidf_frozen_own_reads": ("loop_own_reads", "tfidf_frozen_own_reads",
                                       "what g's own index adds over a frozen TF-IDF index (g's own encoder, reads)"),
    "beta_f_beyond_aux_own_reads": ("loop_own_reads_aux", "loop_own_reads_aux_detached",
                                    "what beta * f teaches g's own encoder on top of the auxiliary loss (reads)"),
    "loop_vs_tfidf_frozen_own": ("loop_own", "tfidf_frozen_own",
                                 "what g's own index adds over a frozen TF-IDF index (g's own encoder)"),
    "beta_f_beyond_aux_own": ("loop_own_aux", "loop_own_aux_detached",
                              "what beta * f teaches g's own encoder on top of the auxiliary loss"),
    "beta_f_vs_detached_loop_beta": ("loop_beta", "loop_beta_detached",
                                     "what beta * f teaches g with room for beta"),
    "beta_room_vs_loop": ("loop_beta", "loop", "what room for beta adds to the loop's g"),
    "beta_f_vs_detached_loop_reads": ("loop_reads", "loop_reads_detached",
                                      "what beta * f teaches g after the decoder learned to read its evidence"),
    "reads_vs_loop": ("loop_reads", "loop", "what an early reading decoder adds to the loop's g"),
    "beta_f_beyond_distillation": ("loop_distil", "loop_distil_detached",
                                   "what beta * f teaches g on top of the relevance distillation"),
    "distillation_vs_loop": ("loop_distil", "loop", "what the relevance distillation adds to the loop's g"),
}
"""Named differences (first arm minus second, paired by seed) the report states with CIs."""


RECIPE = {"loop": "loop_own_reads", "loop_detached": "loop_own_detached", "tfidf_frozen": "tfidf_frozen_own_reads",
          "aux": "loop_own_reads_aux", "aux_detached": "loop_own_reads_aux_detached",
          "loop_vs_tfidf_frozen": "loop_vs_tfidf_frozen_own_reads", "beta_f_beyond_aux": "beta_f_beyond_aux_own_reads"}
"""The arms and contrasts of the chosen recipe the study's targets are judged on (`report.judge`)."""


def arm_named(name: str) -> Arm:
    for arm in ARMS:
        if arm.name == name:
            return arm
    raise ValueError(f"unknown arm {name!r}; choose from {list(ARM_NAMES)}")
