"""`python -m experiments.mechanism`: does the reconstruction loss teach g to retrieve through beta * f?

Every arm is a single-process run (`services.driver.single_process`) of the learning recipe
(`deploy/configs/learning.yaml`) with the study's common settings and the arm's own, for the same number of
**updates** (`--updates`), on several seeds (`--seeds`: the seed draws the initial weights and the batch stream).
Arms differ in three things only, each named in the arm:

    index       'loop'          version 0 from char n-gram TF-IDF, then cos(g) + lambda * tfidf, lambda annealed
                                to 0 at `indexer.lexical_until` (the study hands over at update 1,000, so that the
                                last versions of a run rank by g alone), rebuilt every 250 updates
                'tfidf_frozen'  char n-gram TF-IDF neighbours, never rebuilt: g never chooses the evidence
                'aligned'       the loop's link budget (2 same-language links by TF-IDF, 4 cross-lingual slots
                                filled with the aligned translations, then random documents), rebuilt every 250
                                updates with new random ones: the decoder's ceiling, built from labels
                'paper'         the paper's loop: version 0 from the random-init g, then g
    aux_loss    the denoising-contrastive loss on g (`objectives.denoising_contrastive`), or none
    detached_f  `objectives.marge.detach_relevance`: beta * f still biases the cross-attention, but no gradient
                reaches g through f. g then learns only through the encoder's memory (and the auxiliary loss).

Self-evidence (noised copies of a target among its evidence) is off in every arm: through beta * f it would reward
g for recognising a document's own text, a signal the paper does not have.

Held-out measures of every checkpoint come from `experiments.mechanism.measures` (the five evidence conditions,
g's P@1 with one centring procedure for trained and initial models, page-resampled bootstraps); the report puts the
seeds together (`experiments.mechanism.report`).

    DIR/runs/<arm>/seed-<s>/    one single-process run (resumable; `--updates` can be raised later)
    DIR/runs/<arm>/seed-<s>/measures.json   the held-out measures of its checkpoints
    DIR/report.json, DIR/curves.png
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("marge.mechanism")

DEFAULT_CONFIG = Path("deploy/configs/learning.yaml")
UNBOUNDED_MINUTES = 1e6
"""Arms stop at `run.max_steps` (equal updates); minutes are no limit."""

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


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return Path(out) / "runs" / arm / f"seed-{seed}"


def finished_updates(folder: Path) -> int:
    """Updates the run in `folder` has finished (its report's), 0 when none."""
    report = folder / "report.json"
    if not report.exists():
        return 0
    return int(json.loads(report.read_text(encoding="utf-8"))["pipeline"]["steps"])


def run_arm(config: Path | None, arm: Arm, seed: int, updates: int, out: Path, device: str = "auto",
            extra: tuple[str, ...] = ()) -> Path:
    """One arm on one seed to `updates` updates: started, resumed (also to raise its updates), or kept."""
    from services.driver.single_process import run_single_process

    folder = run_dir(out, arm.name, seed)
    if finished_updates(folder) >= updates:
        log.info("%s seed %d: %d updates done, kept", arm.name, seed, finished_updates(folder))
        return folder
    if (folder / "experiment.json").exists():
        run_single_process(None, [f"run.max_steps={updates}"], UNBOUNDED_MINUTES, folder, resume=True, device=device)
    else:
        overrides = [*COMMON, *extra, *arm.overrides, f"run.seed={seed}", f"run.max_steps={updates}"]
        run_single_process(config or DEFAULT_CONFIG, overrides, UNBOUNDED_MINUTES, folder, device=device)
    return folder


def run_study(config: Path | None, arms: list[str], seeds: list[int], updates: int, out: Path, jobs: int = 1,
              device: str = "auto", extra: tuple[str, ...] = (), measure: bool = True) -> dict:
    """Every (arm, seed) to `updates`, `jobs` at a time (each a process with cores / jobs threads), then the
    held-out measures of each run and the report."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    todo = [(arm_named(a), s) for a in arms for s in seeds]  # arm by arm: the first arms' seeds finish first
    if jobs <= 1:
        for arm, seed in todo:
            run_arm(config, arm, seed, updates, out, device, extra)
    else:
        threads = max(1, (os.cpu_count() or 1) // jobs)

        def launch(item: tuple[Arm, int]) -> int:
            arm, seed = item
            if finished_updates(run_dir(out, arm.name, seed)) >= updates:
                return 0
            cmd = [sys.executable, "-m", "experiments.mechanism", "run-one", "--out", str(out), "--arm", arm.name,
                   "--seed", str(seed), "--updates", str(updates), "--device", device,
                   *(["--config", str(config)] if config else []), *extra]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
            log_path = run_dir(out, arm.name, seed).parent / f"seed-{seed}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a", encoding="utf-8") as f:
                code = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
            if code != 0:
                raise RuntimeError(f"{arm.name} seed {seed} failed (exit {code}): see {log_path}")
            return code

        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(launch, todo))
    if not measure:
        return {}
    from experiments.mechanism.measures import measure_run
    from experiments.mechanism.report import write_report

    if measure:
        for arm, seed in todo:
            measure_run(run_dir(out, arm.name, seed), device=device)
    return write_report(out)


def main_run_one(args) -> int:
    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(threads)
    t0 = time.time()
    run_arm(args.config, arm_named(args.arm), args.seed, args.updates, args.out, args.device, tuple(args.overrides))
    log.info("%s seed %d: done in %.1f min", args.arm, args.seed, (time.time() - t0) / 60)
    return 0
