"""Sharded checkpoints (format 2): every rank writes a disjoint part, in a thread; every rank reads a 1/world share
and gets the rest from the others, in a world of any size.

Real gloo ranks (torch.distributed, spawned processes) save and restore on disk; each reports what it wrote and
read and a digest of the state it holds."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tiny_training import stand_in_tokenizer, tiny_training  # tests/tiny_training.py

from marge.model.checkpoint import (
    CheckpointWrite,
    WriteSettings,
    read_manifest,
    save_checkpoint,
    save_checkpoint_v1,
    tensor_sha256,
    training_tensors,
)
from marge.model.lineage import newest_good_checkpoint
from marge.model.restore import load_model, restore_training


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trained(seed: int = 0):
    """The tiny model after two AdamW updates (its optimizer holds moments and a step per parameter)."""
    model, optimizer, scheduler = tiny_training(seed)
    for _ in range(2):
        optimizer.zero_grad()
        sum((p * p).sum() for p in model.parameters()).backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def digest(model, optimizer, scheduler) -> dict:
    """The sha256 of every training tensor, the optimizer's param groups and the schedule."""
    tensors = {k: tensor_sha256(t) for k, t in training_tensors(model, optimizer).items()}
    return {"tensors": tensors, "groups": repr(optimizer.state_dict()["param_groups"]),
            "scheduler": repr(scheduler.state_dict())}


