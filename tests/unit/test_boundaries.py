"""The boundaries the README promises: the library knows no stage and no tool, no stage knows the driver, the command
line or another stage, the batch contract needs no torch, and every consumer of g computes the same vectors.

The tests of this subject that need a server or take long are in tests/integration/test_boundaries_g.py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "shared" / "marge"
STAGES = ("indexer", "batcher", "trainer", "finetune", "retrieval", "prepare")
ROOMS = ("util", "contracts", "model", "eval")
"""The library's rooms from the bottom up: a module imports only its own room and the rooms below it."""


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


def test_no_stage_imports_the_driver_the_operations_or_the_command_line():
    """The driver and the command line compose the stages, the operations read what runs wrote; a stage never
    reaches back into any of them."""
    offenders = {f"{path.relative_to(REPO)} imports {'.'.join(parts)}" for _, path, parts in stage_imports()
                 if parts[:2] in (["services", "driver"], ["services", "ops"], ["services", "cli"])}
    assert not offenders, sorted(offenders)


def test_running_a_run_imports_no_operation():
    """`services.ops` (audit, Redis users, reports, the config reference) sits above `services.driver` (running a
    run): it reads the driver's config and what runs wrote; the driver imports nothing of it."""
    driver = sorted((REPO / "services" / "driver").rglob("*.py"))
    offenders = {f"{path.relative_to(REPO)} imports {name}" for path in driver for name in imported_modules(path)
                 if name.split(".")[:2] == ["services", "ops"]}
    assert not offenders, sorted(offenders)
    assert len(driver) > 8 and len(list((REPO / "services" / "ops").glob("*.py"))) >= 4


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


def test_the_library_rooms_import_only_downwards():
    """marge.util < marge.contracts < marge.model < marge.eval: no room imports a room above it, so each can be read
    (and tested) with only what lies below it."""
    offenders, seen = [], 0
    for level, room in enumerate(ROOMS):
        for path in sorted((LIBRARY / room).rglob("*.py")):
            seen += 1
            for name in imported_modules(path):
                parts = name.split(".")
                if parts[0] == "marge" and len(parts) > 1 and parts[1] in ROOMS and ROOMS.index(parts[1]) > level:
                    offenders.append(f"{path.relative_to(REPO)} ({room}) imports {name}")
    assert not offenders, offenders
    assert seen > 25 and sorted(p.name for p in LIBRARY.iterdir() if p.suffix == ".py") == ["__init__.py"], \
        "every library module lives in a room"


def test_import_paths_match_folders():
    import marge
    import services.indexer.core

    assert Path(marge.__file__).parent == LIBRARY
    assert Path(services.indexer.core.__file__) == REPO / "services" / "indexer" / "core.py"


def test_the_contracts_and_the_plumbing_need_no_torch():
    """Every module of marge.contracts and marge.util imports without torch: a program that reads a corpus, a batch
    or the queue (a batcher, a data tool) needs no deep-learning stack."""
    code = ("import sys, importlib, pkgutil, marge.contracts, marge.util\n"
            "for room in (marge.contracts, marge.util):\n"
            "    for m in pkgutil.iter_modules(room.__path__): importlib.import_module(f'{room.__name__}.{m.name}')\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


BUILT_IN = {
    "services/driver/config.py": "the run's one slot layout, version plan and batch shape (`PipelineConfig.slots`, "
                                 "`version_plan`, `batch_shape`), compiled once per run into its `RunSpec`",
    "services/trainer/step.py": "`train_step`: an update in one process outside the pipeline (the reference loop, "
                                "the benchmarks), whose batches number 0 .. n-1",
    "services/driver/scale_costs.py": "the costs of other worlds than the config's, for `marge plan`",
}
"""Where a `Slots`, `VersionPlan` or `BatchShape` may be built, and why: nowhere in a stage, which takes the run's
from its job. (A default argument, such as the batcher core's `shape: BatchShape = BatchShape()` for callers
outside a run, is not a build: every job passes its spec's.)"""
SPEC_FACTS = ("Slots", "VersionPlan", "BatchShape", "without_index")


def built_facts(path: Path) -> list[str]:
    """The spec facts (`SPEC_FACTS`) a file builds, one entry per call, default arguments left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defaults = {id(d) for node in ast.walk(tree) if isinstance(node, ast.arguments)
                for d in [*node.defaults, *node.kw_defaults] if d is not None}
    return [name for node in ast.walk(tree) if isinstance(node, ast.Call) and id(node) not in defaults
            for name in [getattr(node.func, "id", getattr(node.func, "attr", None))] if name in SPEC_FACTS]


def test_a_runs_slots_plan_and_shape_are_built_once_and_no_stage_builds_its_own():
    builds = {str(path.relative_to(REPO)): built_facts(path)
              for path in sorted([*(REPO / "services").rglob("*.py"), *LIBRARY.rglob("*.py")])}
    builds = {path: facts for path, facts in builds.items() if facts}
    assert set(builds) <= set(BUILT_IN), sorted(set(builds) - set(BUILT_IN))
    assert sorted(builds["services/driver/config.py"]) == ["BatchShape", "Slots", "VersionPlan", "without_index"]


def test_the_run_hosts_read_the_compiled_spec():
    """The Ray pipeline and the single process take the slots, version plan, batch shape and model from the run's
    `RunSpec` (`services.driver.spec.compile_spec`, written to run_dir/spec.json), never derive them again from the
    config; no stage derives them at all."""
    derived = ("slots", "version_plan", "batch_shape", "model_config")
    hosts = [REPO / "services" / "driver" / name for name in ("pipeline.py", "single_process.py")]
    stages = [path for stage in STAGES for path in (REPO / "services" / stage).rglob("*.py")]
    offenders = sorted(f"{path.relative_to(REPO)}:{node.lineno} calls .{node.func.attr}()"
                       for path in [*hosts, *stages] for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                       if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                       and node.func.attr in derived)
    assert not offenders, offenders
    for host in hosts:
        assert "compile_spec(" in host.read_text(encoding="utf-8"), f"{host.name} compiles no spec"
