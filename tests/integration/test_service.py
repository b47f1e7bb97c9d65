"""The retrieval service against a real uvicorn server on loopback (and once through Ray Serve)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from services.driver.redis_server import free_port

TOKEN = "test-token-0123456789"


def build_run(run: Path, corpus_dir: Path, version: int, seed: int) -> None:
    """Publish a snapshot and commit index `version` built with it, like the pipeline does."""
    from marge.contracts.corpus import Corpus
    from marge.model.architecture import preset
    from marge.model.network import Marge
    from marge.model.snapshot import load_relevance_encoder, publish_snapshot
    from services.indexer.config import IndexerConfig
    from services.indexer.core import index_corpus

    corpus = Corpus.open(corpus_dir)
    tok = corpus.tokenizer()
    torch.manual_seed(seed)
    model = Marge(preset("tiny", vocab_size=tok.vocab_size, max_positions=128))
    snap = publish_snapshot(run / "snapshots", model, 10 * version, tok.sha256)
    index_corpus(corpus, load_relevance_encoder(snap), tok.specials, run / "index", version, 10 * version,
                 IndexerConfig())
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"corpus": str(corpus_dir)}}))


@pytest.fixture(scope="module")
def served(small_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("served") / "run"
    build_run(run, small_corpus, version=0, seed=0)
    token_file = run / "token"
    token_file.write_text(TOKEN)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MARGE_API_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--run", str(run), "--port", str(port),
                             "--token-file", str(token_file), "--max-k", "20", "--max-query-chars", "500",
                             "--max-body-bytes", "2048", "--poll-s", "0.2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"marge serve did not start: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    yield {"base": base, "run": run, "corpus": small_corpus}
    proc.terminate()
    proc.wait(timeout=10)


def auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


def search(served, body, headers=None, **kw):
    return httpx.post(f"{served['base']}/v1/search", json=body, headers=auth() if headers is None else headers,
                      timeout=30, **kw)


def test_health_info_and_openapi(served):
    health = httpx.get(f"{served['base']}/healthz").json()
    assert health["status"] == "ok" and health["index_version"] >= 0
    info = httpx.get(f"{served['base']}/v1/index", headers=auth()).json()
    assert info["documents"] > 100 and "de" in info["languages"] and info["limits"]["max_k"] == 20
    spec = httpx.get(f"{served['base']}/openapi.json", headers=auth()).json()
    assert "/v1/search" in spec["paths"]
    assert httpx.get(f"{served['base']}/docs", headers=auth()).status_code == 200
    for path in ("/openapi.json", "/docs", "/redoc"):  # with a token, the API's description is behind it
        assert httpx.get(f"{served['base']}{path}").status_code in (401, 404), path


def test_search_by_text_by_doc_id_and_by_language(served):
    r = search(served, {"query": "Wählen Sie Datei - Öffnen", "k": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert {"index_version", "snapshot_step", "results"} <= set(body) and len(body["results"]) == 5
    scores = [h["score"] for h in body["results"]]
    assert scores == sorted(scores, reverse=True) and all(-1.0001 <= s <= 1.0001 for s in scores)
    doc = body["results"][0]["doc_id"]
    r = search(served, {"doc_id": doc, "k": 3, "lang": "zh"})
    assert r.status_code == 200 and all(h["lang"] == "zh" and h["doc_id"] != doc for h in r.json()["results"])
    assert search(served, {"doc_id": 10**9, "k": 3}).status_code == 404


def test_a_documents_own_text_finds_that_document_first(served):
    """Self-retrieval through the whole service: a document's text, embedded by the service, finds the vector the
    indexer stored for that document (cosine 1), ahead of every other document."""
    from marge.contracts.corpus import Corpus

    corpus = Corpus.open(served["corpus"])
    tokenizer = corpus.tokenizer()
    shard = corpus.read_shard(0)
    # documents whose text the tokenizer turns back into the very tokens the corpus holds, short enough for a query
    chosen = [i for i in range(len(shard)) if len(shard.texts[i]) <= 500
              and tokenizer.encode(shard.texts[i]) == shard.tokens[i].tolist()][:8]
    assert len(chosen) >= 5
    for i in chosen:
        r = search(served, {"query": shard.texts[i], "k": 3})
        assert r.status_code == 200, r.text
        top = r.json()["results"][0]
        assert top["doc_id"] == int(shard.doc_ids[i]) and top["score"] > 0.999, (i, r.json()["results"])


@pytest.mark.parametrize("body, status, message", [
    ({"query": "cells", "k": 0}, 422, "greater than or equal to 1"),
    ({"query": "cells", "k": -1}, 422, "greater than or equal to 1"),
    ({"query": "cells", "k": 21}, 422, "k=21 is over this service's limit of 20"),
    ({"query": "cells", "k": "abc"}, 422, "valid integer"),
    ({"query": "", "k": 3}, 422, "at least 1 character"),
    ({"query": "   ", "k": 3}, 422, "query is blank"),
    ({"query": "x" * 501}, 422, "query has 501 characters; the limit is 500"),
    ({"query": "cells", "doc_id": 1}, 422, "exactly one of"),
    ({"k": 3}, 422, "exactly one of"),
    ({"query": "cells", "colour": "red"}, 422, "Extra inputs are not permitted"),
    ({"query": "cells", "lang": "sw"}, 422, "lang 'sw' is not in this corpus"),
])
def test_bad_requests_get_4xx_that_say_what_was_wrong(served, body, status, message):
    r = search(served, body)
    assert r.status_code == status and message in r.text, r.text


def test_oversized_bodies_get_413(served):
    r = search(served, {"query": "cells " * 400})
    assert r.status_code == 413 and "over the limit of 2048 bytes" in r.text
    chunks = (b"x" * 1024 for _ in range(4))  # no Content-Length: the middleware counts the bytes
    r = httpx.post(f"{served['base']}/v1/search", content=chunks, headers={**auth(), "content-type": "application/json"})
    assert r.status_code == 413


def test_missing_or_wrong_token_is_401(served):
    assert search(served, {"query": "cells"}, headers={}).status_code == 401
    r = search(served, {"query": "cells"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and "wrong bearer token" in r.text
    assert httpx.get(f"{served['base']}/v1/index").status_code == 401


def test_a_new_version_is_swapped_in_under_traffic_without_a_failed_request(served):
    versions, failures = [], []
    stop = threading.Event()

    def client():
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = c.post(f"{served['base']}/v1/search", json={"query": "Tabelle einfügen", "k": 5}, headers=auth())
                if r.status_code != 200:
                    failures.append(r.status_code)
                else:
                    versions.append(r.json()["index_version"])

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    build_run(served["run"], served["corpus"], version=1, seed=1)  # the indexer commits v1 meanwhile
    deadline = time.time() + 60
    while time.time() < deadline and (not versions or versions[-1] != 1):
        time.sleep(0.2)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert failures == []
    assert 0 in versions and 1 in versions and versions[-1] == 1
    assert httpx.get(f"{served['base']}/healthz").json()["snapshot_step"] == 10


def test_refuses_a_public_bind_without_a_token(served, capsys):
    from services.cli import main

    env_token = os.environ.pop("MARGE_API_TOKEN", None)
    try:
        assert main(["serve", "--run", str(served["run"]), "--host", "0.0.0.0"]) == 2
    finally:
        if env_token is not None:
            os.environ["MARGE_API_TOKEN"] = env_token
    assert "refusing to serve on 0.0.0.0 without a token" in capsys.readouterr().err
    from services.cli import build_parser

    assert build_parser().parse_args(["serve", "--run", "x"]).host == "127.0.0.1"
    empty = served["run"] / "empty-token"
    empty.write_text("\n")
    assert main(["serve", "--run", str(served["run"]), "--token-file", str(empty)]) == 2
    assert f"--token-file {empty} is empty" in capsys.readouterr().err


def test_a_search_over_the_in_flight_limit_gets_503_and_the_next_one_is_served(served):
    from fastapi.testclient import TestClient

    from services.retrieval.app import create_app
    from services.retrieval.settings import ServeSettings

    app = create_app(ServeSettings(run_dir=served["run"], corpus_dir=served["corpus"], token=TOKEN, max_in_flight=1))
    body = {"query": "Tabellen und Diagramme", "k": 3}
    with TestClient(app) as client:
        deadline = time.time() + 30
        while client.get("/healthz").json()["status"] != "ok" and time.time() < deadline:
            time.sleep(0.1)
        assert client.post("/v1/search", json=body, headers=auth()).status_code == 200
        assert app.state.in_flight.acquire(blocking=False)  # one search in flight: the limit
        try:
            busy = client.post("/v1/search", json=body, headers=auth())
        finally:
            app.state.in_flight.release()
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
        assert "too many searches in flight" in busy.json()["detail"]
        assert client.post("/v1/search", json=body, headers=auth()).status_code == 200


def test_deployable_with_ray_serve(ray_cluster, served):
    from ray import serve

    from services.retrieval.app import ServeSettings
    from services.retrieval.ray_serve import deployment

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(deployment(ServeSettings(run_dir=served["run"], corpus_dir=served["corpus"], token=TOKEN)),
                  name="marge-retrieval", route_prefix="/")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/search", json={"query": "cells", "k": 3}, headers=auth(), timeout=60)
        assert r.status_code == 200 and len(r.json()["results"]) == 3
    finally:
        serve.shutdown()


def test_loopback_is_an_address_not_a_name_that_starts_with_127():
    from marge.util.net import is_loopback

    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("127.example.com", "0.0.0.0", "10.0.0.1", "example.com", "::", "192.168.1.5"):
        assert not is_loopback(host), host


# --- the index layer: one copy of the vectors, index type by size, text read on demand --------------------------


def centred_run(run: Path, corpus_dir: Path, seed: int) -> None:
    """`build_run` with a model whose g is centred (`model.relevance_centering`) on the corpus's own mean, as a
    trained model's running centre would be: documents spread over the sphere instead of sharing one direction, so
    that nearest neighbours mean something (an uncentred untrained g puts every document within 0.01 degree)."""
    from marge.contracts.batch import as_encoder_input
    from marge.contracts.corpus import Corpus
    from marge.model.architecture import preset
    from marge.model.layers import pad_rows
    from marge.model.network import Marge
    from marge.model.snapshot import load_relevance_encoder, publish_snapshot
    from services.indexer.config import IndexerConfig
    from services.indexer.core import index_corpus

    corpus = Corpus.open(corpus_dir)
    tok = corpus.tokenizer()
    torch.manual_seed(seed)
    model = Marge(preset("tiny", vocab_size=tok.vocab_size, max_positions=128, relevance_centering=True)).eval()
    tokens = [t[:100] for t in corpus.read_shard(0).tokens[:256]]
    with torch.no_grad():
        model.relevance_center.copy_(model.relevance_vectors(
            pad_rows([as_encoder_input(t, tok.specials) for t in tokens], tok.specials.pad_id)).mean(0))
    snap = publish_snapshot(run / "snapshots", model, 10, tok.sha256)
    index_corpus(corpus, load_relevance_encoder(snap), tok.specials, run / "index", 0, 10, IndexerConfig())
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"corpus": str(corpus_dir)}}))


@pytest.fixture(scope="module")
def one_version(small_corpus, tmp_path_factory):
    from marge.contracts.corpus import Corpus
    from marge.contracts.index_store import latest_version

    run = tmp_path_factory.mktemp("index-layer") / "run"
    build_run(run, small_corpus, version=0, seed=3)
    corpus = Corpus.open(small_corpus)
    return run, corpus, latest_version(run / "index")


def exact_neighbours(version, query, k, lang_ids=None):
    """Exact top-k scores by inner product over every shard's stored vectors (optionally within `lang_ids`)."""
    import faiss
    import numpy as np

    ids, scores = [], []
    for entry in version.shards:
        index = version.read_faiss(entry["shard"])
        flat = faiss.downcast_index(index.index)
        ids.append(faiss.vector_to_array(index.id_map))
        scores.append(flat.reconstruct_n(0, flat.ntotal) @ query)
    ids, scores = np.concatenate(ids), np.concatenate(scores)
    if lang_ids is not None:
        keep = np.isin(ids, lang_ids)
        ids, scores = ids[keep], scores[keep]
    return np.sort(scores)[::-1][:k]


