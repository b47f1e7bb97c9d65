"""The same forward and backward of the `tiny` model on the CPU and on a GPU: loss and gradient norm in fp32 on
each, and in bf16 autocast on the GPU. fp32 on the two devices should agree to float rounding; a larger gap means
the GPU path computes something else.

    python benchmarks/cpu_gpu_parity.py                 # prints one JSON line: {"cpu_fp32": [loss, grad_norm], ...}

Needs torch only (no Ray, FAISS or Redis): run it from a checkout with `PYTHONPATH=shared:.`.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))
from marge.model.architecture import preset  # noqa: E402
from marge.model.network import Marge  # noqa: E402

TARGETS, TARGET_TOKENS, EVIDENCE, EVIDENCE_TOKENS = 6, 24, 8, 32
BOS = 2


def loss_and_grad_norm(model: Marge, inputs: dict[str, torch.Tensor], device: torch.device,
                       bf16: bool = False) -> list[float]:
    model = model.to(device)
    model.zero_grad()
    on = {k: v.to(device) for k, v in inputs.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(on["evidence"], on["target_enc"], on["targets"], on["targets"], on["allowed"])
    out.loss.backward()
    norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return [float(out.loss.detach()), float(norm)]


def main() -> None:
    cfg = preset("tiny")
    torch.manual_seed(0)
    model = Marge(cfg)
    g = torch.Generator().manual_seed(1)
    evidence = torch.randint(5, cfg.vocab_size, (EVIDENCE, EVIDENCE_TOKENS), generator=g)
    evidence[:, 0] = BOS
    targets = torch.randint(5, cfg.vocab_size, (TARGETS, TARGET_TOKENS), generator=g)
    allowed = torch.rand(TARGETS, EVIDENCE, generator=g) > 0.3
    allowed[:, 0] = True  # every target may read some evidence
    inputs = {"evidence": evidence, "targets": targets, "allowed": allowed,
              "target_enc": torch.cat([torch.full((TARGETS, 1), BOS), targets], 1)}
    result = {"torch": torch.__version__, "cpu_fp32": loss_and_grad_norm(copy.deepcopy(model), inputs, torch.device("cpu"))}
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        result["gpu"] = torch.cuda.get_device_name(cuda)
        result["gpu_fp32"] = loss_and_grad_norm(copy.deepcopy(model), inputs, cuda)
        result["gpu_bf16"] = loss_and_grad_norm(copy.deepcopy(model), inputs, cuda, bf16=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
