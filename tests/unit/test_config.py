"""Configs load and validate in full before anything starts; deployment manifests keep every control port inside
the cluster.

The tests of this subject that need a server or take long are in tests/integration/test_config_servers.py."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from marge.contracts.config import ConfigError
from marge.model.sizes import build_on_meta, count_parameters
from services.driver.config import PipelineConfig, load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


@pytest.mark.parametrize("name", ["tiny", "base", "paper", "learning", "learning-gpu"])
def test_shipped_configs_load_and_round_trip(name, tmp_path):
    cfg = load_config(DEPLOY / "configs" / f"{name}.yaml")
    assert cfg.model["preset"] in ("tiny", "base", "paper")
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(saved) == cfg  # what a run saves in its folder loads back to the same settings


def test_paper_config_is_the_paper():
    cfg = load_config(DEPLOY / "configs" / "paper.yaml")
    n = count_parameters(build_on_meta(cfg.model_config(vocab_size=cfg.data.vocab_size)))
    assert abs(n - 963e6) / 963e6 < 0.02
    assert cfg.indexer.reindex_every == 10000 and cfg.batcher.crosslingual_weight == 100
    assert cfg.batcher.monolingual_weight == 1 and cfg.indexer.links_monolingual == cfg.indexer.links_crosslingual == 4
    assert cfg.data.max_chunk_tokens == 512 and cfg.trainer.lr == 1e-4 and cfg.trainer.warmup_steps == 10000


def leaf_fields(cls: type, prefix: str = ""):
    """Every (dotted key, type) of the config tree, sections expanded."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        inner = next((a for a in typing.get_args(typ) if dataclasses.is_dataclass(a)), None)
        if dataclasses.is_dataclass(typ) or inner is not None:
            yield from leaf_fields(inner or typ, f"{prefix}{f.name}.")
        elif f.name != "model":
            yield f"{prefix}{f.name}", typ


@pytest.mark.parametrize("key", [key for key, typ in leaf_fields(PipelineConfig) if typ is not str
                                 and typing.get_args(typ) != (str, type(None))])
def test_every_field_of_every_section_refuses_a_wrong_type_and_names_itself(key):
    value = "not-a-number"
    if "resources" in key:
        value = "[1, 2]"  # a list where a mapping belongs
    elif key.endswith(("raw", "adam_betas")):
        value = "{a: 1}"  # a mapping where a list belongs
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(DEPLOY / "configs" / "learning.yaml", [f"{key}={value}"])


