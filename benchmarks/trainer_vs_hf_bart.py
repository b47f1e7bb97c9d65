"""Our training step vs Hugging Face `BartForConditionalGeneration` at equal shape, in one run.

Both models train on the same synthetic batches with the same optimizer (AdamW, betas 0.9/0.98, eps 1e-6,
weight decay 0.01, clipping at 1.0), interleaved (ours, BART, ours, BART, ...) so that machine noise hits
both alike. Figures are target tokens per second (tokens the decoder predicts) and their ratio.

Shapes (`--shape`):
  reference  d 256, 4 encoder layers (g = all 4), 4 decoder layers with cross-attention and none without,
             4 heads, FFN 1024, vocab 32k, 8 targets x 128 tokens, one evidence document x 128 per target
             (BART's source)
  base       our `base` preset's widths (d 512, 8 heads, 6 encoder layers FFN 2048, g = first 4) with 6 decoder
             layers with cross-attention, FFN 4096, and none without (BART has no self-attention-only
             decoder layers), vocab 32k, 32 targets x 128 + one evidence document x 128 each

Our step does work BART does not: g over every target (a pass of the first `relevance_layers` encoder
layers over the targets) and the relevance bias; `extra_work` in the results counts it in FLOPs.
Each target may only read its own evidence document; our model still attends over the batch's
concatenated evidence and masks the rest (its layout), BART over its own source only.

    python benchmarks/trainer_vs_hf_bart.py --shape reference --out benchmarks/results/trainer_vs_hf_bart-cpu.json
    python benchmarks/trainer_vs_hf_bart.py --shape base --device cuda --bf16   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "shared"), str(REPO)]  # runnable from a checkout without an install (a GPU machine)

from marge.contracts.batch import Batch, SpecialTokens  # noqa: E402
from marge.model.architecture import MargeConfig, preset  # noqa: E402
from marge.model.network import Marge  # noqa: E402
from services.trainer.config import TrainerConfig  # noqa: E402
from services.trainer.objectives import MargeObjectiveConfig, Objectives, ObjectivesConfig  # noqa: E402
from services.trainer.step import build_optimizer, build_scheduler, compiled, forward_backward, optimizer_step  # noqa: E402

SPECIALS = SpecialTokens(pad_id=0, bos_id=1, eos_id=2, lang_ids={"en": 3})
OPTIM = TrainerConfig(lr=1e-4, warmup_steps=0, weight_decay=0.01, clip_norm=1.0)
TOTAL_STEPS = 10**9


@dataclass(frozen=True)
class Shape:
    name: str
    model: MargeConfig
    targets: int
    target_tokens: int  # text tokens per target (the decoder predicts these + EOS)
    evidence_tokens: int  # text tokens per evidence document (the encoder reads BOS + these + EOS)


def shape(name: str) -> Shape:
    if name == "reference":
        cfg = MargeConfig(vocab_size=32000, d_model=256, num_heads=4, encoder_layers=4, encoder_ffn=1024,
                          relevance_layers=4, decoder_local_layers=0, decoder_local_ffn=1024, decoder_layers=4,
                          decoder_ffn=1024, max_positions=256, dropout=0.0)
        return Shape(name, cfg, 8, 127, 126)
    if name == "base":
        cfg = preset("base", decoder_local_layers=0, max_positions=256, dropout=0.0)
        return Shape(name, cfg, 32, 127, 126)
    if name == "paper":
        cfg = preset("paper", max_positions=512, dropout=0.0)
        return Shape(name, cfg, 4, 510, 510)
    raise ValueError(f"unknown shape {name!r}: reference, base or paper")


def synthetic_batch(s: Shape, rng: np.random.Generator, batch_id: str = "bench") -> Batch:
    """Targets 0..N-1 and one evidence document each (N..2N-1); target i is linked to evidence i only."""
    n = s.targets
    tokens = tuple(rng.integers(10, s.model.vocab_size, size=s.target_tokens if i < n else s.evidence_tokens)
                   .astype(np.int32) for i in range(2 * n))
    edges = np.stack([np.arange(n), np.arange(n)], axis=1).astype(np.int32)
    return Batch(batch_id, 0, 0, np.arange(2 * n, dtype=np.int64), ("en",) * (2 * n), tokens,
                 np.arange(n, dtype=np.int32), np.arange(n, 2 * n, dtype=np.int32), edges, np.ones(n, dtype=np.float32))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OurStep:
    """The trainer's step: `forward_backward` + `optimizer_step` (what every DDP rank runs)."""

    name = "ours"

    def __init__(self, s: Shape, device: torch.device, bf16: bool, compile_model: bool = False):
        torch.manual_seed(0)
        self.model = Marge(s.model).to(device).train()
        self.optimizer = build_optimizer(self.model, OPTIM)
        self.scheduler = build_scheduler(self.optimizer, OPTIM, TOTAL_STEPS)
        self.step_model = compiled(self.model, compile_model)  # what `trainer.compile: true` trains through
        self.objectives = Objectives(ObjectivesConfig(marge=MargeObjectiveConfig(attend_to="linked")), SPECIALS)
        self.device, self.bf16 = device, bf16
        self.autocast = bf16  # off when the model's own parameters are bf16 (`bf16_parameters`)
        self.parameters = sum(p.numel() for p in self.model.parameters())

    def __call__(self, batch: Batch) -> tuple[float, int]:
        prepared = self.objectives.prepare(batch, (0,))
        loss, tokens, _ = forward_backward(self.step_model, self.objectives, prepared, 1.0, self.device, self.autocast)
        optimizer_step(self.model, self.optimizer, self.scheduler, OPTIM.clip_norm)
        return float(loss), int(tokens)