def test_flat_search_is_exact_in_every_language_and_holds_the_vectors_once(one_version):
    import numpy as np

    from services.retrieval.version_index import DocumentTable, IndexChoice, LoadedIndex

    run, corpus, version = one_version
    docs = DocumentTable(corpus, cache_mb=0)
    loaded = LoadedIndex(version, run, corpus, corpus.tokenizer(), docs, IndexChoice("auto"))
    assert loaded.kind == "flat" and loaded.recall_at_10 is None
    assert loaded.index.ntotal == len(loaded.ids) == len(docs.ids)
    assert not hasattr(loaded, "vectors") and not hasattr(docs, "texts")  # no second copy, no corpus text held
    rng = np.random.default_rng(0)
    for doc_id in rng.choice(loaded.ids, size=5, replace=False):
        query = loaded.vector_of(int(doc_id))
        hits = loaded.search(query, 10)  # scores equal exact search's (ids may swap among near-ties)
        assert hits[0][0] == doc_id and np.allclose([s for _, s in hits], exact_neighbours(version, query, 10), atol=1e-5)
        for lang in ("de", "zh"):
            lang_ids = docs.ids[docs.lang == docs.lang_names.index(lang)]
            found = loaded.search(query, 10, lang=lang)
            assert np.allclose([s for _, s in found], exact_neighbours(version, query, 10, lang_ids), atol=1e-5)
            assert all(docs.describe(d, 50)["lang"] == lang for d, _ in found)
    assert loaded.vector_of(10**9) is None


