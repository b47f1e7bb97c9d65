"""What a checkpoint folder on run storage can and cannot make a reader do.

A crafted `state/.metadata` runs nothing and is refused naming the file; a checkpoint that a replaced trainer group
finished after a newer group resumed from an older update is never a resume point; the driver and the ranks pick
the same checkpoint, also when a read fails once; the files a checkpoint's durability rests on are fsynced.

Real checkpoint folders of the tiny model, a real redis-server for the trainer generations, real file-system
errors (a file a process without CAP_DAC_OVERRIDE may not read) and real system calls (strace)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_training import stand_in_tokenizer, tiny_training  # tests/tiny_training.py

from marge.contracts.slots import Slots
from marge.model.checkpoint import CheckpointError, CheckpointWrite, WriteSettings, read_manifest, save_checkpoint
from marge.model.lineage import newest_good_checkpoint
from marge.model.restore import load_model, restore_training
from marge.util.files import sha256_file

REPO = Path(__file__).resolve().parents[2]


def trained(seed: int = 0):
    """The tiny model after one AdamW update."""
    model, optimizer, scheduler = tiny_training(seed)
    optimizer.zero_grad()
    sum((p * p).sum() for p in model.parameters()).backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def rewrite_manifest_digest(directory: Path, name: str) -> None:
    """What anyone who can write the folder can do: make the manifest's sha256 of `name` match the file."""
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["sha256"][name] = sha256_file(directory / name)
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))


class RunsCode:
    """An object whose unpickling runs code: it writes `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('the pickle ran')",)


def test_a_crafted_metadata_file_runs_nothing_and_is_refused_naming_it(tmp_path: Path):
    model, optimizer, scheduler = trained()
    root = tmp_path / "ckpt"
    directory = save_checkpoint(root / "step-00000001", model, optimizer, scheduler, 1,
                                stand_in_tokenizer(tmp_path / "tok"), {"tokens_seen": 1})
    metadata = directory / "state" / ".metadata"
    genuine = metadata.read_bytes()
    marker = tmp_path / "payload-ran"
    metadata.write_bytes(pickle.dumps(RunsCode(marker)))
    rewrite_manifest_digest(directory, "state/.metadata")  # the manifest's sha256 is no defence

    readers = {"load_model": lambda: load_model(directory),
               "restore_training": lambda: restore_training(directory, *tiny_training(seed=5)),
               "the driver's verification": lambda: read_manifest(directory, verify=True, parts=True)}
    for what, read in readers.items():
        with pytest.raises(Exception) as refused:
            read()
        assert not marker.exists(), f"{what}: the pickle in {metadata} ran"
        assert isinstance(refused.value, CheckpointError) and str(metadata) in str(refused.value), \
            f"{what}: {refused.value!r}"
    assert newest_good_checkpoint(root) is None and not marker.exists()

    metadata.write_bytes(genuine)  # the genuine file still loads
    rewrite_manifest_digest(directory, "state/.metadata")
    assert newest_good_checkpoint(root) == directory
    loaded = load_model(directory)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_a_metadata_file_that_points_outside_its_folder_is_refused(tmp_path: Path):
    """Built from DCP's own classes, nothing a restricted unpickler would refuse: a part's path leaves state/."""
    model, optimizer, scheduler = trained()
    directory = save_checkpoint(tmp_path / "step-00000001", model, optimizer, scheduler, 1,
                                stand_in_tokenizer(tmp_path / "tok"), {"tokens_seen": 1})
    metadata = directory / "state" / ".metadata"
    with open(metadata, "rb") as f:
        md = pickle.load(f)  # the test's own genuine file
    shutil.copyfile(directory / "state" / "__0_0.distcp", tmp_path / "elsewhere.distcp")
    for info in md.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    with open(metadata, "wb") as f:
        pickle.dump(md, f)
    rewrite_manifest_digest(directory, "state/.metadata")
    with pytest.raises(CheckpointError, match="elsewhere.distcp") as refused:
        load_model(directory)
    assert str(metadata) in str(refused.value)


# --- trainer generations --------------------------------------------------------------------------------------


def write(root: Path, step: int, generation: int | None, tok: Path) -> Path:
    """A checkpoint of `step` written by `generation` (None: by a marge that recorded none), named as the ranks
    name it (an update written again goes to `step-N-1`)."""
    from marge.model.checkpoint import checkpoint_dir_name

    model, optimizer, scheduler = trained(seed=step)
    name = checkpoint_dir_name(root, step)
    return CheckpointWrite(root / name, model, optimizer, scheduler, step, tok, {"tokens_seen": step},
                           WriteSettings(generation=generation, staging=root / f".{name}.staging")).wait()


def test_a_checkpoint_a_replaced_group_finished_after_its_successor_resumed_older_is_never_chosen(redis_server,
                                                                                                 tmp_path: Path):
    from marge.contracts.protocol import BatchQueue
    from marge.model.lineage import start_generation
    from services.trainer.state import resume

    tok = stand_in_tokenizer(tmp_path / "tok")
    root = tmp_path / "ckpt"

    def group_starts(resumed_from: int) -> int:  # what rank 0 of a starting group does, on its own client
        return start_generation(root, BatchQueue.connect(redis_server.url, "run", Slots(1, 1)).start_generation,
                                resumed_from)

    g1 = group_starts(0)
    write(root, 2, g1, tok)
    write(root, 4, g1, tok)
    g2 = group_starts(2)  # G2 resumes from update 2 (say update 4 was not yet complete when it looked)
    assert g2 > g1
    write(root, 6, g1, tok)  # G1's straggler finishes update 6 after G2 started; G2 dies before writing any
    assert newest_good_checkpoint(root).name == "step-00000002"  # G1's 4 and 6 are past where G2 resumed
    assert resume(*tiny_training(seed=3), "cpu", 0, None, root).step == 2

    g3 = group_starts(2)
    write(root, 4, g3, tok)  # written again, by the surviving lineage
    assert newest_good_checkpoint(root).name == "step-00000004-1"
    assert resume(*tiny_training(seed=3), "cpu", 0, None, root).step == 4

    write(root, 8, None, tok)  # written by a marge that recorded no generation: taken as it is
    assert newest_good_checkpoint(root).name == "step-00000008"


def test_a_generation_number_the_queue_issues_again_is_skipped_past_every_recorded_one(redis_server,
                                                                                       tmp_path: Path):
    """A Redis that lost its data issues generation numbers again: the next group still gets a number above every
    group the lineage recorded, so their checkpoints and their writes to the queue stay fenced."""
    from marge.contracts.protocol import BatchQueue
    from marge.model.lineage import read_lineage, start_generation

    root = tmp_path / "ckpt"
    queue = BatchQueue.connect(redis_server.url, "run", Slots(1, 1))
    first = [start_generation(root, queue.start_generation, 0) for _ in range(3)]
    queue.r.delete(queue.keys.generation)  # the queue's memory of them is gone
    again = start_generation(root, queue.start_generation, 0)
    assert again > max(first)
    assert int(queue.r.get(queue.keys.generation)) == again  # the queue fences the recorded groups too
    assert [g for g, _ in read_lineage(root)] == [*first, again]


CHOOSE = r"""
import json, os, sys, threading
from pathlib import Path
from tiny_training import tiny_training
from marge.model.lineage import newest_good_checkpoint
from services.trainer.state import resume

