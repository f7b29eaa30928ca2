"""The SandboxFusion listener's HTTP app: ``POST /run_code`` and ``GET /v1/ping``, behind a token.

Owns authentication (``Authorization: Bearer TOKEN``, or HTTP basic auth with the token as its password, for
clients that take only a URL: ``http://dsec:TOKEN@host:port``, which SandboxFusion's client and verl's
``sandbox_fusion_url`` pass on unchanged) and the HTTP shapes: a body SandboxFusion would refuse gets
FastAPI's 422 naming the field, as theirs. It must never run code itself (:mod:`dsec.fusion.runner`).
"""

# no ``from __future__ import annotations``: FastAPI reads the endpoint's annotations, which name a local
# dependency
import base64
import binascii
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from dsec.daemon.audit import caller
from dsec.e2b.keys import Keys, Principal
from dsec.errors import Unauthorized

from .runner import FusionRunner
from .wire import RunCodeRequest, RunCodeResponse

__all__ = ["create_fusion_app"]


def _key(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        with contextlib.suppress(binascii.Error, UnicodeDecodeError):
            return base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
    return ""


def create_fusion_app(runner: FusionRunner, keys: Keys) -> FastAPI:
    """The ASGI app of one SandboxFusion listener over ``runner``; ``keys`` says who a token is."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runner.start()
        try:
            yield
        finally:
            await runner.aclose()

    app = FastAPI(title="DSec SandboxFusion-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def principal(request: Request) -> Principal:  # async: the audit's caller is set in the request's task
        found = keys.principal(_key(request)) if _key(request) else None
        if found is None:
            raise Unauthorized("a DSec token is required: send 'Authorization: Bearer TOKEN', or put it in the URL "
                               "as basic auth's password (http://dsec:TOKEN@host:port)")
        caller.set(f"sandbox-fusion:{found.name}")
        return found

    @app.exception_handler(Unauthorized)
    async def _unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=401,
                            headers={"WWW-Authenticate": 'Basic realm="dsec", Bearer'})

    @app.get("/v1/ping")
    async def ping() -> str:
        """SandboxFusion's liveness check."""
        return "pong"

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code(body: RunCodeRequest, who: Annotated[Principal, Depends(principal)]) -> RunCodeResponse:
        """Run one program (SandboxFusion's ``/run_code``) in a function sandbox of its own."""
        with keys.acting(who):
            return await runner.run_code(body, who.job)

    return app
