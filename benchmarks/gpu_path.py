"""The GPU path, measured in one process (the GPU machine has no Ray, FAISS or Redis): each figure next to
its alternative in the same run.

  1. training step at `base` shape (see trainer_vs_hf_bart.py): target tokens/s and MFU for fp32, bf16
     autocast (fp32 master weights, fused AdamW on CUDA) and bf16 + torch.compile; HF BART at equal shape
     in bf16 next to ours;
  2. the indexer's embedding (length-sorted batches of g, `embed_documents`) on the GPU in bf16 vs on all
     of this machine's CPU cores in fp32, over the same documents (the prepared corpus when present);
  3. one `paper`-preset (966M) training step on this device: fits or not, seconds, peak memory, MFU.

MFU = model FLOPs per target token (`training_flops_per_token`: 6 x the parameters each token passes
through, attention scores excluded) x target tokens/s / the device's dense bf16 peak.

    python benchmarks/gpu_path.py --out benchmarks/results/gpu-h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_vs_hf_bart import OurStep, compare, describe, shape, sync, synthetic_batch, time_steps  # noqa: E402

from marge.model.architecture import preset  # noqa: E402
from marge.model.network import RelevanceEncoder  # noqa: E402
from marge.model.sizes import training_flops_per_token  # noqa: E402
from services.trainer.step import device_peak_flops as peak  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def mfu(s, target_tokens_per_s: float, device: torch.device) -> float | None:
    p = peak(device)
    flops = training_flops_per_token(s.model, (s.evidence_tokens + 2) / (s.target_tokens + 1))
    return flops * target_tokens_per_s / p if p else None


def step_variants(device: torch.device, steps: int, targets: int, out: list[dict], save) -> None:
    """Appends each variant's figures to `out` and saves them as it goes (a time limit keeps the finished ones)."""
    s = shape("base")
    s = type(s)(s.name, s.model, targets, s.target_tokens, s.evidence_tokens)
    rng = np.random.default_rng(0)
    batches = [synthetic_batch(s, rng, f"b{i}") for i in range(steps)]
    for name, bf16, compiled in (("fp32", False, False), ("bf16", True, False), ("bf16+compile", True, True)):
        try:
            runner = OurStep(s, device, bf16, compile_model=compiled)
            for batch in batches[:3]:
                runner(batch)
            rate = max(time_steps(runner, batches, device) for _ in range(2))
            out.append({"variant": name, "targets_per_batch": targets, "target_tokens_per_s": rate,
                        "mfu": mfu(s, rate, device), "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30
                        if device.type == "cuda" else None})
            print(json.dumps(out[-1]), flush=True)
            save()
            del runner
        except Exception as e:  # noqa: BLE001 - a failed variant is a result, the others still run
            out.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


def corpus_documents(limit: int) -> tuple[list[np.ndarray], str]:
    for name in ("libreoffice-help-128", "demo-paragraphs", "demo-128", "demo"):
        root = REPO / "data" / "prepared" / name
        if (root / "manifest.json").exists():
            from marge.contracts.corpus import Corpus

            corpus = Corpus.open(root, verify_checksums=False)
            docs = [t for s in range(corpus.num_shards) for t in corpus.read_shard(s).tokens][:limit]
            return docs, str(root.relative_to(REPO))
    rng = np.random.default_rng(0)
    return [rng.integers(10, 32000, size=int(n)).astype(np.int32) for n in rng.integers(20, 127, size=limit)], "synthetic"


def indexer_embedding(device: torch.device, documents: int) -> dict:
    from trainer_vs_hf_bart import SPECIALS

    from marge.model.network import Marge
    from services.indexer.core import embed_documents

    docs, source = corpus_documents(documents)
    cfg = preset("base", max_positions=512, vocab_size=32000)
    torch.manual_seed(0)
    encoder = RelevanceEncoder.from_model(Marge(cfg))
    result = {"documents": len(docs), "source": source, "relevance_layers": cfg.relevance_layers,
              "cpu_threads": torch.get_num_threads()}
    for where, dev, dtype in (("gpu_bf16", device, torch.bfloat16), ("cpu_fp32", torch.device("cpu"), None)):
        enc = encoder.to(dev).eval()
        subset = docs if where == "gpu_bf16" else docs[: max(512, len(docs) // 8)]  # the CPU is slow: fewer docs
        embed_documents(enc, subset[:256], SPECIALS, 65536, str(dev), dtype)  # warm-up
        sync(dev)
        t0 = time.perf_counter()
        embed_documents(enc, subset, SPECIALS, 65536, str(dev), dtype)
        sync(dev)
        result[f"{where}_docs_per_s"] = len(subset) / (time.perf_counter() - t0)
    result["ratio_gpu_over_cpu"] = result["gpu_bf16_docs_per_s"] / result["cpu_fp32_docs_per_s"]
    print(json.dumps(result), flush=True)
    return result


def paper_step(device: torch.device, steps: int) -> dict:
    s = shape("paper")
    try:
        runner = OurStep(s, device, bf16=True)
        rng = np.random.default_rng(0)
        batches = [synthetic_batch(s, rng, f"p{i}") for i in range(steps)]
        runner(batches[0])
        rate = time_steps(runner, batches, device)
        result = {"parameters": runner.parameters, "targets": s.targets, "target_tokens": s.target_tokens + 1,
                  "evidence_tokens": s.evidence_tokens + 2, "fits": True, "target_tokens_per_s": rate,
                  "seconds_per_step": s.targets * (s.target_tokens + 1) / rate, "mfu": mfu(s, rate, device),
                  "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    except torch.OutOfMemoryError as e:
        result = {"fits": False, "error": str(e)[:300]}
    except Exception as e:  # noqa: BLE001 - reported, the other parts' figures stand
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--targets", type=int, nargs="+", default=[32, 64], help="targets per batch at base shape")
    parser.add_argument("--documents", type=int, default=50000, help="documents for the embedding figure")
    parser.add_argument("--skip", nargs="*", default=[], choices=["variants", "bart", "indexer", "paper"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    results: dict = {"device": describe(device), "torch": torch.__version__, "peak_bf16_flops": peak(device),
                     "command": "python " + " ".join(sys.argv)}

    def save() -> None:  # after every part: a later part that dies (or a time limit) keeps the earlier figures
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")

    if "variants" not in args.skip:
        results["base_step"] = []
        for t in args.targets:
            step_variants(device, args.steps, t, results["base_step"], save)
    if "bart" not in args.skip:
        try:
            results["vs_hf_bart_base_bf16"] = compare(shape("base"), device, True, rounds=3, steps=args.steps, warmup=3)
            print(json.dumps({k: results["vs_hf_bart_base_bf16"][k] for k in ("target_tokens_per_s", "ratio_ours_over_hf_bart")}))
        except ImportError as e:
            results["vs_hf_bart_base_bf16"] = {"error": f"transformers not importable: {e}"}
        save()
    if "indexer" not in args.skip:
        results["indexer_embedding"] = indexer_embedding(device, args.documents)
        save()
    if "paper" not in args.skip:
        results["paper_step"] = paper_step(device, max(3, args.steps // 4))
        save()


if __name__ == "__main__":
    main()
