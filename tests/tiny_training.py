"""A tiny model with its optimizer and schedule, and a stand-in tokenizer folder: what checkpoint tests save."""

from __future__ import annotations

from pathlib import Path


def tiny_training(seed: int = 0):
    """(model, optimizer, scheduler) of the `tiny` preset at a 64-token vocabulary."""
    import torch

    from marge.model.architecture import preset
    from marge.model.network import Marge

    torch.manual_seed(seed)
    model = Marge(preset("tiny", vocab_size=64, max_positions=32))
    optimizer = torch.optim.AdamW(model.parameters())
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def stand_in_tokenizer(folder: Path) -> Path:
    """A folder with the tokenizer files a checkpoint copies (their content is not read)."""
    folder.mkdir()
    for name in ("tokenizer.model", "tokenizer.json"):
        (folder / name).write_text("x")
    return folder
