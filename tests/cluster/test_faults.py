"""Exactly-once under faults, on the real pipeline (Ray, redis-server, the `tiny` model, a small corpus).

Faults are real: SIGKILL of a trainer worker, the batcher actor, an indexer worker, redis-server and the driver;
a crash halfway through writing a checkpoint, a NaN loss and a poison batch come from the test-only `faults:`
config section (marge.contracts.faults), never from a mock. Every run ends with `marge audit` passing, and every slot
holds the batch an uninterrupted run with the same seed trains in it. The poison batch (slot 5) and the NaN
loss (slot 13) are part of every run's data, the uninterrupted one's too: they change the model, and with it
the later index versions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from processes import LOOPBACK, listening_addresses, pids_in_session, pids_with_title  # tests/processes.py

REPO = Path(__file__).resolve().parents[2]

SCHEDULE = ("run.max_steps=24", "trainer.num_workers=2", "trainer.snapshot_every=6", "indexer.reindex_every=6",
            "trainer.checkpoint_every=6", "trainer.max_failures=3", "trainer.warmup_steps=2", "trainer.lr=2e-3",
            "faults.poison_slot=5", "faults.nan_loss_slot=13")


def fault_config(tmp_path: Path, corpus: Path, name: str, *extra: str):
    from services.driver.config import load_config

    return load_config(REPO / "deploy/configs/tiny.yaml", [
        f"run.name={name}", f"run.dir={tmp_path / name}", f"data.corpus={corpus}", "data.max_chunk_tokens=128",
        "model.max_positions=128", "batcher.max_tokens=400", "run.progress_every_s=2", "health.aligned_probe_size=8",
        "health.external_probes=true", *SCHEDULE, *extra])  # the demo's held-out pages, not beside the corpus's input


def slot_batches(run_dir: Path) -> dict[int, str]:
    """slot -> batch id, from the run's train_log.jsonl."""
    out = {}
    for line in (run_dir / "train_log.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.update(zip(record["slots"], record["batch_ids"]))
    return out


def audit_of(run_dir: Path) -> tuple[int, dict]:
    """`marge audit --run DIR --json`: its exit status and its JSON line."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", "audit", "--run", str(run_dir), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def newest_step(run_dir: Path) -> int:
    log = run_dir / "train_log.jsonl"
    if not log.exists():
        return 0
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except ValueError:
        return 0  # a line being written


def sigkill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def reference_run(ray_cluster, small_corpus, tmp_path_factory):
    """The uninterrupted run every faulty run is compared with."""
    from services.driver.pipeline import run_pipeline

    summary = run_pipeline(fault_config(tmp_path_factory.mktemp("reference"), small_corpus, "reference"))
    return Path(summary["run_dir"]), summary


@pytest.mark.slow
def test_reference_run_audits_clean(reference_run):
    run_dir, summary = reference_run
    code, audit = audit_of(run_dir)
    print("REFERENCE " + json.dumps(audit))
    assert code == 0 and audit["ok"]
    assert audit["steps"] == 24 and audit["batches_trained"] == 46 and audit["batches_lost"] == 0
    assert audit["trained_twice"] == 0 and audit["batches_dead_lettered"] == 2
    assert summary["batches_trained"] == 46 and summary["commit_conflicts"] == 0
    assert sorted(slot_batches(run_dir)) == list(range(48))
    # the index switches at fixed steps: version v (snapshot 6v) serves updates 6v+6 .. 6v+11
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [r["index_versions"] for r in records] == [[0]] * 12 + [[1]] * 6 + [[2]] * 6
    assert max(r["staleness_max"] for r in records) <= 6 + 6 - 1
    # the private redis-server's password is nowhere under run.dir
    from services.driver.redis_server import private_conf_dir

    conf = (private_conf_dir(run_dir) / "redis.conf").read_text()
    password = next(line.split(" ", 1)[1] for line in conf.splitlines() if line.startswith("requirepass "))
    assert not [p for p in run_dir.rglob("*") if p.is_file() and password.encode() in p.read_bytes()]


@pytest.mark.slow
def test_faults_inside_a_run_lose_nothing_and_train_nothing_twice(reference_run, small_corpus, tmp_path, caplog):
    """One run through: the batcher, an indexer worker, redis-server and a trainer worker SIGKILLed at different
    updates, rank 0 dying halfway through the checkpoint of update 12, a poison batch in slot 5 and a NaN loss in
    slot 13."""
    import logging

    from services.driver.pipeline import run_pipeline

    cfg = fault_config(tmp_path, small_corpus, "faults", "faults.crash_in_checkpoint_step=12")
    run_dir = Path(cfg.run.dir)
    kills: dict[str, int] = {}
    done = threading.Event()

    def killer() -> None:
        plan = [(3, "batcher", lambda: pids_with_title("ray::Batcher")),
                (7, "indexer worker", lambda: pids_with_title("ray::IndexerWorker")[:1]),
                (9, "redis-server", lambda: [int((run_dir / "redis" / "redis-server.pid").read_text())]),
                (16, "trainer worker", lambda: pids_with_title("ray::RayTrainWorker")[-1:])]
        for at_step, name, find in plan:
            while newest_step(run_dir) < at_step or (name == "trainer worker" and not
                                                     (run_dir / "faults" / "crashed-in-checkpoint-12").exists()):
                if done.wait(0.1):
                    return
            pids = find()
            assert pids, f"no {name} process to kill"
            sigkill(pids)
            kills[name] = newest_step(run_dir)

    audits: dict[int, dict] = {}  # checkpoint update -> `marge audit` of the live run at that checkpoint

    def auditor() -> None:
        """Audit the live run at every new checkpoint, so each fault has the figures measured after it."""
        from marge.contracts.protocol import BatchQueue
        from services.driver.redis_server import LocalRedis, private_conf_dir
        from services.ops.audit import audit, run_config_of

        while not (private_conf_dir(run_dir) / "redis.conf").exists() or not (run_dir / "config.yaml").exists():
            if done.wait(0.2):
                return
        run_cfg = run_config_of(run_dir)
        queue = BatchQueue.connect(LocalRedis.reopen(run_dir / "redis", private_conf_dir(run_dir)).url,
                                   run_cfg.run.name, run_cfg.slots())
        while not done.wait(0.3):
            try:
                record = audit(run_cfg, queue)
            except Exception:  # noqa: BLE001 - Redis restarting, a checkpoint being written: try again
                continue
            audits.setdefault(record["steps"], record)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    watcher = threading.Thread(target=auditor, daemon=True)
    watcher.start()
    caplog.set_level(logging.INFO)
    try:
        summary = run_pipeline(cfg)
    finally:
        done.set()
        thread.join(timeout=10)
        watcher.join(timeout=30)
    assert set(kills) == {"batcher", "indexer worker", "redis-server", "trainer worker"}, kills
    assert summary["steps"] == 24 and summary["redis_restarts"] == 1
    # nothing lost or trained twice at any checkpoint of the live run either
    assert audits and all(a["batches_lost"] == 0 and a["trained_twice"] == 0 for a in audits.values()), audits
    after = {name: next((a for step, a in sorted(audits.items()) if step > at), None) for name, at in kills.items()}
    figures = {name: {"killed_at_update": kills[name], **({k: a[k] for k in ("steps", "batches_produced",
               "batches_trained", "batches_lost", "trained_twice", "batches_dead_lettered")} if a else {})}
               for name, a in after.items()}

    code, audit = audit_of(run_dir)
    assert code == 0 and audit["ok"], audit
    assert (audit["batches_lost"], audit["trained_twice"]) == (0, 0)
    assert audit["batches_trained"] == 46 and audit["batches_dead_lettered"] == 2
    # every slot holds the batch the uninterrupted run trained there
    assert slot_batches(run_dir) == slot_batches(reference_run[0])
    from services.ops.audit import run_queue

    with run_queue(run_dir) as (_, queue):
        dead = {d["slot"]: d["reason"] for d in queue.dead_letters()}
    assert set(dead) == {5, 13}
    assert "outside the vocabulary" in dead[5] and "non-finite loss" in dead[13] and "v0-e0-s" in dead[13]
    assert (run_dir / "faults" / "crashed-in-checkpoint-12").exists()
    stored = list((run_dir / "ray_train" / cfg.run.name).glob("step-*"))
    assert stored and all((p / "manifest.json").exists() for p in stored)  # nothing half-written was stored
    print("FAULTS " + json.dumps({"after_each_fault": figures, "final_audit": audit}))


@pytest.mark.slow
@pytest.mark.parametrize("point,rank", [("after_report", 0), ("after_report", 1), ("after_barrier", 0),
                                        ("after_barrier", 1)])
def test_a_rank_killed_inside_the_commit_window_loses_nothing_and_trains_nothing_twice(reference_run, small_corpus,
                                                                                      tmp_path, point, rank):
    """A trainer rank dies in the checkpoint of update 12 after its report (before the barrier that waits for rank
    0's upload) or after that barrier (before its commit): Ray Train restarts the group from the newest good
    checkpoint, the queue agrees with it, and every slot ends with the batch the uninterrupted run trained there.
    (A rank's commit and its stream's trim are one Redis script: there is no point between them.)"""
    from services.driver.pipeline import run_pipeline

    cfg = fault_config(tmp_path, small_corpus, f"commit-{point}-{rank}", f"faults.crash_in_commit_window={point}",
                       "faults.crash_in_commit_window_step=12", f"faults.crash_in_commit_window_rank={rank}")
    run_dir = Path(cfg.run.dir)
    t0 = time.monotonic()
    summary = run_pipeline(cfg)
    assert (run_dir / "faults" / f"crashed-{point}-12-rank{rank}").exists()
    assert summary["steps"] == 24
    code, audit = audit_of(run_dir)
    assert code == 0 and audit["ok"], audit
    assert (audit["batches_lost"], audit["trained_twice"]) == (0, 0)
    assert audit["batches_trained"] == 46 and audit["batches_dead_lettered"] == 2
    assert slot_batches(run_dir) == slot_batches(reference_run[0])
    # recovery: from the crash to the first update of the final train log trained after it
    crashed_at = (run_dir / "faults" / f"crashed-{point}-12-rank{rank}").stat().st_mtime
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines() if line.strip()]
    first_after = next(r for r in records if r["time"] > crashed_at)
    print("COMMIT-WINDOW " + json.dumps({"point": point, "rank": rank, "first_update_after": first_after["step"],
                                         "recovery_s": round(first_after["time"] - crashed_at, 1),
                                         "run_s": round(time.monotonic() - t0, 1)}))


@pytest.mark.slow
def test_two_builders_one_killed_and_a_trainer_worker_killed_lose_nothing(ray_cluster, small_corpus, tmp_path):
    """Two batch builders, each writing one rank's slots: builder 1 SIGKILLed at update 4 (Ray restarts it; it
    resumes at its cursor, passing over the shards before it by their counts) and a trainer worker after update
    15 (the group restarts from the checkpoint of update 12, past which the ranks' progress had trimmed the
    streams: the queue is reset and the builders write those slots again). The audit is clean, and every slot
    holds the batch the builders' schedule gives it, recomputed here from the index versions on disk."""
    from marge.contracts.corpus import Corpus
    from marge.contracts.index_store import read_version, version_dirname
    from services.batcher.core import DocumentStore
    from services.batcher.schedule import BatchSchedule
    from services.driver.pipeline import run_pipeline

    cfg = fault_config(tmp_path, small_corpus, "builders", "batcher.builders=2", "indexer.keep_versions=4")
    run_dir = Path(cfg.run.dir)
    kills: dict[str, int] = {}
    done = threading.Event()

    def killer() -> None:
        plan = [(4, "builder 1", lambda: pids_with_title("ray::Batcher")),
                (15, "trainer worker", lambda: pids_with_title("ray::RayTrainWorker")[-1:])]
        for at_step, name, find in plan:
            while newest_step(run_dir) < at_step:
                if done.wait(0.1):
                    return
            pids = find()
            if name == "builder 1":  # the actor whose stats name it builder 1 is not known by pid: kill one of two
                assert len(pids) == 2, pids
                pids = pids[1:]
            assert pids, f"no {name} process to kill"
            sigkill(pids)
            kills[name] = newest_step(run_dir)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        summary = run_pipeline(cfg)
    finally:
        done.set()
        thread.join(timeout=10)
    assert set(kills) == {"builder 1", "trainer worker"}, kills
    assert summary["steps"] == 24
    code, audit = audit_of(run_dir)
    assert code == 0 and audit["ok"], audit
    assert (audit["batches_lost"], audit["trained_twice"]) == (0, 0)
    assert audit["batches_trained"] == 46 and audit["batches_dead_lettered"] == 2
    trained = slot_batches(run_dir)
    assert sorted(trained) == list(range(48))
    slots, plan = cfg.slots(), cfg.version_plan()
    assert slots.builders == 2 and list(run_dir.glob("batch_counts/v*-g1-*.jsonl"))
    docs = DocumentStore(Corpus.open(small_corpus))
    versions = {v: read_version(run_dir / "index" / version_dirname(v)) for v in range(3)
                if (run_dir / "index" / version_dirname(v) / "manifest.json").exists()}
    checked = 0
    for group in (0, 1):
        schedule = BatchSchedule(docs, cfg.batcher, cfg.run.seed, slots, plan, versions.get, cfg.batch_shape(), group)
        for slot in range(48):
            if slots.group_of(slot) == group and plan.version_for_step(slots.step_of(slot)) in versions and slot != 5:
                assert schedule.batch(slot).batch_id == trained[slot], slot
                checked += 1
    assert checked >= 20, versions.keys()
    print("BUILDERS " + json.dumps({"kills": kills, "final_audit": audit, "slots_recomputed": checked}))


DRIVER = [sys.executable, "-m", "services.cli", "pretrain", "--config", str(REPO / "deploy/configs/tiny.yaml")]


@pytest.mark.slow
def test_a_killed_driver_resubmitted_resumes_from_its_newest_good_checkpoint(reference_run, small_corpus, tmp_path):
    """SIGKILL the driver (its redis-server is orphaned, its Ray goes with it), corrupt its newest checkpoint, and
    submit it again: it adopts the orphan, falls back to the previous checkpoint, discards the later snapshots
    and index versions, and trains every slot once, as the uninterrupted run does."""
    from marge.model.checkpoint import complete_checkpoints
    from services.driver.redis_server import pid_is_redis

    cfg = fault_config(tmp_path, small_corpus, "driver")
    run_dir = Path(cfg.run.dir)
    args = [f"run.name={cfg.run.name}", f"run.dir={run_dir}", f"data.corpus={small_corpus}", "data.max_chunk_tokens=128",
            "model.max_positions=128", "batcher.max_tokens=400", "run.progress_every_s=2", "ray.num_cpus=4", *SCHEDULE]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    driver = subprocess.Popen([*DRIVER, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while newest_step(run_dir) < 14 and driver.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert newest_step(run_dir) >= 14, driver.stdout.read()[-3000:] if driver.poll() is not None else "too slow"
        redis_pid = int((run_dir / "redis" / "redis-server.pid").read_text())
        # the embedded default listens on loopback only: the driver, its Ray, its workers and its redis-server
        listening = listening_addresses([*pids_in_session(driver.pid), redis_pid])
        exposed = [(host, port, owner) for host, port, owner in listening if host not in LOOPBACK]
        assert listening and not exposed, exposed
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    finally:
        with_ray = [p for p in pids_in_session(driver.pid) if p != redis_pid] if driver.pid else []
        sigkill(with_ray)  # the killed driver's local Ray (its redis-server has a session of its own)
    assert pid_is_redis(redis_pid)  # orphaned
    checkpoints = complete_checkpoints(run_dir / "ray_train" / cfg.run.name)
    assert [p.name for p in checkpoints][-2:] == ["step-00000006", "step-00000012"]
    part = max((checkpoints[-1] / "state").glob("*.distcp"), key=lambda f: f.stat().st_size)
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # the newest checkpoint is torn

    again = subprocess.run([*DRIVER, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    log = again.stderr
    assert f"adopted redis-server pid {redis_pid}" in log
    assert "skipping checkpoint" in log and "resuming from" in log and "(update 6)" in log
    assert json.loads(again.stdout.strip().splitlines()[-1])["resumed_from_step"] == 6
    assert not pid_is_redis(redis_pid)  # stopped at the end of the resumed run, not doubled
    code, audit = audit_of(run_dir)
    assert code == 0 and audit["ok"] and audit["batches_trained"] == 46, audit
    assert slot_batches(run_dir) == slot_batches(reference_run[0])
    steps = [json.loads(line)["step"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 25))  # the lines of updates 7-14 the crashed lineage wrote are gone
    print("DRIVER " + json.dumps({"killed_at_update": 14, "resumed_from": 6, "final_audit": audit}))


def test_a_second_driver_on_a_live_run_is_refused_and_a_dead_drivers_lock_is_taken_over(tmp_path):
    from services.driver.lock import DriverLock, RunLocked

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom services.driver.lock import DriverLock\n"
                               f"lock = DriverLock({str(tmp_path)!r}).acquire()\nprint('held', flush=True)\ntime.sleep(60)"],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=f"another `marge pretrain`.*\"pid\": {holder.pid}"):
            DriverLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with DriverLock(tmp_path) as lock:  # the holder died: its lock went with it
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def test_a_bad_batch_is_left_out_of_its_update_with_a_zero_weight_stand_in(small_index, small_corpus):
    """An update on [good, poison] applies half the gradient of [good] alone (each batch weighs 1/2; the poison
    batch's stand-in weighs 0), and on [good, NaN loss] the same: its one read finds the loss not finite and the
    update is computed again without that batch. Both name the slot and the reason."""
    from marge.contracts.corpus import Corpus
    from marge.contracts.slots import Slots
    from marge.model.architecture import preset
    from marge.model.network import Marge
    from services.batcher.actor import poisoned
    from services.batcher.config import BatcherConfig
    from services.batcher.core import DocumentStore, epoch_batches
    from services.trainer.config import TrainerConfig
    from services.trainer.objectives import Objectives, ObjectivesConfig
    from services.trainer.step import Item, Trainee, run_update

    corpus = Corpus.open(small_corpus)
    specials = corpus.tokenizer().specials
    good, other = list(epoch_batches(small_index, DocumentStore(corpus), BatcherConfig(max_tokens=400), 0))[:2]
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=corpus.tokenizer().vocab_size, max_positions=128, dropout=0.0))
    objectives = Objectives(ObjectivesConfig(), specials)

    class Capture:  # an optimizer that keeps the gradient it is asked to apply
        param_groups = [{"lr": 0.0}]
        gradient = None

        def step(self):
            self.gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()

        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=set_to_none)

    class Constant:
        def step(self):
            pass

    def gradient(items: list[Item], slots: Slots, nan_slot=None):
        optimizer = Capture()
        done, read = run_update(Trainee(model, model, optimizer, Constant(), objectives, TrainerConfig(clip_norm=0),
                                        torch.device("cpu"), slots=slots, nan_loss_slot=nan_slot), items)
        return done, optimizer.gradient

    _, alone = gradient([Item(0, good)], Slots(1, 1))
    done, with_poison = gradient([Item(0, good), Item(1, poisoned(other))], Slots(1, 2))
    assert done.trained == [(0, good.batch_id)] and done.dead_lettered[0][0] == 1
    assert "outside the vocabulary" in done.dead_lettered[0][1]
    # the same key seeds slot 0's preparation in both (seed, update 0, position 0): only the weight differs
    assert np.allclose(with_poison.numpy(), 0.5 * alone.numpy(), atol=1e-6)
    done, with_nan = gradient([Item(0, good), Item(1, other)], Slots(1, 2), nan_slot=1)
    assert done.trained == [(0, good.batch_id)]
    assert done.dead_lettered == [(1, f"non-finite loss (nan) on batch {other.batch_id}")]
    assert np.allclose(with_nan.numpy(), 0.5 * alone.numpy(), atol=1e-6)


