"""Configs load and validate; deployment manifests keep every control port inside the cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from marge.config import ConfigError, load_config
from marge.model import build_on_meta, count_parameters

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


@pytest.mark.parametrize("name", ["tiny", "base", "paper"])
def test_shipped_configs_load(name):
    cfg = load_config(DEPLOY / "configs" / f"{name}.yaml")
    assert cfg.model["preset"] == name


def test_paper_config_is_the_paper():
    cfg = load_config(DEPLOY / "configs" / "paper.yaml")
    n = count_parameters(build_on_meta(cfg.model_config(vocab_size=cfg.data.vocab_size)))
    assert abs(n - 963e6) / 963e6 < 0.02
    assert cfg.indexer.reindex_every == 10000 and cfg.batcher.crosslingual_weight == 100
    assert cfg.batcher.monolingual_weight == 1 and cfg.indexer.links_monolingual == cfg.indexer.links_crosslingual == 4
    assert cfg.data.max_chunk_tokens == 512 and cfg.trainer.lr == 1e-4 and cfg.trainer.warmup_steps == 10000


def test_overrides_and_errors_name_the_key():
    cfg = load_config(DEPLOY / "configs" / "tiny.yaml", ["run.max_steps=7", "trainer.lr=2e-3", "model.beta_init=4"])
    assert cfg.run.max_steps == 7 and cfg.trainer.lr == 0.002 and cfg.model_config(100).beta_init == 4.0
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['max_step'\] in section 'run'"):
        load_config(None, ["run.max_step=7"])
    with pytest.raises(ConfigError, match="trainer.num_workers must be positive"):
        load_config(None, ["trainer.num_workers=0"])
    with pytest.raises(ConfigError, match="run.max_steps must be a int"):
        load_config(None, ["run.max_steps=many"])
    with pytest.raises(ConfigError, match=r"unknown model field\(s\) \['depth'\]"):
        load_config(None, ["model.depth=3"])
    with pytest.raises(ConfigError, match="multiple of trainer.snapshot_every"):
        load_config(None, ["indexer.reindex_every=15", "trainer.snapshot_every=10"])
    with pytest.raises(ConfigError, match="batcher.max_tokens"):
        load_config(None, ["batcher.max_tokens=100"])


def all_manifests():
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".conf"))


def test_nothing_exposes_the_dashboard_job_api_or_redis_beyond_the_cluster():
    for path in all_manifests():
        text = path.read_text()
        assert "dashboard-host=0.0.0.0" not in text and 'dashboard-host: "0.0.0.0"' not in text, path
        for doc in yaml.safe_load_all(text) if path.suffix != ".conf" else []:
            if isinstance(doc, dict) and doc.get("kind") == "Service":
                assert doc["spec"].get("type", "ClusterIP") == "ClusterIP", path
    rayjob = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]
    assert head["dashboard-host"] == "127.0.0.1"  # KubeRay would fill in 0.0.0.0 if it were missing
    assert rayjob["spec"]["rayClusterSpec"]["authOptions"]["mode"] == "token"
    groups = {g["groupName"] for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert {"trainer-gpu", "indexer-gpu"} <= groups
    redis_conf = (DEPLOY / "redis" / "redis.conf").read_text()
    assert "maxmemory-policy noeviction" in redis_conf and "appendonly yes" in redis_conf
    assert "requirepass" in redis_conf and "protected-mode yes" in redis_conf


def test_every_deviation_from_the_paper_is_off_in_the_paper_preset_and_config():
    from marge.model import preset

    paper = preset("paper")
    assert paper.relevance_pooling == "bos" and not paper.relevance_centering
    assert paper.relevance_distill_weight == 0 and not paper.beta_per_layer and paper.relevance_layers == 4
    assert paper.relevance_contrastive_weight == 0 and paper.tie_encoder_embeddings
    assert paper.relevance_layers_from_reconstruction
    cfg = load_config(DEPLOY / "configs" / "paper.yaml")
    assert cfg.trainer.self_evidence_prob == 0 and cfg.trainer.denoise_weight == 0
    model = cfg.model_config(vocab_size=cfg.data.vocab_size)
    assert model == paper
    assert cfg.batcher.attend_to == "all" and cfg.indexer.min_score == -1.0 and cfg.indexer.link_rule == "shard"
    assert cfg.data.max_chunk_tokens == 512