class BartStep:
    """`BartForConditionalGeneration` at the same shape: source = the evidence, target = the target."""

    name = "hf_bart"

    def __init__(self, s: Shape, device: torch.device, bf16: bool):
        from transformers import BartConfig, BartForConditionalGeneration

        c = s.model
        config = BartConfig(vocab_size=c.vocab_size, d_model=c.d_model, encoder_layers=c.encoder_layers,
                            decoder_layers=c.decoder_layers + c.decoder_local_layers,
                            encoder_attention_heads=c.num_heads, decoder_attention_heads=c.num_heads,
                            encoder_ffn_dim=c.encoder_ffn, decoder_ffn_dim=c.decoder_ffn,
                            max_position_embeddings=c.max_positions, dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0, activation_function="gelu", pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, decoder_start_token_id=3, forced_eos_token_id=None)
        torch.manual_seed(0)
        self.model = BartForConditionalGeneration(config).to(device).train()
        self.optimizer = build_optimizer(self.model, OPTIM)  # same groups rule: no decay on norms/biases/embeddings
        self.scheduler = build_scheduler(self.optimizer, OPTIM, TOTAL_STEPS)
        self.device, self.bf16 = device, bf16
        self.parameters = sum(p.numel() for p in self.model.parameters())

    def __call__(self, batch: Batch) -> tuple[float, int]:
        from services.trainer.inputs import to_model_inputs

        inputs = to_model_inputs(batch, SPECIALS, "linked").to(self.device)
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = self.model(input_ids=inputs.evidence_MS, attention_mask=inputs.evidence_MS != 0,
                             decoder_input_ids=inputs.decoder_in_NT,
                             labels=inputs.labels_NT.masked_fill(inputs.labels_NT == 0, -100))
        out.loss.backward()
        optimizer_step(self.model, self.optimizer, self.scheduler, OPTIM.clip_norm)
        return float(out.loss.detach()), int((inputs.labels_NT != 0).sum())


def time_steps(step, batches: list[Batch], device: torch.device) -> float:
    """Target tokens per second over `batches` (the caller warms up first)."""
    sync(device)
    t0 = time.perf_counter()
    tokens = 0
    for batch in batches:
        tokens += step(batch)[1]
    sync(device)
    return tokens / (time.perf_counter() - t0)


def extra_work_flops(s: Shape) -> dict:
    """FLOPs per target token of the work our step does and BART's does not: g over the target."""
    c = s.model
    layer = 4 * c.d_model ** 2 + 2 * c.d_model * c.encoder_ffn
    relevance = 6.0 * c.relevance_layers * layer * (s.target_tokens + 2) / (s.target_tokens + 1)
    encoder = 6.0 * c.encoder_layers * layer * (s.evidence_tokens + 2) / (s.target_tokens + 1)
    return {"g_over_targets_flops_per_target_token": relevance, "evidence_encoder_flops_per_target_token": encoder,
            "g_share_of_encoder_work": relevance / (relevance + encoder)}


def compare(s: Shape, device: torch.device, bf16: bool, rounds: int, steps: int, warmup: int) -> dict:
    rng = np.random.default_rng(0)
    batches = [synthetic_batch(s, rng, f"b{i}") for i in range(steps)]
    runners = [OurStep(s, device, bf16), BartStep(s, device, bf16)]
    for runner in runners:
        for batch in batches[:warmup]:
            runner(batch)
    rates: dict[str, list[float]] = {r.name: [] for r in runners}
    for _ in range(rounds):  # interleaved: ours, BART, ours, BART, ...
        for runner in runners:
            rates[runner.name].append(time_steps(runner, batches, device))
    ours, bart = statistics.median(rates["ours"]), statistics.median(rates["hf_bart"])
    return {"shape": s.name, "device": describe(device), "bf16": bf16, "rounds": rounds, "steps_per_round": steps,
            "parameters": {r.name: r.parameters for r in runners},
            "target_tokens_per_s": {"ours": ours, "hf_bart": bart}, "all_rounds": rates,
            "ratio_ours_over_hf_bart": ours / bart, "extra_work": extra_work_flops(s)}


def profile_table(s: Shape, device: torch.device, bf16: bool, steps: int = 3, rows: int = 15) -> str:
    """Where one of our steps spends its time: torch.profiler's top ops by self time, as a Markdown table."""
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(1)
    runner = OurStep(s, device, bf16)
    batches = [synthetic_batch(s, rng, f"p{i}") for i in range(steps + 1)]
    runner(batches[0])  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for batch in batches[1:]:
            runner(batch)
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events)
    lines = ["| op | calls | self time per step (ms) | share |", "|---|---|---|---|"]
    for e in events[:rows]:
        lines.append(f"| `{e.key}` | {e.count // steps} | {getattr(e, key) / 1000 / steps:.1f} | "
                     f"{100 * getattr(e, key) / total:.1f}% |")
    return "\n".join(lines)


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="reference", choices=["reference", "base"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast for both (fp32 master weights)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", type=Path, default=None, help="also write a profile of our step (Markdown) here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.profile:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        table = profile_table(shape(args.shape), device, args.bf16)
        args.profile.write_text(f"Our training step at `{args.shape}` shape on {describe(device)} "
                                f"(`python {' '.join(sys.argv)}`), 3 steps:\n\n{table}\n", encoding="utf-8")
        print(table)
    result = compare(shape(args.shape), device, args.bf16, args.rounds, args.steps, args.warmup)
    result["command"] = "python " + " ".join(sys.argv)
    result["versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")
    print(f"{args.shape} on {result['device']}: ours {result['target_tokens_per_s']['ours']:.0f} target tok/s, "
          f"HF BART {result['target_tokens_per_s']['hf_bart']:.0f}: ratio {result['ratio_ours_over_hf_bart']:.2f}")
    print(text)


if __name__ == "__main__":
    main()
