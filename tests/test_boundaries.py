"""The boundaries the README promises: the library knows no stage and no tool, no stage knows the driver, the command
line or another stage, the batch contract needs no torch, and every consumer of g computes the same vectors."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "shared" / "marge"
STAGES = ("indexer", "batcher", "trainer", "retrieval")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included); `from a import b` counts as
    both `a` and `a.b`, so that `from services import driver` is seen as importing services.driver."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def stage_imports() -> list[tuple[str, Path, list[str]]]:
    """(stage, file, the dotted parts of one module it imports) for every import of every stage."""
    stage_files = [(stage, path) for stage in STAGES for path in sorted((REPO / "services" / stage).rglob("*.py"))]
    assert len(stage_files) > 20  # the walk saw the stages
    return [(stage, path, name.split(".")) for stage, path in stage_files for name in sorted(imported_modules(path))]


def test_no_library_module_imports_a_stage_or_a_tool():
    """The library (shared/marge) imports nothing of `services` (the stages, the driver, the command line) nor of
    `tools` (the programs that build the demo data)."""
    offenders = {f"{path.relative_to(REPO)} imports {name}" for path in LIBRARY.rglob("*.py")
                 for name in imported_modules(path) if name.split(".")[0] in ("services", "tools", "experiments")}
    assert not offenders, sorted(offenders)
    assert len(list(LIBRARY.rglob("*.py"))) > 15  # the walk saw the library


def test_no_stage_imports_the_driver_or_the_command_line():
    """The driver and the command line compose the stages; a stage never reaches back into either."""
    offenders = {f"{path.relative_to(REPO)} imports {'.'.join(parts)}" for _, path, parts in stage_imports()
                 if parts[:2] in (["services", "driver"], ["services", "cli"])}
    assert not offenders, sorted(offenders)


def test_the_product_imports_no_experiment_and_no_tool():
    """Experiments (`experiments/<study>/`) and the demo-corpus tool sit above the product: they import it, never
    the other way. Nothing of `services` (the stages, the driver, the command line) imports them, so the wheel,
    which ships `marge` and `services` only, runs without them."""
    files = sorted((REPO / "services").rglob("*.py"))
    offenders = {f"{path.relative_to(REPO)} imports {name}" for path in files for name in imported_modules(path)
                 if name.split(".")[0] in ("experiments", "tools")}
    assert not offenders, sorted(offenders)
    assert any(path.parts[-2] == "cli" for path in files) and len(files) > 30


def test_the_wheel_ships_the_library_and_services_only():
    """pyproject's packages: every package folder of shared/marge and services, and nothing else."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"marge": "shared/marge", "services": "services"}
    folders = {".".join(("marge", *p.parent.relative_to(LIBRARY).parts)) for p in LIBRARY.rglob("__init__.py")}
    folders |= {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "services").rglob("__init__.py")}
    assert set(setuptools["packages"]) == folders


def test_stages_import_each_other_only_through_the_library():
    """Stages meet only through the library's contracts: no stage imports another stage (nor anything of
    `services` that is not its own)."""
    offenders = {f"{path.relative_to(REPO)} imports {'.'.join(parts)}" for stage, path, parts in stage_imports()
                 if parts[0] == "services" and len(parts) > 1 and parts[1] != stage}
    assert not offenders, sorted(offenders)


def test_import_paths_match_folders():
    import marge
    import services.indexer.core

    assert Path(marge.__file__).parent == LIBRARY
    assert Path(services.indexer.core.__file__) == REPO / "services" / "indexer" / "core.py"


def test_the_batch_contract_and_the_queue_protocol_need_no_torch():
    code = ("import sys; import marge.contracts.batch, marge.contracts.protocol, marge.contracts.config; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_indexer_service_and_trainer_compute_the_same_unit_g(small_corpus, tmp_path):
    """For one snapshot and the same documents: the vectors the indexer stores in FAISS, the query vectors the
    retrieval service computes from the documents' text, and the trainer model's g agree (centring included)."""
    from marge.contracts.batch import as_encoder_input
    from marge.contracts.corpus import Corpus
    from marge.model.network import Marge
    from marge.model.layers import pad_rows
    from marge.model.architecture import preset
    from marge.model.snapshot import load_relevance_encoder, publish_snapshot
    from services.indexer.config import IndexerConfig
    from services.indexer.core import index_corpus
    from services.retrieval.index import LoadedIndex

    corpus = Corpus.open(small_corpus)
    tok = corpus.tokenizer()
    torch.manual_seed(0)
    model = Marge(preset("tiny", vocab_size=tok.vocab_size, max_positions=128, relevance_pooling="mean",
                         relevance_centering=True))
    with torch.no_grad():  # a centre far from zero, so that a consumer which forgot it would disagree
        model.relevance_center.copy_(model.relevance_vectors(pad_rows(
            [as_encoder_input(t, tok.specials) for t in corpus.read_shard(0).tokens[:32]], tok.specials.pad_id)).mean(0))
    assert model.relevance_center.norm() > 0.1
    run = tmp_path / "run"
    snapshot = publish_snapshot(run / "snapshots", model, 7, tok.sha256)
    version = index_corpus(corpus, load_relevance_encoder(snapshot), tok.specials, run / "index", 0, 7, IndexerConfig())

    shard = corpus.read_shard(0)
    ids = shard.doc_ids[:20]
    stored = np.stack([version.read_faiss(0).reconstruct(int(i)) for i in ids])
    trainer = model.eval().unit_relevance_vectors(pad_rows([as_encoder_input(t, tok.specials) for t in shard.tokens[:20]],
                                                           tok.specials.pad_id)).detach().numpy()
    service = LoadedIndex(version, run, corpus, tok)
    queries = np.stack([service.embed(text) for text in shard.texts[:20]])
    same_tokens = [tok.encode(text) == list(t) for text, t in zip(shard.texts[:20], shard.tokens[:20])]
    np.testing.assert_allclose(stored, trainer, atol=1e-5)
    np.testing.assert_allclose(queries[same_tokens], trainer[same_tokens], atol=1e-5)
    assert sum(same_tokens) >= 15
