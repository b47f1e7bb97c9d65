"""The mechanism study's arms: the settings every arm shares, each arm's own (its index, the auxiliary loss, whether
f is detached) and the named contrasts the report states. Read by the harness that runs the arms and by the report
that puts them together (`experiments.mechanism.harness`, `experiments.mechanism.report`)."""

from __future__ import annotations

from dataclasses import dataclass

COMMON = (
    "objectives.self_evidence=null",
    "indexer.lexical_until=1000",
    "trainer.snapshot_every=250",
    "trainer.checkpoint_every=250",
    "trainer.keep_checkpoints=1000",
    "run.progress_every_s=120",
    "health.aligned_probe_size=0",
)
"""Settings every arm shares (the arm's own come after them). The aligned probe is measured after training, on
every checkpoint, with the other held-out measures (`experiments.mechanism.measures`), not during it."""

FROZEN = "indexer.reindex_every=1000000"
NO_AUX = "objectives.denoising_contrastive=null"
DETACHED = "objectives.marge.detach_relevance=true"
UNTIED = "model.tie_encoder_embeddings=false"
"""g's token embedding apart from the decoder's input and output one, which the language-model loss shapes."""
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
    Arm("tfidf_frozen_aux", "tfidf_frozen", True, False, TFIDF_FROZEN,
        "a frozen TF-IDF index with the auxiliary loss: what the loss alone gives g"),
    Arm("aligned", "aligned", False, False, (*ALIGNED, NO_AUX),
        "aligned translations in the loop's link budget, rebuilt: the decoder's ceiling (uses labels)"),
    Arm("paper", "paper", False, False, PAPER,
        "the paper's loop: random-init first index, g alone, no auxiliary loss"),
    Arm("loop_untied", "loop", False, False, (NO_AUX, UNTIED),
        "the loop with g's own token embedding (not the decoder's): does beta * f teach g more?"),
    Arm("loop_untied_detached", "loop", False, True, (NO_AUX, UNTIED, DETACHED),
        "the same with f detached"),
)
ARM_NAMES = tuple(a.name for a in ARMS)

CONTRASTS = {
    "beta_f_vs_detached_loop": ("loop", "loop_detached",
                                "what reconstruction teaches g through beta * f in the loop"),
    "beta_f_vs_detached_tfidf": ("tfidf_frozen", "tfidf_frozen_detached",
                                 "what beta * f teaches g when the evidence is good but unlabelled"),
    "loop_vs_lexical_frozen": ("loop_aux", "tfidf_frozen_aux",
                               "what the loop adds to g beyond the auxiliary loss"),
    "aux_loss_in_loop": ("loop_aux", "loop", "what the auxiliary loss adds to g in the loop"),
    "beta_f_vs_detached_loop_untied": ("loop_untied", "loop_untied_detached",
                                       "what beta * f teaches g when g's token embedding is its own"),
    "untied_vs_tied_loop": ("loop_untied", "loop", "what an embedding of g's own adds to the loop's g"),
}
"""Named differences (first arm minus second, paired by seed) the report states with CIs."""


def arm_named(name: str) -> Arm:
    for arm in ARMS:
        if arm.name == name:
            return arm
    raise ValueError(f"unknown arm {name!r}; choose from {list(ARM_NAMES)}")
