"""The driver's progress lines: one per stage, from the actors' figures and the trainer's last step record."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator

from marge.contracts.protocol import BatchQueue
from marge.eval.tensorboard import RunBoard
from marge.util.local_ray import machine_load
from marge.util.progress import eta_seconds, format_seconds
from services.batcher.stats import combined_stats
from services.driver.language_links import cut_off_languages, describe_cut_off, language_link_balance
from services.driver.resources import StageFailure, describe_stage_failure

log = logging.getLogger("marge.pipeline")  # the run's lines, as `marge pretrain` logs them


class Progress:
    answer_timeout_s: float = 30.0
    """How long a stage's actor has to answer for its figures before this report is skipped."""

    def __init__(self, max_steps: int, queue: BatchQueue, coordinator, batchers: list, board: RunBoard | None = None,
                 start_step: int = 0, deadline_unix: float | None = None, joined_cluster: bool = False):
        self.max_steps, self.queue, self.coordinator, self.batchers = max_steps, queue, coordinator, batchers
        self.board = board
        self.start_step, self.deadline_unix = start_step, deadline_unix
        """Where this driver's run started (a resumed run: its checkpoint's update), and when `run.max_minutes`
        stops it: the ETA is the rate of this session's updates, or the time left, whichever ends first."""
        """Where each new index version's figures go (TensorBoard), as the coordinator reports them."""
        self.boarded: set[int] = set()
        self.silence_limit_s = stage_silence_limit_s(joined_cluster)
        self.last_answer, self.answered = time.monotonic(), False
        """When every stage last answered (or the reports began): a stage silent for `silence_limit_s` ends the run."""
        self.warned: set[tuple] = set()
        """(index version, languages) whose cut-off warning was logged: once each, the progress line every time."""

    def lines(self) -> list[str]:
        names = [f"batcher {n}" if len(self.batchers) > 1 else "batcher" for n in range(len(self.batchers))]
        asked = {name: b.stats.remote() for name, b in zip(names, self.batchers)}
        if self.coordinator is not None:
            asked["indexer"] = self.coordinator.stats.remote()
        answers = stage_answers(asked, min(self.answer_timeout_s, self.silence_limit_s))
        self.last_answer, self.answered = time.monotonic(), True
        bat = combined_stats([answers[name] for name in names])
        idx = answers.get("indexer")
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
        sources = {s for h in (idx["history"] if idx else []) if h["version"] == bat.get("links_version")
                   for s in h.get("link_sources", [])}
        out += self.language_lines(bat, bool(sources & {"tfidf", "hybrid"}))
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

    def language_lines(self, bat: dict, lexical: bool) -> list[str]:
        """A `[links]` line when a language is cut off from the cross-lingual links of the newest index version's
        batches (`combined_stats`), and its warning with what to change, logged once a version; `lexical`: the
        version's links were ranked with char TF-IDF."""
        cut = cut_off_languages(language_link_balance(bat.get("links_by_language", {}),
                                                      bat.get("documents_by_language", {})))
        if not cut:
            return []
        where = f"the batches of index v{bat['links_version']}"
        key = (bat["links_version"], tuple(c["language"] for c in cut))
        if key not in self.warned:
            self.warned.add(key)
            log.warning("%s", describe_cut_off(cut, where, lexical))
        return [f"[links] cut off in {where}: " + "; ".join(
            f"{c['language']} {c['way']} {100 * c['share']:.1f}% of the cross-lingual links "
            f"({100 * c['expected']:.0f}% expected)" for c in cut)]

    def eta(self, record: dict) -> str:
        """` | ETA 4m05s` from this session's updates per second (and `run.max_minutes`), or nothing yet."""
        left = eta_seconds(record["step"] - self.start_step, self.max_steps - self.start_step,
                           record.get("elapsed_s", 0.0))  # since the first batches were in hand: the steady rate
        if self.deadline_unix is not None:
            until_deadline = max(0.0, self.deadline_unix - time.time())
            left = until_deadline if left is None else min(left, until_deadline)
        return "" if left is None else f" | ETA {format_seconds(left)}"


