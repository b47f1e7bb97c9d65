"""The trainer stage's settings: the `trainer:` and `health:` sections of a run's config (the objectives'
settings live with the objectives, `services.trainer.objectives`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from marge.contracts.config import FieldError, at_least, non_negative_mapping, one_of, positive, resumable, within
from marge.model.layers import KEY_BIAS_PATHS
from marge.model.optim import OptimizerConfig

COMPILE_SCOPES = ("layers", "model")
"""What `trainer.compile` compiles (`services.trainer.step.compiled`)."""
CROSS_ATTENTION = ("gathered", "packed")
"""How the training cross-attention reads the evidence (`trainer.cross_attention`)."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig(OptimizerConfig):
    EXECUTION: ClassVar[tuple[str, ...]] = (
        "bf16", "bf16_params", "prefetch", "loss_chunk_tokens", "unpadded", "key_bias", "bucket_rows", "bucket_width",
        "cudnn_attention", "cross_attention", "compile", "compile_dynamic", "compile_scope")
    """The settings that change how the trainers compute, not what they train (none changes a loss beyond
    rounding): the `execution` block of a run's spec.json (`services.driver.spec`)."""

    num_workers: int = 2
    """DDP ranks (Ray Train workers); each takes `grad_accum` batches per update."""
    use_gpu: bool = False
    """One GPU per DDP rank (NCCL for its tensors); the run is refused where the cluster has too few."""
    warmup_steps: int = 100
    """Linear warm-up steps (paper: 10k)."""
    total_steps: int | None = None
    """The rate anneals linearly to 0 at this step (paper: linear annealing to 0; default: run.max_steps)."""
    grad_accum: int = 1
    """Batches each rank accumulates per update (DDP all-reduces once, after the last)."""
    bf16: bool = False
    """Compute in bf16: autocast over fp32 parameters, or, with `bf16_params`, bf16 parameters and no autocast."""
    bf16_params: bool = False
    """With `bf16`: the model's parameters are bf16 and the optimizer steps fp32 masters of them
    (`services.trainer.precision`): no cast of a weight, its gradient or an activation in the forward or the
    backward, two multi-tensor copies an update; fp32 moments, gradient norm, clipping, all-reduce, loss and
    checkpoints. The micro-batches' gradients add up in bf16 before the update. Off: autocast's casts
    (docs/gpu.md has the counts)."""
    prefetch: bool = resumable(True)
    """Each rank reads and prepares the next update's batches (augmentation, tensors; pinned on a GPU) in a thread
    while the device trains on this one, as the single process does. Reading a slot is not consuming it (batches
    count when a checkpoint commits them), and a stop still takes effect at the next update."""
    loss_chunk_tokens: int = resumable(0)
    """Target tokens whose output logits the training loss computes at a time (0: all at once). The loss and its
    gradients are made chunk by chunk in one pass (`marge.model.losses.fused_linear_nll`: 3 matmuls a chunk, as the
    unchunked loss), so memory holds one chunk x vocabulary of logits, not every target token's: for the 250k
    vocabulary of `paper` the logits are the largest tensor of a step. The loss and gradients are those of the
    unchunked loss (tests/unit/test_model.py). An execution setting."""
    unpadded: bool = resumable(False)
    """MARGE batches (and the denoising loss's views) run on their real tokens only: every projection, feed-forward
    layer and norm skips the padding, the attention alone lays the tokens out in rows, and each target reads only
    its evidence's real keys (`marge.model.layers.UnpaddedLayout`). False: every row padded to its batch's longest
    document, as before. The loss and gradients are those of the padded batch (tests/unit/test_unpadded.py); the FLOPs
    executed fall to near those credited (benchmarks/recipe_efficiency.py). An execution setting."""
    key_bias: str = resumable("folded")
    """How attention adds beta * f (and the encoder's padding), a bias of the key alone: `folded` into an extra
    head dimension (heads 64 -> 72 wide, no mask: flash kernels), `mask` (SDPA's additive mask: on a GPU the
    memory-efficient kernel, heads 64 wide) or `flex` (FlexAttention's score_mod, heads 64 wide: fused under
    `trainer.compile`; needs model.attention_dropout 0 and, to train, a GPU). `mask` gives folded's values and
    gradients, `flex` its values (tests/unit/test_gpu_readiness.py, tests/unit/test_unpadded.py) and, on one H200, its
    gradients (benchmarks/gpu_speed.py's `checks`). `folded` is the default: the fastest eager path measured for the
    recipe's update (docs/gpu.md). An execution setting."""
    bucket_rows: int = resumable(0)
    """With `unpadded`, the rows of every attention block (documents, targets) are rounded up to a multiple of this
    (empty rows, every key masked, their outputs dropped), so that attention sees a bounded set of shapes: what a
    kernel that builds a plan per exact shape (cuDNN's: `cudnn_attention`) or a static compile (`compile_dynamic`
    false) needs. 0: exact, which measured faster without cuDNN's SDPA (docs/gpu.md). An execution setting."""
    bucket_width: int = resumable(0)
    """With `unpadded`, the width of every attention block (positions, and the key slots each target reads) is
    rounded up to a multiple of this (masked keys, dropped queries). 0: exact. An execution setting."""
    cudnn_attention: bool = resumable(False)
    """Let PyTorch's attention use cuDNN's fused kernel (`torch.backends.cuda.enable_cudnn_sdp`). Off: it builds an
    execution plan for every exact shape it meets, and training meets new shapes every update, which made the
    recipe's update several times slower on batches never seen before (flash and memory-efficient kernels build
    nothing per shape; measured in docs/gpu.md). An execution setting; it applies to the whole process."""
    cross_attention: str = resumable("gathered")
    """How the training cross-attention reads the evidence (with `unpadded`): `gathered` (each target's keys
    gathered into slots as wide as the most any target reads, beta * f folded into the heads or as `key_bias`
    says) or `packed` (every target's tokens against the whole packed memory in one FlexAttention call, key tiles a
    target's tile does not read skipped, beta * f in its score_mod: no padded slot, no per-target copy, heads 64
    wide; compiled on a GPU; no attention dropout; FlexAttention has no CPU backward, so it trains only on a GPU).
    Both give the same loss and gradients (tests/unit/test_attention_layout.py on values; the gradients where a
    GPU is). An execution setting."""
    compile: bool = resumable(False)
    """Train through `torch.compile` (dynamic shapes unless `compile_dynamic` is off: a few graphs for every batch
    size, none broken by a device read; compiled kernels cached under run.dir/compile-cache): each layer and the
    loss head (`compile_scope`). Off by default: at `base` it changes the recipe's update little for a cold compile
    of tens of seconds, and on a CPU the first updates pay the compilation (measured figures: docs/gpu.md)."""
    compile_dynamic: bool = resumable(True)
    """`trainer.compile` with dynamic shapes (a few graphs for every batch size) or static ones (a graph per shape:
    what CUDA graphs need; only sensible where the shapes are bounded: `bucket_rows`, `bucket_width`). An execution
    setting."""
    compile_scope: str = resumable("layers")
    """What `trainer.compile` compiles: `layers` (each encoder and decoder layer on its own, fullgraph; layers of
    one kind share their graphs: the cold compile is one layer of each kind) or `model` (the whole model under
    DDP: DDP's buckets split its graph). An execution setting."""
    snapshot_every: int = 10000
    """Rank 0 publishes g (and measures retrieval health) every this many updates."""
    checkpoint_every: int = 1000
    """Updates between checkpoints; a batch counts as trained once the checkpoint covering it is durable."""
    keep_checkpoints: int = resumable(2)
    """Checkpoints kept on disk (the newest always)."""
    num_cpus_per_worker: float = resumable(1.0)
    """Logical CPUs Ray gives each DDP rank."""
    resources: dict[str, float] = resumable(default_factory=dict)
    """Custom Ray resources per worker, e.g. {marge_trainer: 1}."""
    torch_threads: int = resumable(1)
    """torch's intra-op threads per rank (Ray actors get one unless told)."""
    max_failures: int = resumable(3)
    """Times Ray Train restarts the trainer group from its newest checkpoint after a worker dies (-1: always)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "num_workers", "grad_accum", "snapshot_every", "checkpoint_every", "keep_checkpoints",
                 "num_cpus_per_worker", "torch_threads")
        at_least(self, "warmup_steps", 0)
        at_least(self, "loss_chunk_tokens", 0)
        at_least(self, "bucket_rows", 0)
        at_least(self, "bucket_width", 0)
        if self.total_steps is not None:
            positive(self, "total_steps")
        at_least(self, "max_failures", -1)
        non_negative_mapping(self, "resources")
        one_of(self, "key_bias", KEY_BIAS_PATHS)
        one_of(self, "compile_scope", COMPILE_SCOPES)
        one_of(self, "cross_attention", CROSS_ATTENTION)
        if self.bf16_params and not self.bf16:
            raise FieldError("bf16_params", self.bf16_params, "bf16 parameters compute in bf16: set trainer.bf16=true "
                             "too (or bf16_params=false)")
        if self.cross_attention == "packed" and not self.unpadded:
            raise FieldError("cross_attention", self.cross_attention, "packed reads the real tokens only: set "
                             "trainer.unpadded=true too (or cross_attention=gathered)")

    @property
    def autocast(self) -> bool:
        """Whether the forward runs under bf16 autocast: bf16 over fp32 parameters (`bf16_params` computes in its
        parameters' own dtype)."""
        return self.bf16 and not self.bf16_params

    def schedule_steps(self, max_steps: int) -> int:
        """The update at which the learning rate reaches 0."""
        return self.total_steps or max_steps


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """Retrieval-health probes, measured by trainer rank 0 at every snapshot (see services.trainer.health)."""

    documents: str | None = None
    """Held-out pages (documents JSONL with `group`) for the evidence-gain probes (null: the corpus's own held-out
    split when it has one, else no probe)."""
    probe_size: int = 32
    """Held-out pages of the page probe (a page's start, with the same page's start in other languages)."""
    aligned_probe_size: int = 0
    """Held-out paragraphs of the aligned probe, each with its aligned translations (needs `documents` with
    paragraph ids; 0: off). Reports evidence gain per token and per character with bootstrap intervals."""
    aligned_min_tokens: int = 4
    """Shortest aligned-probe target, in text tokens."""
    max_evidence: int = 3
    """Translations per probe target (of a page, or of a paragraph), at most."""
    max_tokens: int = 128
    """Probe documents are cut to this many positions."""
    pairs: str | None = None
    """Held-out pairs TSV for retrieval P@1 at every snapshot (null: data.heldout_pairs)."""
    pairs_per_language: int = 200
    """Pairs per language pair used for the per-snapshot P@1 (0: skip it)."""
    external_probes: bool = False
    """Allow probe files (documents, pairs, data.heldout_pairs) from outside the corpus: a public test set, say.
    Otherwise a probe file must be the corpus's own held-out split or lie beside the inputs it was prepared from,
    so that g is never judged on another corpus's text by accident."""
    eval_layer: int | str | None = None
    """Encoder layer mean-pooled for P@1 (null: the paper's 5, or the deepest the model has), or 'g': the relevance
    vectors exactly as the index searches them."""

    def __post_init__(self) -> None:
        positive(self, "probe_size", "max_evidence", "aligned_min_tokens")
        at_least(self, "aligned_probe_size", 0)
        at_least(self, "max_tokens", 3)
        at_least(self, "pairs_per_language", 0)
        if isinstance(self.eval_layer, str):
            one_of(self, "eval_layer", ("g",))
        elif self.eval_layer is not None:
            within(self, "eval_layer", 0, 1000)
