"""TensorBoard event files of a run (`run.tensorboard`), what people open while a run trains:

    RUN_DIR/tb/trainer   every update: loss, each objective's loss, lr, grad norm, beta and its step over the
                         update's lr (Adam moves it by at most about trainer.beta_lr_scale), tokens/s, target
                         tokens/s, the wait for batches, staleness; at every snapshot each health figure (evidence
                         gains, cosines, spread of g, held-out P@1, the share of g's gradient that flows through f) --
                         written by trainer rank 0 (or the single process)
    RUN_DIR/tb/index     every index version, at the update of its snapshot: link precision (same page, aligned
                         translations), cross-lingual share, cosines of links and of random pairs, lambda of the lexical
                         bootstrap, build seconds -- written by the driver (or the single process)

    tensorboard --logdir RUN_DIR/tb

The writers take the records the run already logs (train_log.jsonl, index_builds.jsonl), so TensorBoard shows
exactly those numbers.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)

STEP_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "target_tokens_per_s", "wait_share", "staleness_max")
INDEX_FIELDS = ("crosslingual_link_precision", "crosslingual_parallel_precision", "crosslingual_share",
                "linked_cosine", "random_cosine", "lexical_weight", "seconds", "docs_per_s", "num_edges")


def scalar(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class RunBoard:
    """One TensorBoard writer of a run (`tb/<name>` under the run folder); a no-op when turned off."""

    def __init__(self, run_dir: Path | str, name: str, enabled: bool = True):
        self.writer = None
        self.previous_beta: tuple[int, float, float] | None = None
        """(step, beta, lr) of the last update logged: beta's step is known one update later."""
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # a machine with torch alone (the single process from a checkout): the run goes on
            log.warning("run.tensorboard is on but the tensorboard package is not installed: no event files "
                        "(pip install tensorboard, or set run.tensorboard=false)")
            return
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb" / name), flush_secs=10)

    def add(self, tag: str, value, step: int) -> None:
        value = scalar(value)
        if self.writer is not None and value is not None:
            self.writer.add_scalar(tag, value, step)

    def step(self, record) -> None:
        """One update's train_log record (a `marge.contracts.train_log.UpdateRecord`, or its dict)."""
        if self.writer is None:
            return
        if not isinstance(record, dict):
            record = record.to_dict()
        step = int(record["step"])
        for name in STEP_FIELDS:
            self.add(f"train/{name}", record.get(name), step)
        for name, value in (record.get("objectives") or {}).items():
            self.add(f"objectives/{name}", value, step)
        if record.get("beta"):
            beta = sum(record["beta"]) / len(record["beta"])
            self.add("train/beta", beta, step)
            # a record holds beta before its own update: the previous update's step is known now
            if self.previous_beta is not None and self.previous_beta[0] == step - 1 and self.previous_beta[2] > 0:
                self.add("train/beta_step_over_lr", (beta - self.previous_beta[1]) / self.previous_beta[2], step - 1)
            self.previous_beta = (step, beta, float(record.get("lr") or 0.0))
        for name, value in (record.get("health") or {}).items():
            if name == "beta" and isinstance(value, list) and value:
                value = sum(value) / len(value)
            self.add(f"health/{name}", value, step)

    def index_build(self, record: dict) -> None:
        """One index version's build record, at the update of the snapshot it was built from."""
        for name in INDEX_FIELDS:
            self.add(f"index/{name}", record.get(name), int(record.get("snapshot_step", record.get("version", 0))))

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
