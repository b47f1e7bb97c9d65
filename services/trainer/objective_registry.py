"""The objective protocol and its registry: what an objective is to the trainer, and how a new one joins a run.

An objective is one class (the `Objective` protocol: `prepare` a batch on the host, `loss` on the model, `work` for
the MFU count) and one `register(Registration(...))` naming it, its settings dataclass, its random stream and how it
is built from a run's `ObjectiveContext`. The trainer's `Objectives` builds every configured one from here; the
`objectives:` section takes a registered objective's settings under its name, those outside this package under
`objectives.registered`, with the module that registers them in `objectives.imports`
(services/trainer/objectives.py). The built-in objectives register themselves there too.

    @dataclass(frozen=True, kw_only=True)
    class LengthConfig:
        weight: float = 1.0

    class LengthObjective:               # prepare, loss and work, as `Objective` says
        name = "length"
        ...

    register(Registration("length", LengthConfig, rng_stream=10, role="auxiliary",
                          build=lambda cfg, ctx: LengthObjective(cfg, ctx.specials)))

(tests/spread_objective.py is such an objective; tests/unit/test_objective_registry.py trains it beside marge.)"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
from torch import Tensor, nn

from marge.contracts.batch import Batch, SpecialTokens

ROLES = ("main", "auxiliary", "augmentation", "companion")
"""main: can make up a run alone (marge, bart, veco; the first configured is the run's logged `loss`);
auxiliary: a loss of its own beside marge (a plug-in with `prepare` and `loss`); augmentation: changes marge's batch
before any objective prepares it (self_evidence, through `augment`), no loss; companion: a loss made from marge's
own forward (relevance_distillation), built by marge, not a plug-in."""
PASSES = ("target", "evidence", "relevance")
"""The kinds of pass an objective's tokens make (`Objective.work`): `target` decoded, `evidence` through the whole
encoder, `relevance` through g alone: what MFU credits (`marge.model.sizes.training_flops`)."""


@dataclass
class ObjectiveLoss:
    """What an objective's `loss` returns."""

    loss: Tensor
    """Its loss (unweighted; `Objectives` applies the configured weight)."""
    predicted: Tensor
    """Tokens it reconstructs or predicts (0-d): the run's `target_tokens` when it is the primary objective."""
    companions: dict[str, Tensor] = field(default_factory=dict)
    """Losses made from the same forward (companion objectives by name), unweighted."""
    relevance_NM: Tensor | None = None
    """f of the forward, with its graph, where the objective computes one (marge)."""


class Objective(Protocol):
    """An objective as the trainer runs it. `prepare` runs on the host with no model (a prefetch thread may call it),
    with its own stream's generator (None when it is registered as drawing nothing); its result (or None: nothing to
    train on in this batch) must have `to(device)` and `pin_memory()`."""

    name: str

    def prepare(self, batch: Batch, rng: np.random.Generator | None, step: int) -> Any | None: ...

    def loss(self, model: nn.Module, inputs: Any) -> ObjectiveLoss: ...

    def work(self, inputs: Any, pad_id: int) -> dict[str, int]: ...


@dataclass(frozen=True)
class ObjectiveContext:
    """What a run gives its objectives to be built with."""

    specials: SpecialTokens
    sentence_ends: np.ndarray | None = None  # the tokenizer's sentence-ending ids (noising, halves)
    vocab_size: int | None = None
    unpadded: bool = False  # `trainer.unpadded`: inputs laid out on their real tokens
    attention: Any = None  # `services.trainer.inputs.AttentionLayout` of the run (`Objectives` passes it)
    settings: Any = None  # the run's whole `ObjectivesConfig`, for objectives that read a companion's settings


@dataclass(frozen=True)
class Registration:
    """How a run knows an objective."""

    name: str
    """Its key in the `objectives:` section and in the train log's losses."""
    config: type
    """Its settings: a dataclass, with a `weight` when it has a loss (main, auxiliary, companion), which scales it."""
    rng_stream: int | None
    """Its own stream of each batch's seed key (a generator seeded with the key plus this number), distinct from every
    other's: adding an objective leaves the others' random draws (and so earlier runs' figures) unchanged. None: it
    draws nothing and gets no generator (marge, the companions). Stream 0 is the seed key itself (numpy pads a
    seed with zeros), which self_evidence drew from before objectives had streams."""
    role: str
    """One of `ROLES`."""
    build: Callable[[Any, ObjectiveContext], Any] | None = None
    """Makes the plug-in from its settings and the run's context (None: a companion, built by the objective it
    accompanies)."""
    needs_marge: bool = True
    """Whether it may only run beside the marge objective (every non-main objective so far)."""
    negatives: Callable[[Any], int] = field(default=lambda cfg: 0)
    """How many unlinked documents of its shard, with these settings, it needs in each batch besides the targets
    and evidence (the batcher adds them: `services.batcher.config.BatchShape.negatives`); no objective reads the
    corpus itself."""

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.config):
            raise ValueError(f"objective {self.name!r}: its settings class {self.config.__name__} must be a dataclass")
        if self.role != "augmentation" and "weight" not in {f.name for f in dataclasses.fields(self.config)}:
            raise ValueError(f"objective {self.name!r}: the settings of {self.role} objectives need a `weight` field")
        if self.role not in ROLES:
            raise ValueError(f"objective {self.name!r}: role {self.role!r} is not one of {ROLES}")
        if (self.build is None) != (self.role == "companion"):
            raise ValueError(f"objective {self.name!r}: " + ("companion objectives are built by the objective they "
                                                            "accompany: build=None" if self.role == "companion"
                                                            else f"{self.role} objectives need a build function"))


REGISTRY: dict[str, Registration] = {}
"""Every known objective by name, in registration order (the built-ins first)."""


def register(registration: Registration) -> Registration:
    """Adds an objective; its name and random stream must be new. Returns the registration."""
    taken = {r.rng_stream: r.name for r in REGISTRY.values() if r.rng_stream is not None}
    if registration.name in REGISTRY:
        raise ValueError(f"an objective named {registration.name!r} is already registered")
    if registration.rng_stream in taken:
        raise ValueError(f"objective {registration.name!r}: rng_stream {registration.rng_stream} is "
                         f"{taken[registration.rng_stream]!r}'s; take one no objective uses (taken: {sorted(taken)})")
    REGISTRY[registration.name] = registration
    return registration


def unregister(name: str) -> None:
    """Removes an objective registered outside this package (tests register and remove theirs)."""
    REGISTRY.pop(name)