def test_the_newest_good_checkpoint_skips_torn_and_half_uploaded_ones_and_orders_attempts(tmp_path):
    """Storage copies a checkpoint's files in no fixed order: a crash mid-upload can leave a torn manifest or
    a manifest without its files. Both are skipped (never an exception that stops every resume), and a second
    attempt at an update (`step-N-1`, written after resuming from an older checkpoint) is newer than the first."""
    from tiny_training import stand_in_tokenizer, tiny_training  # tests/tiny_training.py

    from marge.model.checkpoint import checkpoint_dir_name, complete_checkpoints, save_checkpoint
    from marge.model.lineage import newest_good_checkpoint

    model, optimizer, scheduler = tiny_training()
    tokenizer_dir = stand_in_tokenizer(tmp_path / "tok")
    root = tmp_path / "ckpt"
    for step in (6, 12, 12):
        save_checkpoint(root / checkpoint_dir_name(root, step), model, optimizer, scheduler, step, tokenizer_dir, {})
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000006", "step-00000012", "step-00000012-1"]
    assert newest_good_checkpoint(root).name == "step-00000012-1"
    (root / "step-00000012-1" / "manifest.json").write_text('{"format": "marge-checkpoint", "ver')  # torn
    (root / "step-00000012" / "training_state.pt").unlink()  # its upload never got there
    assert newest_good_checkpoint(root).name == "step-00000006"