def test_hnsw_is_built_above_the_flat_limit_and_its_recall_is_measured(one_version):
    import numpy as np

    from services.retrieval.version_index import DocumentTable, IndexChoice, LoadedIndex

    run, corpus, version = one_version
    docs = DocumentTable(corpus)
    loaded = LoadedIndex(version, run, corpus, corpus.tokenizer(), docs,
                         IndexChoice("auto", flat_max_documents=100, hnsw_ef_search=64, recall_queries=100))
    assert loaded.kind == "hnsw" and loaded.recall_at_10 is not None and loaded.recall_at_10 >= 0.9
    query = loaded.vector_of(int(loaded.ids[7]))
    assert np.allclose(query, exact_query := loaded.index.reconstruct(int(loaded.ids[7])))
    found = [d for d, _ in loaded.search(exact_query, 10, lang="de")]
    assert found and all(docs.describe(d, 50)["lang"] == "de" for d in found)


def test_document_text_is_read_from_its_shard_within_the_cache_budget(one_version):
    from services.retrieval.version_index import DocumentTable

    _, corpus, _ = one_version
    docs = DocumentTable(corpus, cache_mb=0)  # keeps only the shard read last
    shard0, shard1 = corpus.read_shard(0), corpus.read_shard(1)
    first = docs.describe(int(shard0.doc_ids[3]), 10_000)
    assert first["text"] == shard0.texts[3] and first["lang"] == shard0.langs[3]
    assert docs.describe(int(shard1.doc_ids[0]), 10_000)["text"] == shard1.texts[0]
    assert len(docs.text._cache) == 1 and docs.text.reads == 2
    assert docs.describe(int(shard0.doc_ids[3]), 5)["text"] == shard0.texts[3][:5] + "…"
    assert docs.text.reads == 3  # read again: the budget held one shard
    with pytest.raises(KeyError, match="doc id 1000000000 is not in the corpus"):
        docs.describe(10**9, 10)