@pytest.mark.parametrize("override, message", [
    ("run.max_step=7", r"command-line override 'run.max_step=7': run\.max_step: unknown key\(s\) \['max_step'\] in "
                       r"section 'run'; did you mean 'max_steps'"),
    ("traner.lr=1", r"command-line override 'traner.lr=1': traner: unknown key\(s\) .* did you mean 'trainer'\?"),
    ("run.max_steps=0", r"run\.max_steps must be > 0, got 0"),
    ("run.name=a/b", r"run\.name must be a non-empty name"),
    ("run.dir=s3://bucket/runs/x", r"run\.dir must be a path on a POSIX filesystem every node mounts, not an object-store URI"),
    ("data.max_chunk_tokens=2", r"data\.max_chunk_tokens must be >= 3, got 2"),
    ("indexer.link_rule=bogus", r"indexer\.link_rule must be one of \['shard', 'document'\], got 'bogus'"),
    ("indexer.nice=25", r"indexer\.nice must be in \[0, 19\], got 25"),
    ("indexer.min_score=2", r"indexer\.min_score must be in \[-1.0, 1.0\], got 2.0"),
    ("indexer.links_crosslingual=-1", r"indexer\.links_crosslingual must be >= 0, got -1.0"),
    ("indexer.num_gpus_per_worker=1", r"indexer\.use_gpu must be true when num_gpus_per_worker > 0"),
    ("indexer.resources={a: -1}", r"indexer\.resources\.a must be a number >= 0, got -1"),
    ("batcher.max_tokens=8", r"batcher\.max_tokens must be >= 16, got 8"),
    ("batcher.crosslingual_weight=-3", r"batcher\.crosslingual_weight must be >= 0"),
    ("queue.max_depth=0", r"queue\.max_depth must be > 0, got 0"),
    ("trainer.num_workers=0", r"trainer\.num_workers must be > 0, got 0"),
    ("trainer.lr=-1e-3", r"trainer\.lr must be > 0, got -0\.001"),
    ("trainer.adam_betas=[0.9, 1.5]", r"trainer\.adam_betas must be two numbers in \[0, 1\)"),
    ("trainer.clip_norm=-1", r"trainer\.clip_norm must be >= 0"),
    ("objectives.marge.attend_to=some", r"objectives\.marge\.attend_to must be one of \['all', 'linked'\], got 'some'"),
    ("objectives.self_evidence={prob: 2, until: 10}", r"objectives\.self_evidence\.prob must be in \[0.0, 1.0\], got 2"),
    ("objectives.denoising_contrastive={weight: 0.3, deletion: 1}",
     r"objectives\.denoising_contrastive\.deletion must be in \[0.0, 1.0\), got 1"),
    ("objectives.mlm={weight: 1}", r"unknown key\(s\) \['mlm'\] in section 'objectives'"),
    ("objectives.bart={poisson_lambda: 0}", r"objectives\.bart\.poisson_lambda must be > 0, got 0"),
    ("health.probe_size=0", r"health\.probe_size must be > 0, got 0"),
    ("redis.appendfsync=sometimes", r"redis\.appendfsync must be one of \['always', 'everysec', 'no'\], got 'sometimes'"),
    ("ray.num_cpus=0", r"ray\.num_cpus must be > 0, got 0"),
    ("model.depth=3", r"unknown model field\(s\) \['depth'\]"),
    ("model.relevance_pooling=max", r"model\.relevance_pooling must be 'bos' or 'mean', got 'max'"),
    ("indexer.reindex_every=15", r"indexer\.reindex_every must be a multiple of trainer\.snapshot_every \(100\), got 15"),
    ("indexer.links=bm25", r"indexer\.links must be one of \['g', 'tfidf', 'aligned'\], got 'bm25'"),
    ("indexer.bootstrap=bm25", r"indexer\.bootstrap must be one of \['none', 'tfidf'\], got 'bm25'"),
    ("indexer.lexical_until=0", r"indexer\.lexical_until must be > 0 when lexical_weight > 0"),
    ("data.document_unit=sentence", r"data\.document_unit must be one of \['chunk', 'paragraph'\], got 'sentence'"),
    ("data.languages=[en, xx]", r"data\.languages must be ISO 639-1 codes"),
    ("health.eval_layer=h", r"health\.eval_layer must be one of \['g'\], got 'h'"),
    ("health.aligned_probe_size=-1", r"health\.aligned_probe_size must be >= 0, got -1"),
    ("batcher.max_tokens=100", r"batcher\.max_tokens must fit one target and one evidence document .* at least 255, got 100"),
])
def test_bad_values_are_errors_that_name_the_key_the_value_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEPLOY / "configs" / "learning.yaml", [override])


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
    assert "protected-mode yes" in redis_conf and "requirepass" not in redis_conf  # secrets come from start.sh
    assert rayjob["spec"]["submissionMode"] == "SidecarMode"  # the submitter reaches the 127.0.0.1 dashboard