def rank_main(rank: int, world: int, port: int, task: str, directory: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        report: dict = {}
        if task == "save":
            model, optimizer, scheduler = trained()
            staging = Path(directory).with_name(f".{Path(directory).name}.staging")
            write = CheckpointWrite(Path(directory), model, optimizer, scheduler, 2, Path(out) / "tok",
                                    {"tokens_seen": 200}, WriteSettings(background=True, staging=staging))
            with torch.no_grad():  # the update after the checkpoint: must not reach what is written
                for p in model.parameters():
                    p.add_(1.0)
            write.wait()
            assert (Path(directory) / "manifest.json").exists() and not staging.exists()  # renamed into place
            report = {"bytes_written": write.bytes_written, "bytes_staged": write.bytes_staged}
        else:  # "restore", or "restore-<batch bytes>"
            model, optimizer, scheduler = tiny_training(seed=10 + rank)  # fresh weights, empty optimizer
            stats: dict = {}
            batch = {"batch_bytes": int(task.split("-")[1])} if "-" in task else {}
            state = restore_training(Path(directory), model, optimizer, scheduler, verify=rank == 0, stats=stats,
                                     **batch)
            report = {"stats": stats, "step": state["step"], "tokens_seen": state["tokens_seen"],
                      "digest": digest(model, optimizer, scheduler)}
        Path(out, f"{task}-{world}-rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def run_world(world: int, task: str, directory: Path, out: Path) -> list[dict]:
    mp.start_processes(rank_main, args=(world, free_port(), task, str(directory), str(out)), nprocs=world, join=True,
                       start_method="spawn")
    return [json.loads((out / f"{task}-{world}-rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    out = tmp_path_factory.mktemp("shards")
    stand_in_tokenizer(out / "tok")
    directory = out / "ckpt" / "step-00000002"
    return directory, out, run_world(2, "save", directory, out)


def test_two_ranks_write_disjoint_parts_of_about_half_each(saved_by_two):
    directory, _, saved = saved_by_two
    manifest = read_manifest(directory, verify=True, parts=True)
    assert manifest["version"] == 2 and manifest["world"] == 2
    assert sorted(manifest["parts"]) == ["state/__0_0.distcp", "state/__1_0.distcp"]
    model, optimizer, _ = trained()
    tensors = training_tensors(model, optimizer)
    assert set(manifest["tensors"]) == set(tensors)  # every tensor once
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    assert sum(r["bytes_staged"] for r in saved) == total
    for r in saved:
        assert r["bytes_staged"] <= total / 2 + largest
    assert sum(r["bytes_written"] for r in saved) == sum(p["bytes"] for p in manifest["parts"].values())


@pytest.mark.parametrize("world", [1, 3])
def test_saved_by_two_restores_identically_in_another_world(saved_by_two, world: int):
    directory, out, _ = saved_by_two
    expected = digest(*trained())  # the state at the checkpoint, not the update after it
    restored = run_world(world, "restore", directory, out)
    for r in restored:
        assert r["step"] == 2 and r["tokens_seen"] == 200
        assert r["digest"] == expected
    # bytes read from storage per rank: a 1/world share of what one process reads, plus the metadata and the
    # largest item (each key is read whole)
    manifest = json.loads((directory / "manifest.json").read_text())
    whole = sum(p["bytes"] for p in manifest["parts"].values())
    metadata = (directory / "state" / ".metadata").stat().st_size
    model, optimizer, _ = trained()
    largest = max(t.numel() * t.element_size() for t in training_tensors(model, optimizer).values())
    for r in restored:
        assert r["stats"]["state_bytes_read"] <= whole / world + metadata + 2 * largest
    assert sum(r["stats"]["state_bytes_read"] for r in restored) <= whole + world * metadata


def test_a_restore_holds_a_batch_on_the_host_not_the_training_state(saved_by_two):
    """Each rank reads and broadcasts its share a batch at a time, straight into the model and optimizer: the host
    bytes it holds at once are its batch and one broadcast buffer, whatever the state's size."""
    directory, out, _ = saved_by_two
    expected = digest(*trained())
    model, optimizer, _ = trained()
    sizes = [t.numel() * t.element_size() for t in training_tensors(model, optimizer).values()]
    batch = 4096
    for r in run_world(2, f"restore-{batch}", directory, out):
        assert r["digest"] == expected
        held = r["stats"]["restore_host_bytes"]
        assert 0 < held <= 2 * max(batch, max(sizes)), held
        assert held < sum(sizes) / 10  # the tiny state is ~50x the batch: a whole copy would fail this
    whole = run_world(2, "restore", directory, out)  # the default batch holds the tiny state at once
    assert all(r["stats"]["restore_host_bytes"] >= sum(sizes) / 2 for r in whole)


def test_single_process_round_trip_with_row_blocks(tmp_path: Path):
    model, optimizer, scheduler = trained()
    tok = stand_in_tokenizer(tmp_path / "tok")
    directory = CheckpointWrite(tmp_path / "step-00000002", model, optimizer, scheduler, 2, tok, {"tokens_seen": 7},
                                WriteSettings(part_bytes=4096)).wait()
    manifest = read_manifest(directory)
    assert any("#" in key for key in manifest["tensors"])  # large tensors were cut into row blocks
    fresh = tiny_training(seed=5)
    assert restore_training(directory, *fresh)["tokens_seen"] == 7
    assert digest(*fresh) == digest(model, optimizer, scheduler)
    loaded = load_model(directory)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_an_incomplete_checkpoint_is_never_chosen(tmp_path: Path):
    model, optimizer, scheduler = trained()
    tok = stand_in_tokenizer(tmp_path / "tok")
    root = tmp_path / "ckpt"
    save_checkpoint(root / "step-00000002", model, optimizer, scheduler, 2, tok, {"tokens_seen": 1})

    def die():
        raise RuntimeError("killed before the manifest")

    with pytest.raises(RuntimeError, match="killed before the manifest"):
        save_checkpoint(root / "step-00000004", model, optimizer, scheduler, 4, tok, {}, before_manifest=die)
    assert (root / "step-00000004" / "state" / "__0_0.distcp").exists()  # every part, no manifest
    assert newest_good_checkpoint(root).name == "step-00000002"
    save_checkpoint(root / "step-00000006", model, optimizer, scheduler, 6, tok, {"tokens_seen": 3})
    assert newest_good_checkpoint(root).name == "step-00000006"
    (root / "step-00000006" / "state" / "__0_0.distcp").unlink()  # a part lost
    assert newest_good_checkpoint(root).name == "step-00000002"
    staging = root / ".step-00000008.staging"
    with pytest.raises(RuntimeError, match="killed before the manifest"):  # written under a staging name
        CheckpointWrite(root / "step-00000008", model, optimizer, scheduler, 8, tok, {},
                        WriteSettings(staging=staging, before_manifest=die)).wait()
    assert (staging / "state" / "__0_0.distcp").exists() and not (root / "step-00000008").exists()
    assert newest_good_checkpoint(root).name == "step-00000002"
    part = root / "step-00000002" / "state" / "__0_0.distcp"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a part corrupt, its size intact
    part.write_bytes(bytes(data))
    assert newest_good_checkpoint(root) is None


def test_format_1_still_loads(tmp_path: Path):
    model, optimizer, scheduler = trained()
    tok = stand_in_tokenizer(tmp_path / "tok")
    directory = save_checkpoint_v1(tmp_path / "step-00000002", model, optimizer, scheduler, 2, tok,
                                   {"tokens_seen": 9})
    assert read_manifest(directory)["version"] == 1
    assert newest_good_checkpoint(tmp_path) == directory
    fresh = tiny_training(seed=5)
    assert restore_training(directory, *fresh)["tokens_seen"] == 9
    assert digest(*fresh) == digest(model, optimizer, scheduler)
    loaded = load_model(directory)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