def test_the_app_carries_no_corpus_until_it_serves_and_the_corpus_is_checked_against_its_manifest(one_version,
                                                                                                  tmp_path):
    """An app built in a driver and shipped to a Ray Serve replica (pickled) holds settings, not the document table;
    at start the shards' document counts are checked against the manifest without hashing them."""
    import json
    import shutil

    import pyarrow.parquet as pq

    from marge.contracts.corpus import CorpusError
    from services.retrieval.app import ServeSettings, create_app
    from services.retrieval.version_index import IndexHolder

    run, corpus, _ = one_version
    app = create_app(ServeSettings(run_dir=run, corpus_dir=tmp_path / "not-there-yet"))  # opens nothing
    holder = app.state.holder
    assert holder.corpus is None and holder.docs is None and holder.tokenizer is None

    copy = tmp_path / "corpus"
    shutil.copytree(corpus.root, copy)
    first = copy / corpus.shards[0].file
    table = pq.read_table(first)
    pq.write_table(table.slice(0, table.num_rows - 1), first)  # one document fewer than the manifest says
    holder = IndexHolder(run, copy)
    with pytest.raises(CorpusError, match=rf"{table.num_rows - 1} documents, but the corpus manifest lists"):
        holder.start()
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["shards"][0]["rows"] == table.num_rows


