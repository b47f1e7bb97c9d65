"""The driver's progress lines: one per stage, from the actors' figures and the trainer's last step record."""

from __future__ import annotations

import logging
import time

from marge.contracts.protocol import BatchQueue
from marge.eval.tensorboard import RunBoard
from marge.util.progress import eta_seconds, format_seconds
from services.batcher.stats import combined_stats

log = logging.getLogger("marge.pipeline")  # the run's lines, as `marge pretrain` logs them


class Progress:
    answer_timeout_s: float = 30.0
    """How long a stage's actor has to answer for its figures before this report is skipped."""

    def __init__(self, max_steps: int, queue: BatchQueue, coordinator, batchers: list, board: RunBoard | None = None,
                 start_step: int = 0, deadline_unix: float | None = None):
        self.max_steps, self.queue, self.coordinator, self.batchers = max_steps, queue, coordinator, batchers
        self.board = board
        self.start_step, self.deadline_unix = start_step, deadline_unix
        """Where this driver's run started (a resumed run: its checkpoint's update), and when `run.max_minutes`
        stops it: the ETA is the rate of this session's updates, or the time left, whichever ends first."""
        """Where each new index version's figures go (TensorBoard), as the coordinator reports them."""
        self.boarded: set[int] = set()

    def lines(self) -> list[str]:
        import ray

        bat = combined_stats(ray.get([b.stats.remote() for b in self.batchers], timeout=self.answer_timeout_s))
        idx = (ray.get(self.coordinator.stats.remote(), timeout=self.answer_timeout_s) if self.coordinator is not None
               else None)
        counts = self.queue.counts()
        if idx is not None and self.board is not None:
            for record in idx["history"]:
                if record["version"] not in self.boarded:
                    self.board.index_build(record)
                    self.boarded.add(record["version"])
            self.board.flush()
        out = []
        if idx is None:
            out.append("[indexer] not needed by these objectives")
        elif idx["history"]:
            h = idx["history"][-1]
            aligned = h.get("crosslingual_parallel_precision")
            out.append(f"[indexer] v{h['version']} from snapshot {h['snapshot_step']} | {h['num_documents']} docs, "
                       f"{h['num_edges']} links by {'+'.join(h.get('link_sources', ['g']))}, "
                       f"{100 * h['crosslingual_share']:.0f}% cross-lingual"
                       + (f", {100 * aligned:.0f}% of those to aligned translations" if aligned is not None else "")
                       + f" | {h['docs_per_s']:.0f} docs/s | link cos {h['linked_cosine']:.3f} vs random "
                       f"{h['random_cosine']:.3f}")
        else:
            out.append("[indexer] building the first index")
        waiting = f" | waiting for index v{bat['waiting_for_version']}" if bat["waiting_for_version"] is not None else ""
        builders = f" by {bat['builders']} builders" if bat["builders"] > 1 else ""
        out.append(f"[batcher] produced {bat['produced']}{builders} | next slot {counts['next_slot']} | not yet trained "
                   f"{counts['pending']} | dead-lettered {counts.get('dead_lettered', 0)} | cross-lingual share in "
                   f"batches {100 * bat['crosslingual_share']:.0f}%{waiting}")
        r = self.queue.last_step()
        if r:
            parts = r.get("objectives", {})
            losses = " + ".join(f"{name} {value:.3f}" for name, value in parts.items()) if len(parts) > 1 else ""
            index = (f" | beta {sum(r['beta']) / len(r['beta']):.3f} | staleness {r['staleness_max']} | index "
                     f"v{max(r['index_versions'])}") if r["index_versions"] else ""
            out.append(f"[trainer] step {r['step']}/{self.max_steps} | loss {r['loss']:.3f}"
                       f"{' (' + losses + ')' if losses else ''} | {r['tokens_per_s']:.0f} tok/s | waiting "
                       f"{100 * r['wait_share']:.1f}%{index}{self.eta(r)}")
        else:
            out.append("[trainer] starting")
        return out

    def eta(self, record: dict) -> str:
        """` | ETA 4m05s` from this session's updates per second (and `run.max_minutes`), or nothing yet."""
        left = eta_seconds(record["step"] - self.start_step, self.max_steps - self.start_step,
                           record.get("elapsed_s", 0.0))  # since the first batches were in hand: the steady rate
        if self.deadline_unix is not None:
            until_deadline = max(0.0, self.deadline_unix - time.time())
            left = until_deadline if left is None else min(left, until_deadline)
        return "" if left is None else f" | ETA {format_seconds(left)}"


def log_progress(progress: Progress) -> bool:
    """Log the progress lines; False when a stage's actor did not answer in time or is being restarted (a node lost
    or cut off): that costs one report, never the run. Whether a stage failed for good is what its `run` says."""
    import ray.exceptions

    try:
        lines = progress.lines()
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
        log.warning("no progress report: a stage did not answer within %g s (%s); the run goes on",
                    progress.answer_timeout_s, type(e).__name__)
        return False
    for line in lines:
        log.info(line)
    return True
