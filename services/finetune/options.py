"""What `marge finetune --freeze` means, apart from `run.py` so that building the command line's parser (which
shows FREEZE_HELP) does not import torch."""

from __future__ import annotations

FREEZE_HELP = ("what to keep fixed, comma-separated: `embeddings` (word embeddings, tied to the output), "
               "`decoder-layers=N` (the first N decoder layers), `local-decoder-layers` (the decoder's "
               "self-attention-only layers), `zero-shot` (the paper's transfer recipe: embeddings and the first 4 "
               "decoder layers, i.e. the paper model's 4 self-attention-only ones)")


def parse_freeze(values: list[str] | None) -> tuple[bool, int, bool]:
    """(freeze embeddings, first decoder layers to freeze, freeze the self-attention-only layers) from `--freeze`:
    `FinetuneConfig`'s freeze_embeddings, freeze_decoder_layers and freeze_local_decoder_layers."""
    embeddings, layers, local = False, 0, False
    for item in (x.strip() for v in values or [] for x in v.split(",")):
        if not item:
            continue
        if item == "embeddings":
            embeddings = True
        elif item == "local-decoder-layers":
            local = True
        elif item == "zero-shot":
            embeddings, local = True, True
        elif item.startswith("decoder-layers="):
            try:
                layers = max(layers, int(item.split("=", 1)[1]))
            except ValueError:
                raise ValueError(f"--freeze {item}: N in decoder-layers=N must be an integer") from None
        else:
            raise ValueError(f"--freeze {item!r} is not known; {FREEZE_HELP}")
    return embeddings, layers, local