def test_a_serving_index_of_the_whole_corpus_is_compressed_finds_what_exact_search_finds_and_is_served(
        one_version, tmp_path):
    """`marge index build`: every corpus document in an IVF index with 8-bit codes, its recall measured at build;
    `marge serve --full-corpus` answers from it (text, doc id and language searches)."""
    import json

    import numpy as np

    from marge.model.snapshot import latest_snapshot
    from services.retrieval.serving_index import FullCorpusIndex, read_build
    from services.retrieval.version_index import DocumentTable


    corpus = one_version[1]
    run = tmp_path / "run"
    centred_run(run, corpus.root, seed=5)
    built = subprocess.run([sys.executable, "-m", "services.cli", "index", "build", "--run", str(run),
                            "--target-recall", "0.9"], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    result = json.loads(built.stdout.strip().splitlines()[-1])
    manifest = read_build(Path(result["path"]))  # checksums verified
    assert manifest["documents"] == corpus.manifest["num_documents"] and manifest["recall_at_10"] >= 0.9
    assert manifest["index_bytes"] < 0.5 * manifest["vector_bytes"]
    assert manifest["snapshot_step"] == latest_snapshot(run / "snapshots").step

    docs = DocumentTable(corpus)
    full = FullCorpusIndex(Path(result["path"]), run, corpus, corpus.tokenizer(), docs)
    rng = np.random.default_rng(0)
    assert full.documents == len(docs.ids)
    picked = rng.choice(docs.ids, size=40, replace=False)
    found = 0
    for doc_id in picked:  # a document's own vector finds it first, as exact search would
        hits = full.search(full.vector_of(int(doc_id)), 10)
        found += int(hits[0][0] == doc_id)
        lang = docs.lang_names[docs.langs_of(np.array([doc_id]))[0]]
        in_lang = full.search(full.vector_of(int(doc_id)), 5, lang=lang, exclude=int(doc_id))
        assert in_lang and all(docs.lang_names[docs.langs_of(np.array([d]))[0]] == lang and d != doc_id
                               for d, _ in in_lang)
    assert found >= 36

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--run", str(run), "--port", str(port),
                             "--full-corpus", "--poll-s", "0.2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={k: v for k, v in os.environ.items() if k != "MARGE_API_TOKEN"})
    try:
        deadline = time.time() + 60
        while True:
            try:
                info = httpx.get(f"http://127.0.0.1:{port}/v1/index", timeout=1)
                if info.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.time() < deadline, "marge serve --full-corpus did not answer"
            time.sleep(0.2)
        assert info.json()["index_type"].startswith("full corpus") and info.json()["documents"] == manifest["documents"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/search", json={"query": "cells", "k": 3, "lang": "de"}, timeout=30)
        assert r.status_code == 200 and [h["lang"] for h in r.json()["results"]] == ["de"] * 3
    finally:
        proc.terminate()
        proc.wait(timeout=10)
