"""A test objective outside the package: one class, its settings and one registration (`register_spread`, which
tests/spread_registration.py makes on import, as a user's module named in `objectives.imports` does).
tests/unit/test_objective_registry.py trains it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from marge.contracts.batch import encoder_rows_flat
from marge.contracts.config import positive
from services.trainer.objective_registry import REGISTRY, ObjectiveLoss, Registration, register
from services.trainer.objectives import Tensors, core_model, real_count


@dataclass(frozen=True, kw_only=True)
class SpreadConfig:
    weight: float = 1.0
    """Weight of this loss in the sum the step backpropagates."""
    dropped: float = 0.0
    """Share of each target's tokens dropped before g reads it (drawn from the objective's own stream)."""

    def __post_init__(self) -> None:
        positive(self, "weight")


class SpreadObjective:
    """The targets' g vectors pushed apart: the mean cosine between different targets of a batch."""

    name = "spread"

    def __init__(self, cfg: SpreadConfig, specials):
        self.cfg, self.specials = cfg, specials

    def prepare(self, batch, rng: np.random.Generator, step: int):
        docs = [np.asarray(batch.doc_tokens[t]) for t in batch.targets]
        docs = [d[rng.random(len(d)) >= self.cfg.dropped] if self.cfg.dropped else d for d in docs]
        if len(docs) < 2:
            return None
        lengths = np.array([len(d) for d in docs])
        return Tensors(rows=torch.from_numpy(encoder_rows_flat(np.concatenate(docs).astype(np.int64), lengths,
                                                               self.specials)))

    def loss(self, model, inputs) -> ObjectiveLoss:
        g = F.normalize(core_model(model).relevance_vectors(inputs["rows"]).float(), dim=-1)
        n = len(g)
        cosines = (g @ g.T)[~torch.eye(n, dtype=torch.bool)]
        return ObjectiveLoss(cosines.mean(), torch.zeros((), dtype=torch.long))

    def work(self, inputs, pad_id: int) -> dict[str, int]:
        return {"relevance": real_count(inputs["rows"], pad_id)}


def register_spread() -> None:
    """The registration (again after a test removed it)."""
    if "spread" not in REGISTRY:
        register(Registration("spread", SpreadConfig, rng_stream=10, role="auxiliary",
                              build=lambda cfg, context: SpreadObjective(cfg, context.specials)))

