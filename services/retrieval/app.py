"""The retrieval service: search the newest committed index by text or by document id.

    GET  /healthz        liveness and the version served (no token needed)
    GET  /v1/index       index and snapshot version, documents, languages, limits
    POST /v1/search      {"query": "..."} or {"doc_id": 42}, with "k" and an optional "lang"
    GET  /docs           OpenAPI documentation (/openapi.json)

Every search response names the index version and snapshot step that answered it. Limits (k, query
length, body size, requests in flight) answer with 4xx/503 errors that say what was wrong. With a
token configured, /v1/*, /docs and /openapi.json need `Authorization: Bearer <token>` (the API's
description is not shown to whoever reaches the port).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import threading
from typing import cast

import numpy as np
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

import marge.util.net
from marge import __version__
from services.retrieval.settings import ServeSettings
from services.retrieval.version_index import IndexHolder

log = logging.getLogger(__name__)


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str | None = Field(None, min_length=1, description="text to embed and search for")
    doc_id: int | None = Field(None, ge=0, description="search for the neighbours of this corpus document")
    k: int = Field(10, ge=1, description="number of results (at most the service's max_k)")
    lang: str | None = Field(None, min_length=2, max_length=2, description="only documents in this ISO 639-1 language")


class Hit(BaseModel):
    doc_id: int
    score: float
    lang: str
    group: str
    text: str


class SearchResponse(BaseModel):
    index_version: int
    snapshot_step: int
    query_doc_id: int | None = None
    results: list[Hit]


class BodySizeLimit:
    """Reject request bodies over `limit` bytes with 413, whatever the Content-Length claims.

    FastAPI does not enforce a body limit itself (fastapi#16338). The middleware reads the body first
    (it is small by definition: at most `limit` bytes are ever held) and hands the app a replay of it.
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(send, f"{int(declared)} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._reject(send, f"more than {self.limit} bytes")
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _reject(self, send, size: str):
        body = f'{{"detail":"request body of {size} is over the limit of {self.limit} bytes"}}'.encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict], receive):
    """Give the app the buffered messages, then the live connection (e.g. to notice a disconnect)."""
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def create_app(settings: ServeSettings, holder: IndexHolder | None = None) -> FastAPI:
    holder = holder or IndexHolder(settings.run_dir, settings.corpus_dir, settings.poll_s, settings.index_choice(),
                                   settings.text_cache_mb, settings.verify_corpus, settings.full_corpus)
    in_flight = threading.BoundedSemaphore(settings.max_in_flight)
    bearer = HTTPBearer(auto_error=False)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        holder.start()
        yield
        holder.stop()

    public_docs = settings.token is None  # with a token, the API's description is behind it too
    app = FastAPI(title="MARGE retrieval service", version=__version__, lifespan=lifespan,
                  description="Search the newest committed MARGE index by text or by document id.",
                  docs_url="/docs" if public_docs else None, redoc_url="/redoc" if public_docs else None,
                  openapi_url="/openapi.json" if public_docs else None)
    app.state.holder = holder
    app.state.in_flight = in_flight

    def authorize(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if settings.token is None:
            return
        if credentials is None:
            raise HTTPException(401, "missing bearer token: send `Authorization: Bearer <token>`",
                                headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(credentials.credentials.encode(), settings.token.encode()):
            raise HTTPException(401, "wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    if not public_docs:
        from fastapi.openapi.docs import get_swagger_ui_html

        @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authorize)])
        def openapi() -> dict:
            return app.openapi()

        @app.get("/docs", include_in_schema=False, dependencies=[Depends(authorize)])
        def docs():
            return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.get("/healthz")
    def healthz() -> dict:
        current = holder.current
        return {"status": "ok" if current else "loading",
                "index_version": current.version if current else None,
                "snapshot_step": current.snapshot_step if current else None}

    @app.get("/v1/index", dependencies=[Depends(authorize)])
    def index_info() -> dict:
        current = holder.current
        if current is None:
            raise HTTPException(503, "the index is still loading; retry shortly", headers={"Retry-After": "1"})
        return {"index_version": current.version, "snapshot_step": current.snapshot_step,
                "created_unix": current.created_unix, "documents": current.documents, "dim": current.dim,
                "index_type": current.kind, "recall_at_10": current.recall_at_10,
                "languages": holder.languages, "swaps": holder.swaps, "metric": "cosine",
                "limits": {"max_k": settings.max_k, "max_query_chars": settings.max_query_chars,
                           "max_body_bytes": settings.max_body_bytes}}

    @app.post("/v1/search", response_model=SearchResponse, dependencies=[Depends(authorize)])
    def search(request: SearchRequest) -> SearchResponse:
        if (request.query is None) == (request.doc_id is None):
            raise HTTPException(422, "give exactly one of `query` (text) or `doc_id`")
        if request.k > settings.max_k:
            raise HTTPException(422, f"k={request.k} is over this service's limit of {settings.max_k}")
        if request.query is not None:
            if len(request.query) > settings.max_query_chars:
                raise HTTPException(422, f"query has {len(request.query)} characters; the limit is {settings.max_query_chars}")
            if not request.query.strip():
                raise HTTPException(422, "query is blank")
        if request.lang is not None and request.lang not in holder.languages:
            raise HTTPException(422, f"lang {request.lang!r} is not in this corpus (it has {holder.languages})")
        if not in_flight.acquire(blocking=False):
            raise HTTPException(503, "too many searches in flight; retry shortly", headers={"Retry-After": "1"})
        try:
            current, docs = holder.current, holder.docs  # one version answers the whole request
            if current is None or docs is None:
                raise HTTPException(503, "the index is still loading; retry shortly", headers={"Retry-After": "1"})
            vector: np.ndarray | None
            if request.query is not None:
                vector, exclude = current.embed(request.query), None
            else:
                # exactly one of query and doc_id is given (checked above): here it is doc_id
                vector, exclude = current.vector_of(cast(int, request.doc_id)), request.doc_id
                if vector is None:
                    raise HTTPException(404, f"doc_id {request.doc_id} is not in index v{current.version}")
            hits = current.search(vector, request.k, request.lang, exclude)
            results = [Hit(score=score, **docs.describe(doc_id, settings.snippet_chars)) for doc_id, score in hits]
            return SearchResponse(index_version=current.version, snapshot_step=current.snapshot_step,
                                  query_doc_id=request.doc_id, results=results)
        finally:
            in_flight.release()

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError):
        return JSONResponse(status_code=422, content={"detail": str(exc)})

    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    return app


is_loopback = marge.util.net.is_loopback  # `marge serve` asks it whether a bind needs a token (one rule everywhere)
