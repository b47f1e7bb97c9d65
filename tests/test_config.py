"""Configs load and validate in full before anything starts; deployment manifests keep every control port inside
the cluster."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import yaml

from marge.contracts.config import ConfigError
from marge.contracts.corpus import Corpus
from marge.model.sizes import build_on_meta, count_parameters
from services.driver.config import PipelineConfig, load_config

REPO = Path(__file__).resolve().parents[1]
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
    ("indexer.reindex_every=15", r"indexer\.reindex_every must be a multiple of trainer\.snapshot_every \(250\), got 15"),
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


def test_marge_pretrain_refuses_a_bad_setting_within_seconds_before_ray_or_redis_start(tmp_path):
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "pretrain", "--config",
                           str(DEPLOY / "configs" / "tiny.yaml"), "indexer.link_rule=bogus", f"run.dir={tmp_path / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "indexer.link_rule" in last and "'bogus'" in last and "['shard', 'document']" in last
    assert time.time() - started < 20
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_a_run_the_ray_cluster_cannot_hold_is_refused_naming_what_it_needs_and_what_there_is(small_corpus, tmp_path):
    """With too few logical CPUs Ray Train would time out (WorkerGroupStartupTimeoutError): refused up front."""
    cfg = load_config(DEPLOY / "configs" / "tiny.yaml")
    assert cfg.cpus_needed() == 3 and load_config(DEPLOY / "configs" / "tiny-bart.yaml").cpus_needed() == 2
    cfg.check_fits(3)
    with pytest.raises(ConfigError, match=r"needs 3 logical CPUs \(trainer 2 x 1 \+ indexer 1 x 1\) but the Ray "
                                          r"cluster has 2: add nodes"):
        cfg.check_fits(2)
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "pretrain", "--config",
                           str(DEPLOY / "configs" / "tiny.yaml"), "ray.num_cpus=2", f"run.dir={tmp_path / 'run'}",
                           f"data.corpus={small_corpus}", "data.max_chunk_tokens=128", "model.max_positions=128",
                           "batcher.max_tokens=400"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs 3 logical CPUs" in proc.stderr and "has 2" in proc.stderr
    assert time.time() - started < 60  # refused before Ray starts, not after Ray Train's start-up timeout


def all_manifests():
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".conf"))

def test_pretrain_prints_the_resolved_config_and_dry_runs_without_starting_or_writing_anything(small_corpus, tmp_path):
    cli = [sys.executable, "-m", "services.cli", "pretrain", "--config", str(DEPLOY / "configs" / "tiny.yaml")]
    run_dir = tmp_path / "run"
    printed = subprocess.run([*cli, "--print-config", "run.max_steps=7", f"run.dir={run_dir}"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr[-2000:]
    resolved = yaml.safe_load(printed.stdout)
    assert resolved["run"]["max_steps"] == 7 and resolved["trainer"]["loss_chunk_tokens"] == 0  # defaults included
    assert load_config(DEPLOY / "configs" / "tiny.yaml", ["run.max_steps=7", f"run.dir={run_dir}"]).to_saved_dict() == resolved

    on_corpus = [f"run.dir={run_dir}", f"data.corpus={small_corpus}", "data.max_chunk_tokens=128",
                 "model.max_positions=128", "batcher.max_tokens=400", "ray.num_cpus=3"]
    planned = subprocess.run([*cli, "--dry-run", *on_corpus], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr[-2000:]
    plan = json.loads(planned.stdout)
    assert plan["corpus"]["shards"] == Corpus.open(small_corpus).num_shards and plan["resumes_from_step"] == 0
    assert plan["model"]["d_model"] == 64 and "refresh_interval_s" in plan["capacity_plan"]

    # a corpus of one's own: the config file's probe files (its demo corpus's) are not used for it
    assert plan["probes"] == {"health.documents": None, "data.heldout_pairs": None}, plan["probes"]
    missing_probe = subprocess.run([*cli, "--dry-run", *on_corpus, f"health.documents={tmp_path / 'probes.jsonl'}"],
                                   cwd=REPO, capture_output=True, text=True, timeout=120)
    assert missing_probe.returncode != 0 and "health.documents names" in missing_probe.stderr, missing_probe.stderr[-2000:]
    # a probe file from another corpus is refused unless asked for, and one in none of its languages always
    elsewhere = tmp_path / "elsewhere" / "pairs.tsv"
    elsewhere.parent.mkdir()
    elsewhere.write_text("en\tThe sum of the cells.\tde\tDie Summe der Zellen.\n", encoding="utf-8")
    foreign = subprocess.run([*cli, "--dry-run", *on_corpus, f"data.heldout_pairs={elsewhere}"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert foreign.returncode != 0 and "neither" in foreign.stderr and "health.external_probes=true" in foreign.stderr
    allowed = subprocess.run([*cli, "--dry-run", *on_corpus, f"data.heldout_pairs={elsewhere}",
                              "health.external_probes=true"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert json.loads(allowed.stdout)["probes"]["data.heldout_pairs"] == str(elsewhere)
    elsewhere.write_text("xx\tone\tyy\ttwo\n", encoding="utf-8")
    unspoken = subprocess.run([*cli, "--dry-run", *on_corpus, f"data.heldout_pairs={elsewhere}",
                               "health.external_probes=true"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert unspoken.returncode != 0 and "data.heldout_pairs:" in unspoken.stderr, unspoken.stderr[-2000:]

    # a corpus path that does not exist (a typo) is not prepared from the config file's data.raw
    for extra in ([], ["data.raw=[]"]):
        typo = subprocess.run([*cli, "--dry-run", f"run.dir={run_dir}", f"data.corpus={tmp_path / 'absent'}", *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert typo.returncode != 0 and "no prepared corpus is there" in typo.stderr, typo.stderr[-2000:]
        assert "data.raw=[INPUT]" in typo.stderr
    raw = REPO / "data" / "demo" / "libreoffice-help" / "documents.jsonl.gz"
    unprepared = subprocess.run([*cli, "--dry-run", f"run.dir={run_dir}", f"data.corpus={tmp_path / 'absent'}",
                                 f"data.raw=[{raw}]"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert unprepared.returncode == 0, unprepared.stderr[-2000:]
    assert "to be prepared from" in json.loads(unprepared.stdout)["corpus"]
    assert not run_dir.exists() and not (tmp_path / "absent").exists()  # nothing was written



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


def start_shipped_redis(tmp_path: Path, port: int, env: dict[str, str]):
    """deploy/redis/start.sh on loopback, its data and ACL file under tmp_path; returns once `marge` gets in."""
    import os

    import redis

    proc = subprocess.Popen(["sh", str(DEPLOY / "redis" / "start.sh"), "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path)],
                            env={**os.environ, "MARGE_REDIS_ACLFILE": str(tmp_path / "users.acl"), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"redis://marge:{env['MARGE_REDIS_PASSWORD']}@127.0.0.1:{port}/0"
    deadline = time.time() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc
        except redis.ConnectionError:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline
            time.sleep(0.05)


def stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def one_batch(batch_id: str = "v0-e0-s0-0"):
    import numpy as np

    from marge.contracts.batch import Batch

    tokens = (np.arange(4, 9, dtype=np.int32), np.arange(9, 14, dtype=np.int32))
    return Batch(batch_id, 0, 0, np.array([1, 2]), ("en", "de"), tokens, np.array([0], dtype=np.int32),
                 np.array([1], dtype=np.int32), np.array([[0, 0]], dtype=np.int32), np.ones(1, dtype=np.float32))


def test_the_shipped_redis_conf_loads_and_limits_the_pipeline_user_to_its_keys(tmp_path):
    """deploy/redis/start.sh with deploy/redis/redis.conf on a real redis-server: the queue works as user marge
    (every command the pipeline uses), other keys and dangerous commands are refused, nobody gets in without a
    password."""
    import redis

    from marge.contracts.protocol import BatchQueue
    from marge.contracts.slots import Slots
    from services.driver.redis_server import free_port

    port, password = free_port(), "pipeline-password-123"
    proc = start_shipped_redis(tmp_path, port, {"MARGE_REDIS_PASSWORD": password})
    try:
        url = f"redis://marge:{password}@127.0.0.1:{port}/0"
        q = BatchQueue.connect(url, "acl", Slots(1, 1))
        assert q.put(0, one_batch(), 10) and q.get(0, block_ms=10).batch.batch_id == "v0-e0-s0-0"
        q.progress(0, 1)
        assert q.commit(0, 1, [(0, "v0-e0-s0-0")]) == []
        assert q.dead_letter(1, {b"header": b"{}"}, "test")  # a Lua script on the run's keys
        q.request_replay(q.dead_letters()[0]["entry"])
        q.publish_step({"step": 1})
        q.reset_from(1)
        assert q.counts()["committed_step"] == 1 and q.last_step() == {"step": 1}
        client = redis.Redis.from_url(url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("not-marge", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.config_get("dir")
        with pytest.raises((redis.AuthenticationError, redis.exceptions.NoPermissionError)):
            redis.Redis(host="127.0.0.1", port=port).set("marge:x", 1)
    finally:
        stop(proc)


def test_a_run_gets_its_own_redis_user_which_reaches_its_keys_alone_and_outlives_a_restart(tmp_path, capsys):
    """`marge redis-user create` on the shipped server (an operator's account from a file): the run's URL lands in a
    0600 file, runs the whole queue protocol on the run's keys, is refused another run's keys, the shared `marge:`
    keys and dangerous commands, still gets in after redis-server restarts (the ACL file keeps it), and is shut
    out once `marge redis-user delete` removed it."""
    import stat

    import redis

    from marge.contracts.protocol import BatchQueue
    from marge.contracts.slots import Slots
    from services.cli import main
    from services.driver.redis_server import free_port
    from services.driver.redis_users import PIPELINE_COMMANDS

    assert f'commands="{PIPELINE_COMMANDS}"' in (DEPLOY / "redis" / "start.sh").read_text()  # one set of rights
    port = free_port()
    env = {"MARGE_REDIS_PASSWORD": "pipeline-password-123", "MARGE_REDIS_ADMIN_PASSWORD": "operator-password-456"}
    admin_file = tmp_path / "admin.url"
    admin_file.write_text(f"redis://default:{env['MARGE_REDIS_ADMIN_PASSWORD']}@127.0.0.1:{port}/0\n")
    proc = start_shipped_redis(tmp_path, port, env)
    try:
        assert main(["redis-user", "create", "--run", "r1", "--admin-url-file", str(admin_file),
                     "--out", str(tmp_path / "r1.url")]) == 0
        made = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert made["user"] == "marge-r1" and made["saved_to_aclfile"], made
        assert stat.S_IMODE((tmp_path / "r1.url").stat().st_mode) == 0o600
        url = (tmp_path / "r1.url").read_text().strip()
        assert url.startswith("redis://marge-r1:") and url.endswith(f"@127.0.0.1:{port}/0")
        q = BatchQueue.connect(url, "r1", Slots(1, 1))
        assert q.put(0, one_batch(), 10) and q.get(0, block_ms=10).batch.batch_id == "v0-e0-s0-0"
        assert q.commit(0, 1, [(0, "v0-e0-s0-0")]) == [] and q.counts()["committed_step"] == 1
        other = BatchQueue.connect(url, "r2", Slots(1, 1))
        with pytest.raises(redis.exceptions.NoPermissionError):
            other.put(0, one_batch(), 10)
        client = redis.Redis.from_url(url)
        for refused in (lambda: client.set("marge:r1x:k", 1), lambda: client.get("marge:shared"),
                        client.flushall, lambda: client.config_get("dir")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    finally:
        stop(proc)
    proc = start_shipped_redis(tmp_path, port, env)  # a restart: the ACL file and the AOF are read again
    try:
        q = BatchQueue.connect(url, "r1", Slots(1, 1))
        assert q.counts()["committed_step"] == 1
        assert main(["redis-user", "delete", "--run", "r1", "--admin-url-file", str(admin_file)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["deleted"]
        with pytest.raises((redis.AuthenticationError, redis.exceptions.ResponseError)):
            redis.Redis.from_url(url).ping()
    finally:
        stop(proc)


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

    from services.driver.config_reference import reference

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


def test_marge_cli_small_things(capsys):
    """--version; an unknown model field in `marge info --set` is one line naming the fields; `marge info | head`
    closing the pipe early is not an error."""
    from services.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("marge ")
    assert main(["info", "--preset", "tiny", "--set", "bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "--set bogus" in err and "'d_model'" in err and "Traceback" not in err
    # the reader is gone before marge writes a line (`| true`): marge's own exit status and no traceback
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m services.cli info --preset tiny | true; "
                                         "echo status ${PIPESTATUS[0]}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "status 0" and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


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