def test_no_deploy_file_puts_the_redis_url_where_a_job_api_or_ps_shows_it():
    """The URL holds the password: the deploy files name a file that holds it (MARGE_REDIS_URL_FILE), never the URL
    in an environment variable of a job's runtime env or a container, nor in a command line."""
    runtime_env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert "MARGE_REDIS_URL" not in (runtime_env.get("env_vars") or {})
    rayjob = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    cluster = rayjob["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    containers = [c for pod in pods for c in pod["template"]["spec"]["containers"]]
    names = [e["name"] for c in containers for e in c.get("env", [])]
    assert "MARGE_REDIS_URL" not in names and names.count("MARGE_REDIS_URL_FILE") == 2  # the head and the trainers
    launcher = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    options = " ".join(launcher["docker"]["run_options"])
    assert "-e MARGE_REDIS_URL " not in options + " " and "MARGE_REDIS_URL_FILE=" in options


def test_every_deviation_from_the_paper_is_off_in_the_paper_preset_and_config():
    from marge.model.architecture import preset

    paper = preset("paper")
    assert paper.relevance_pooling == "bos" and not paper.relevance_centering and paper.relevance_layers == 4
    assert paper.tie_encoder_embeddings
    cfg = load_config(DEPLOY / "configs" / "paper.yaml")
    assert cfg.objectives.self_evidence is None and cfg.objectives.denoising_contrastive is None
    assert cfg.objectives.marge.attend_to == "all" and cfg.objectives.marge.weight == 1
    model = cfg.model_config(vocab_size=cfg.data.vocab_size)
    assert model == paper
    assert cfg.indexer.min_score == -1.0 and cfg.indexer.link_rule == "shard"
    assert cfg.indexer.links == "g" and cfg.indexer.bootstrap == "none" and cfg.indexer.lexical_weight == 0
    assert cfg.data.max_chunk_tokens == 512 and cfg.data.document_unit == "chunk" and cfg.data.languages is None
    defaults = PipelineConfig()  # a config that says nothing gets the paper's choices too
    assert (defaults.indexer.links, defaults.indexer.bootstrap, defaults.indexer.lexical_weight) == ("g", "none", 0.0)
    assert defaults.data.document_unit == "chunk" and defaults.data.languages is None


def test_no_loss_weight_is_architecture():
    from marge.model.architecture import MargeConfig

    names = [f.name for f in dataclasses.fields(MargeConfig)]
    assert not [n for n in names if n.endswith(("_weight", "_temperature"))]


def test_the_config_reference_is_generated_and_documents_every_key():
    import re

    from services.ops.config_reference import reference

    text = reference()
    assert (REPO / "docs" / "configuration.md").read_text(encoding="utf-8") == text + "\n", \
        "docs/configuration.md is stale: run `marge config reference --out docs/configuration.md`"
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 100
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]] for row in rows]
    assert {len(c) for c in cells} == {6}  # key, type, default, paper.yaml, learning.yaml, doc
    undocumented = [c[0] for c in cells if not c[5]]
    assert undocumented == [], f"config keys without a docstring under their field: {undocumented}"
    for key in ("indexer.bootstrap", "indexer.lexical_weight", "data.document_unit", "health.aligned_probe_size",
                "model.embedding_layernorm", "objectives.self_evidence.until"):
        assert f"| `{key}` |" in text


def test_an_error_in_an_override_names_the_override_not_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^command-line override 'indexer.link_rule=bogus': indexer\.link_rule must"):
        load_config(DEPLOY / "configs" / "tiny.yaml", ["indexer.link_rule=bogus"])
    with pytest.raises(ConfigError, match=r"^command-line override 'trainer=\{lr: -1\}': trainer\.lr must be > 0"):
        load_config(DEPLOY / "configs" / "tiny.yaml", ["trainer={lr: -1}"])
    own = tmp_path / "mine.yaml"
    own.write_text("run:\n  max_steps: 0\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml: run\.max_steps must be > 0"):  # the file's own value
        load_config(own, ["trainer.lr=1e-3"])


def test_the_redis_url_comes_from_a_secret_file_and_a_bad_one_is_named(tmp_path, monkeypatch):
    from services.driver.config import ConfigError, environment_endpoints, load_config, redis_url_from_environment

    secret = tmp_path / "redis-url"
    secret.write_text("redis://marge:s3cret@10.0.0.5:6379/0\n")
    monkeypatch.delenv("MARGE_REDIS_URL", raising=False)
    monkeypatch.setenv("MARGE_REDIS_URL_FILE", str(secret))
    cfg = environment_endpoints(load_config(REPO / "deploy/configs/tiny.yaml", []))
    assert cfg.redis.url == "redis://marge:s3cret@10.0.0.5:6379/0"
    monkeypatch.setenv("MARGE_REDIS_URL", "redis://:other@127.0.0.1:6379/0")  # the variable, where set, wins
    assert redis_url_from_environment() == "redis://:other@127.0.0.1:6379/0"
    monkeypatch.delenv("MARGE_REDIS_URL")
    monkeypatch.setenv("MARGE_REDIS_URL_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="MARGE_REDIS_URL_FILE=.*missing: cannot read a Redis URL"):
        redis_url_from_environment()
    secret.write_text("s3cret\n")
    monkeypatch.setenv("MARGE_REDIS_URL_FILE", str(secret))
    with pytest.raises(ConfigError, match="is not a redis://, rediss:// or unix:// URL"):
        redis_url_from_environment()


def test_audit_on_a_single_process_run_says_there_is_no_queue_in_one_line(tmp_path, capsys, monkeypatch):
    from services.cli import main

    monkeypatch.delenv("MARGE_REDIS_URL", raising=False)
    monkeypatch.delenv("MARGE_REDIS_URL_FILE", raising=False)
    (tmp_path / "config.yaml").write_text((DEPLOY / "configs" / "tiny.yaml").read_text())
    (tmp_path / "checkpoints").mkdir()  # where a single-process run keeps them (a pipeline run: ray_train/)
    assert main(["audit", "--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained in a single process" in err[0] and "nothing to audit" in err[0], err