@contextlib.contextmanager
def setup_phase(logger: logging.Logger, what: str) -> Iterator[list[str]]:
    """A set-up phase of a run (opening the corpus, the initial model, the first index...) between two lines:
    `[setup] what ...` as it starts and `[setup] what: <what the block appended> | 3s` as it ends, so that no
    minute before the first update passes in silence."""
    logger.info("[setup] %s ...", what)
    started = time.perf_counter()
    notes: list[str] = []
    yield notes
    logger.info("[setup] %s%s | %s", what, ": " + ", ".join(notes) if notes else " done",
                format_seconds(time.perf_counter() - started))


SILENCE_LIMIT_S = 300.0
"""How long a stage may go without answering before the run ends with a line saying so (MARGE_STAGE_SILENCE_LIMIT_S
overrides it): longer than Ray takes to restart an actor of a lost node, far shorter than a user waits in silence."""


def stage_silence_limit_s(joined_cluster: bool) -> float:
    """How long the stages may stay silent before the run ends: MARGE_STAGE_SILENCE_LIMIT_S where set; else
    SILENCE_LIMIT_S on a Ray the run started or was given in-process, and no limit on a cluster it joined
    (`ray.address`), where an autoscaler may take longer than that to start the nodes a stage waits for."""
    if "MARGE_STAGE_SILENCE_LIMIT_S" in os.environ:
        return float(os.environ["MARGE_STAGE_SILENCE_LIMIT_S"])
    return math.inf if joined_cluster else SILENCE_LIMIT_S


class StagesSilent(TimeoutError):
    """Some stages did not answer within the report's time."""

    def __init__(self, stages: list[str]):
        super().__init__(", ".join(stages))
        self.stages = stages


def stage_answers(asked: dict, timeout_s: float) -> dict:
    """Each stage's answer (name -> value); StagesSilent naming those that did not answer within `timeout_s`, and
    `StageFailure` naming one whose call failed for a reason other than a restart (the actor could not be
    scheduled, or died for good)."""
    import ray
    import ray.exceptions

    ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout_s)
    silent = [name for name, ref in asked.items() if ref not in ready]
    if silent:
        raise StagesSilent(silent)
    answers = {}
    for name, ref in asked.items():
        try:
            answers[name] = ray.get(ref)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            raise  # restarting (a node lost or cut off), or dead: the stage's `run` says whether for good
        except ray.exceptions.RayError as e:
            raise describe_stage_failure(name, e) from e
    return answers


def log_progress(progress: Progress) -> bool:
    """Log the progress lines; False when a stage's actor did not answer in time or is being restarted (a node lost
    or cut off): that costs one report, never the run, unless the stages stayed silent for `silence_limit_s`
    (`StageFailure`). Whether a stage failed for good is what its `run` says."""
    import ray.exceptions

    try:
        lines = progress.lines()
    except (ray.exceptions.GetTimeoutError, StagesSilent, ray.exceptions.RayActorError) as e:
        silent_s = time.monotonic() - progress.last_answer
        stages = e.stages if isinstance(e, StagesSilent) else ["a stage"]
        if silent_s >= progress.silence_limit_s:
            started = "since the run started" if not progress.answered else "in a row"
            raise StageFailure(
                f"the {' and '.join(stages)} stage{'s' if len(stages) > 1 else ''} did not answer for "
                f"{format_seconds(silent_s)} {started}: its actor is hung, or cannot start because the machine is "
                f"too loaded ({machine_load()}) or short of memory; its worker log under the Ray session's logs "
                "folder says which; start the run again to resume it (MARGE_STAGE_SILENCE_LIMIT_S sets how long to "
                "wait)") from e
        log.warning("no progress report: %s did not answer within %g s (%s); the run goes on",
                    "the " + " and ".join(stages) if isinstance(e, StagesSilent) else "a stage",
                    min(progress.answer_timeout_s, progress.silence_limit_s),
                    "GetTimeoutError" if isinstance(e, StagesSilent) else type(e).__name__)
        return False
    for line in lines:
        log.info(line)
    return True