root, rule = Path(sys.argv[1]), sys.argv[2]
state = tiny_training(seed=1)
unreadable = root / "step-00000004" / "training_state.pt"
os.chmod(unreadable, 0)  # this process may not read it (no CAP_DAC_OVERRIDE) until the timer gives it back
threading.Timer(0.3, os.chmod, (unreadable, 0o644)).start()
if rule == "driver":
    chosen = newest_good_checkpoint(root)
    print(json.dumps({"step": None if chosen is None else json.loads((chosen / "manifest.json").read_text())["step"]}))
else:
    print(json.dumps({"step": resume(*state, "cpu", 0, None, root).step}))
"""


def choose(root: Path, rule: str) -> tuple[int | None, str]:
    """The update `rule` (the driver's or a rank's) resumes from while the newest checkpoint's training_state.pt
    cannot be read for 0.3 s, in a process without the capability that lets root read any file; and its log."""
    without_override = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"] if os.geteuid() == 0 else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*without_override, sys.executable, "-c", CHOOSE, str(root), rule], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["step"], done.stderr


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None,
                    reason="as root, a file is made unreadable only to a process setpriv drops CAP_DAC_OVERRIDE from")
def test_the_driver_and_the_ranks_choose_the_same_checkpoint_when_a_read_fails_once(tmp_path: Path):
    tok = stand_in_tokenizer(tmp_path / "tok")
    root = tmp_path / "ckpt"
    for step in (2, 4):
        model, optimizer, scheduler = trained(seed=step)
        save_checkpoint(root / f"step-{step:08d}", model, optimizer, scheduler, step, tok, {"tokens_seen": step})
    driver, log = choose(root, "driver")
    assert "Permission denied" in log  # the read did fail, once
    assert driver == 4, log[-2000:]
    rank, log = choose(root, "rank")
    assert "Permission denied" in log
    assert rank == driver, log[-2000:]


# --- durability -----------------------------------------------------------------------------------------------


SAVE = r"""
import sys
from pathlib import Path
from tiny_training import stand_in_tokenizer, tiny_training
from marge.contracts.train_log import TrainLog, UpdateRecord
from marge.model.checkpoint import CheckpointWrite, WriteSettings

out = Path(sys.argv[1])
log = TrainLog(out / "train_log.jsonl")
log.append(UpdateRecord(step=1, loss=1.0, lr=1e-3, grad_norm=1.0, batch_ids=["b"]))
log.sync()  # what rank 0 does before it starts the checkpoint of update 1
model, optimizer, scheduler = tiny_training()
CheckpointWrite(out / "ckpt" / "step-00000001", model, optimizer, scheduler, 1, stand_in_tokenizer(out / "tok"),
                {"tokens_seen": 1}, WriteSettings(staging=out / "ckpt" / ".step-00000001.staging")).wait()
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace shows the fsync calls")
def test_what_a_checkpoint_counts_on_is_fsynced_before_its_manifest_commits_it(tmp_path: Path):
    trace = tmp_path / "trace"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["strace", "-f", "-y", "-qq", "-o", str(trace), "-e", "trace=fsync,fdatasync,rename,renameat,renameat2",
                           sys.executable, "-c", SAVE, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = trace.read_text().splitlines()

    def first(call: str, path: str) -> int:
        """The index of the first `call` on a file descriptor of `path` (-1: none)."""
        return next((i for i, line in enumerate(calls) if f"{call}(" in line and f"<{path}>" in line), -1)

    staging = tmp_path / "ckpt" / ".step-00000001.staging"
    commit = next(i for i, line in enumerate(calls) if "rename" in line and "manifest.json" in line)
    for path in [tmp_path / "train_log.jsonl", staging / "training_state.pt", staging / "tokenizer.model",
                 staging / "tokenizer.json", staging / "state", staging]:
        synced = first("fsync", str(path))
        assert 0 <= synced < commit, f"{path} is not fsynced before the manifest is written ({synced}, {commit})"
    assert first("fsync", str(tmp_path / "ckpt")) > commit  # the rename into place is synced too
