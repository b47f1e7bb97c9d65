"""TLS, with a self-signed certificate authority made here (openssl): the batch queue over `rediss://` to a real
redis-server serving TLS only, and `marge serve` over HTTPS. Nothing in the project changes for the first: the
URL carries the CA (`?ssl_ca_certs=...`)."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_queue import fill  # tests/integration/test_queue.py
from test_service import build_run, free_port  # tests/integration/test_service.py

from marge.contracts.protocol import BatchQueue
from marge.contracts.slots import CommitRecord, Slots

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    """A CA, and a certificate for 127.0.0.1 it signed."""
    d = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=marge-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")
    return d


def test_the_batch_queue_runs_over_tls_with_the_ca_in_the_url(certificates, tmp_path):
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--requirepass", "pw",
         "--tls-cert-file", str(certificates / "server.pem"), "--tls-key-file", str(certificates / "server.key"),
         "--tls-ca-cert-file", str(certificates / "ca.pem"), "--tls-auth-clients", "no", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"rediss://:pw@127.0.0.1:{port}/0?ssl_ca_certs={certificates / 'ca.pem'}&ssl_cert_reqs=required"
        q = BatchQueue.connect(url, "tls", Slots(1, 1))
        deadline = time.time() + 10
        while True:
            try:
                q.r.ping()
                break
            except Exception:  # noqa: BLE001 - starting
                if time.time() > deadline:
                    raise
                time.sleep(0.1)
        fill(q, range(3))
        assert q.get(0, block_ms=10).batch.batch_id == "v0-e0-s0-0"
        assert q.commit(0, 1, [(0, CommitRecord.of(1, 0, [(0, "v0-e0-s0-0")]))]) == [] and q.counts()["trained"] == 1
        import redis

        with pytest.raises(redis.ConnectionError):  # the plain protocol is not served
            redis.Redis.from_url(f"redis://:pw@127.0.0.1:{port}/0", socket_timeout=2).ping()
        with pytest.raises(redis.ConnectionError):  # a certificate no trusted CA signed is refused
            redis.Redis.from_url(f"rediss://:pw@127.0.0.1:{port}/0?ssl_cert_reqs=required", socket_timeout=2).ping()
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.slow
def test_the_service_serves_https_with_its_certificate(certificates, small_corpus, tmp_path):
    run = tmp_path / "run"
    build_run(run, small_corpus, version=0, seed=0)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MARGE_API_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--run", str(run), "--port", str(port),
                             "--tls-cert", str(certificates / "server.pem"), "--tls-key", str(certificates / "server.key"),
                             "--poll-s", "0.2"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        base, deadline = f"https://127.0.0.1:{port}", time.time() + 60
        trusted = ssl.create_default_context(cafile=str(certificates / "ca.pem"))
        while True:
            try:
                if httpx.get(f"{base}/healthz", verify=trusted, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:] if proc.poll() else ""
            time.sleep(0.2)
        r = httpx.post(f"{base}/v1/search", json={"query": "Datei", "k": 2}, verify=trusted)
        assert r.status_code == 200 and len(r.json()["results"]) == 2
        with pytest.raises(httpx.ConnectError):  # no CA given: the self-signed chain is not trusted
            httpx.get(f"{base}/healthz", timeout=2)
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_certificate_without_its_key_is_refused_before_anything_starts(certificates, tmp_path):
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--run", str(tmp_path), "--tls-cert",
                           str(certificates / "server.pem")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--tls-cert and --tls-key go together" in done.stderr
