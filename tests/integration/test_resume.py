"""Resuming DDP ranks: rank 0 verifies the checkpoint once and the others load its choice without verifying it, from
a checkpoint of either format (1: one process wrote everything; 2: sharded, each rank reads its share).

Two real gloo ranks (torch.distributed, spawned processes) resume from checkpoints on disk; each counts the sha256
verifications it made (`marge.contracts.artifacts.verify_checksums`)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tiny_training import stand_in_tokenizer, tiny_training  # tests/tiny_training.py

from marge.model.checkpoint import checkpoint_dir_name, save_checkpoint, save_checkpoint_v1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resume_rank(rank: int, world: int, port: int, root: str, out: str) -> None:
    import ray.train
    import torch.distributed as dist

    import marge.contracts.artifacts as artifacts
    from services.trainer.state import resume

    verified: list[str] = []
    original = artifacts.verify_checksums

    def counting(directory, *args, **kwargs):
        verified.append(Path(directory).name)
        return original(directory, *args, **kwargs)

    artifacts.verify_checksums = counting
    ray.train.get_checkpoint = lambda: None  # no Ray Train session: storage alone
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, optimizer, scheduler = tiny_training(seed=1)
        resumed = resume(model, optimizer, scheduler, "cpu", rank, None, Path(root))
        weight = float(next(model.parameters()).flatten()[0])
        Path(out, f"rank{rank}.json").write_text(json.dumps({"step": resumed.step, "verified": verified,
                                                             "weight": weight}))
    finally:
        dist.destroy_process_group()


def resume_two_ranks(root: Path, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(resume_rank, args=(2, free_port(), str(root), str(out)), nprocs=2, join=True, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(params=[1, 2], ids=["format1", "format2"])
def checkpoints(tmp_path: Path, request) -> Path:
    save = save_checkpoint_v1 if request.param == 1 else save_checkpoint
    model, optimizer, scheduler = tiny_training()
    tokenizer_dir = stand_in_tokenizer(tmp_path / "tok")
    root = tmp_path / "ckpt"
    for step in (6, 12):
        with torch.no_grad():
            next(model.parameters()).flatten()[0] = float(step)  # which checkpoint a rank loaded
        save(root / checkpoint_dir_name(root, step), model, optimizer, scheduler, step, tokenizer_dir,
             {"tokens_seen": 100 * step})
    return root


def test_rank_zero_alone_verifies_and_every_rank_loads_its_choice(checkpoints: Path, tmp_path: Path):
    rank0, rank1 = resume_two_ranks(checkpoints, tmp_path / "out")
    assert rank0["step"] == rank1["step"] == 12
    assert rank0["weight"] == rank1["weight"] == 12.0
    assert rank0["verified"] == ["step-00000012"]  # once, by rank 0
    assert rank1["verified"] == []


def test_a_corrupt_newest_checkpoint_sends_every_rank_to_the_older_one(checkpoints: Path, tmp_path: Path):
    newest = checkpoints / "step-00000012"
    torn = newest / "model.safetensors" if (newest / "model.safetensors").exists() else newest / "state" / "__0_0.distcp"
    torn.write_bytes(b"torn")
    rank0, rank1 = resume_two_ranks(checkpoints, tmp_path / "out")
    assert rank0["step"] == rank1["step"] == 6
    assert rank0["weight"] == rank1["weight"] == 6.0
    assert rank0["verified"] == ["step-00000012", "step-00000006"]
    assert rank1["verified"] == []
