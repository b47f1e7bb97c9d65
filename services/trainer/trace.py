"""A record of every collective a trainer rank calls (the `faults.trace_collectives` probe), for CPU tests of what
a GPU run's process group must carry: an NCCL-only group refuses a CPU tensor, so a collective on a tensor that
is not on the model's device is a crash waiting for the first multi-GPU run."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist

TRACED = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
          "reduce_scatter", "gather_object")


def tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def trace_collectives(folder: str | Path, rank: int, model_device: torch.device) -> None:
    """Wrap this process's `torch.distributed` collectives so that each call appends one JSON line to
    `folder/rank-<rank>.jsonl`: {name, tensor_devices, backend, model_device}."""
    path = Path(folder) / f"rank-{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in TRACED:
        original = getattr(dist, name)
        if getattr(original, "__marge_traced__", False):
            continue

        @functools.wraps(original)
        def traced(*args, __original=original, __name=name, **kwargs):
            record = {"name": __name, "tensor_devices": sorted({str(t.device) for a in (*args, *kwargs.values())
                                                                 for t in tensors_in(a)}),
                      "backend": str(dist.get_backend()), "model_device": str(model_device)}
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            return __original(*args, **kwargs)

        setattr(traced, "__marge_traced__", True)  # a mark on a function object, which its type does not declare
        setattr(dist, name, traced)
