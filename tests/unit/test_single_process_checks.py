"""`python -m experiments.learning --single-process` (`services.driver.single_process`): the stage cores in one process, without Ray, Redis or FAISS.

The tests of this subject that need a server or take long are in tests/integration/test_single_process.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from single_process_inputs import overrides

REPO = Path(__file__).resolve().parents[2]

# Run the study's module from the working tree (shared/ and the checkout on the import path, as
# scripts/marge_from_tree.py puts them) with Ray, Redis, FAISS and FastAPI made unimportable.


def test_resume_refuses_a_changed_config_and_a_missing_run(small_corpus, few_pairs, tmp_path):
    from services.driver.single_process import run_single_process

    with pytest.raises(FileNotFoundError, match="start one without --resume"):
        run_single_process(None, [], minutes=1, out_dir=tmp_path / "none", resume=True, device="cpu")
    out = tmp_path / "run"
    (out).mkdir()
    (out / "experiment.json").write_text('{"mode": "single-process", "chunks": []}')
    with pytest.raises(ValueError, match="trainer.lr .*only run.max_steps, run.progress_every_s may change"):
        run_single_process(None, ["trainer.lr=1e-2"], minutes=1, out_dir=out, resume=True, device="cpu")
    with pytest.raises(FileExistsError, match="pass --resume"):
        run_single_process(None, overrides(small_corpus, few_pairs), minutes=1, out_dir=out, device="cpu")


def test_torch_search_finds_the_faiss_neighbours():
    from services.indexer.neighbours import nearest_neighbours

    rng = np.random.default_rng(0)
    database = rng.normal(size=(300, 16)).astype(np.float32)
    database /= np.linalg.norm(database, axis=1, keepdims=True)
    queries = database[rng.permutation(300)[:50]] + 0.01 * rng.normal(size=(50, 16)).astype(np.float32)
    faiss_scores, faiss_rows = nearest_neighbours(database, queries, 7, "faiss")
    torch_scores, torch_rows = nearest_neighbours(database, queries, 7, "torch")
    assert (faiss_rows == torch_rows).all()
    assert torch_scores == pytest.approx(faiss_scores, abs=1e-5)
    with pytest.raises(ValueError, match="unknown search backend"):
        nearest_neighbours(database, queries, 7, "annoy")
