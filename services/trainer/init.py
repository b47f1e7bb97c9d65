"""Step 0 of a run: the seeded initial weights every trainer rank starts from, and (for a MARGE model) the
snapshot the first index is built from."""

from __future__ import annotations

import json
import logging

import torch

from marge.contracts.config import ConfigError
from marge.contracts.corpus import Corpus
from marge.contracts.paths import RunPaths
from marge.model.architecture import MargeConfig
from marge.model.checkpoint import build_model, load_model_weights, save_model_weights, saved_config
from marge.model.network import Marge
from marge.model.snapshot import latest_snapshot, publish_snapshot

log = logging.getLogger(__name__)


def ensure_initial_model(model_cfg, paths: RunPaths, corpus: Corpus, seed: int) -> None:
    """Write the run's initial weights (seeded) and step-0 snapshot unless they exist; a run folder that holds
    another model's weights is an error (resume with the same model config, or choose another folder)."""
    tokenizer = corpus.tokenizer()
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size {model_cfg.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
    if model_cfg.max_positions < corpus.manifest["max_chunk_tokens"]:
        raise ConfigError(f"model.max_positions {model_cfg.max_positions} < the corpus's max_chunk_tokens "
                          f"{corpus.manifest['max_chunk_tokens']}")
    path = paths.init_weights
    if path.exists():
        saved = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
        if saved != saved_config(model_cfg):
            raise ConfigError(f"{paths.run_dir} holds a run with a different model config; resume it with the same "
                              "config or choose another run.dir / run.name")
    else:
        torch.manual_seed(seed)
        save_model_weights(path, build_model(model_cfg))
    if isinstance(model_cfg, MargeConfig) and latest_snapshot(paths.snapshots) is None:
        model = load_model_weights(path)
        if not isinstance(model, Marge):  # a MargeConfig's weights load as a Marge
            raise ValueError(f"{path}: a {type(model).__name__}, not the MARGE model its config names")
        publish_snapshot(paths.snapshots, model, 0, tokenizer.sha256)
