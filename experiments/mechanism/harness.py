"""`python -m experiments.mechanism`: does the reconstruction loss teach g to retrieve through beta * f?

Every arm is a single-process run (`services.driver.single_process`) of the learning recipe as the study ran it
(`experiments/configs/learning-2026-11-26.yaml`) with the study's common settings and the arm's own, for the same number of
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
from pathlib import Path

from experiments.mechanism.arms import COMMON, Arm, arm_named

log = logging.getLogger("marge.mechanism")

DEFAULT_CONFIG = Path("experiments/configs/learning-2026-11-26.yaml")
UNBOUNDED_MINUTES = 1e6
"""Arms stop at `run.max_steps` (equal updates); minutes are no limit."""

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
    """Every (arm, seed) to `updates`, `jobs` at a time (each a process with cores / jobs threads, which also
    measures its run when it is trained), then the held-out measures of any run not measured yet and the report."""
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
            if finished_updates(run_dir(out, arm.name, seed)) >= updates and not measure:
                return 0
            cmd = [sys.executable, "-m", "experiments.mechanism", "run-one", "--out", str(out), "--arm", arm.name,
                   "--seed", str(seed), "--updates", str(updates), "--device", device,
                   *(["--config", str(config)] if config else []), *(["--measure"] if measure else []), *extra]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
            log_path = run_dir(out, arm.name, seed).parent / f"seed-{seed}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a", encoding="utf-8") as f:
                code = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
            if code != 0:
                log.error("%s seed %d failed (exit %d): see %s", arm.name, seed, code, log_path)
            return code

        with ThreadPoolExecutor(jobs) as pool:  # a failed run does not stop the others: every one is tried
            codes = list(pool.map(launch, todo))
        failed = [f"{arm.name} seed {seed}" for (arm, seed), code in zip(todo, codes) if code != 0]
        if failed:
            raise RuntimeError(f"{len(failed)} run(s) failed: {', '.join(failed)} (their logs are beside their "
                               "folders); the others are kept, and running the command again retries these")
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
    folder = run_arm(args.config, arm_named(args.arm), args.seed, args.updates, args.out, args.device,
                     tuple(args.overrides))
    log.info("%s seed %d: trained in %.1f min", args.arm, args.seed, (time.time() - t0) / 60)
    if args.measure:
        from experiments.mechanism.measures import measure_run

        measure_run(folder, device=args.device)
        log.info("%s seed %d: measured, %.1f min in all", args.arm, args.seed, (time.time() - t0) / 60)
    return 0
