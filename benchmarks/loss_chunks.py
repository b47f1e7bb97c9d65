"""The training loss over a large vocabulary, whole vs in chunks: peak memory and time.

Three ways in the same run: the whole loss (every target token's logits at once), checkpointed chunks (each
chunk's logits computed again in the backward: 4 matmuls a chunk) and the fused loss the model trains with when
`trainer.loss_chunk_tokens` is set (`marge.model.losses.fused_linear_nll`: the gradients made in the forward pass, 3
matmuls a chunk).

One step of the loss's own work: the tied output projection of T target states (d wide) onto V rows, the
fp32 cross-entropy, and its backward into the states and the embedding. Each figure is taken in a fresh
process, so that peak memory is its own: peak RSS over the process's size before the step on CPU, and
`torch.cuda.max_memory_allocated` over the tensors allocated before it on CUDA. Unchunked and chunked
run the same inputs in the same run, and their losses and gradients are compared.

    python benchmarks/loss_chunks.py --chunks 0 512 -512 --out benchmarks/results/loss-chunks-cpu-2core.json
    (a chunk of -N: the fused loss in chunks of N)
    python benchmarks/loss_chunks.py --device cuda --bf16 --tokens 8192 --d-model 1024   # paper widths on a GPU
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO)]


def measure(tokens: int, d_model: int, vocab: int, chunk: int, device: str, bf16: bool) -> dict:
    """One loss step in this process; returns seconds, peak memory (MB) and checksums of the results."""
    import torch

    from marge.model.losses import chunked_token_nll, fused_linear_nll, projected_token_nll

    torch.manual_seed(0)
    dev = torch.device(device)
    states = (torch.randn(tokens, d_model, device=dev) * 0.5).requires_grad_()
    weight = (torch.randn(vocab, d_model, device=dev) * 0.02).requires_grad_()
    labels = torch.randint(4, vocab, (tokens,), device=dev)
    labels[-tokens // 8:] = 0  # padding, as targets of unequal length have
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        if chunk < 0:
            total = fused_linear_nll(states, weight, labels, 0, -chunk)[0]
        else:
            total = (chunked_token_nll(states, weight, labels, 0, chunk) if chunk
                     else projected_token_nll(states, weight, labels, 0)).sum()
        loss = total / (labels != 0).sum()
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"chunk": chunk, "method": "fused" if chunk < 0 else "checkpointed" if chunk else "whole", "seconds": time.perf_counter() - t0, "peak_mb": peak / 2**20, "loss": loss.item(),
            "states_grad_sum": states.grad.double().abs().sum().item(),
            "weight_grad_sum": weight.grad.double().abs().sum().item()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="target tokens in the step")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--vocab", type=int, default=250_000, help="the `paper` preset's vocabulary")
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 512], help="chunk sizes: 0 the whole loss, N checkpointed chunks of N, -N fused chunks of N")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.tokens, args.d_model, args.vocab, args.one, args.device, args.bf16)))
        return 0
    runs = []
    for chunk in args.chunks:
        command = [sys.executable, __file__, "--tokens", str(args.tokens), "--d-model", str(args.d_model), "--vocab",
                   str(args.vocab), "--device", args.device, "--one", str(chunk)] + (["--bf16"] if args.bf16 else [])
        runs.append(json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
        print(runs[-1], flush=True)
    base = runs[0]
    result = {"command": "python benchmarks/loss_chunks.py " + " ".join(sys.argv[1:]), "device": args.device,
              "bf16": args.bf16, "tokens": args.tokens, "d_model": args.d_model, "vocab": args.vocab, "runs": runs,
              "relative_to_first": [{"chunk": r["chunk"], "memory": r["peak_mb"] / base["peak_mb"],
                                     "time": r["seconds"] / base["seconds"],
                                     "loss_difference": abs(r["loss"] - base["loss"]),
                                     "weight_grad_relative_difference":
                                         abs(r["weight_grad_sum"] - base["weight_grad_sum"]) / base["weight_grad_sum"]}
                                    for r in runs[1:]]}
    print(json.dumps(result["relative_to_first"], indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
