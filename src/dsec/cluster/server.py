"""``python -m dsec.cluster gateway``: serve the gateway over HTTP, and the jobs file it reads.

Owns the job table (a job is a bearer token with quotas) and the auth middleware that turns a request's
token into its job for the engine; the routes are the node daemon's own (``daemon.app.create_app``).

Jobs file (JSON)::

    {"admin_token": "...",                      # sees and manages every job's sandboxes
     "jobs": {"rl-job-1": {"token": "...", "max_live": 32000, "max_rate": 2000,
                           "burst": 32000}}}              # creations at once (default: max_live)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import secrets
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from dsec.api.binding import FastPath
from dsec.cluster.cells import CellLeases
from dsec.cluster.front import lean_protocol
from dsec.cluster.gateway import GatewayEngine, NodeSource, current_job, current_token
from dsec.cluster.placement import JobQuota
from dsec.cluster.router import ReplicaRouter, was_forwarded
from dsec.cluster.state import ClusterState
from dsec.cluster.surface import PortFronts, ports_address
from dsec.daemon.app import create_app
from dsec.daemon.auth import open_path
from dsec.daemon.server import loop_factory
from dsec.errors import InvalidRequest, Unauthorized

__all__ = ["Jobs", "gateway_app", "gateway_config", "main"]

log = logging.getLogger(__name__)


@dataclass
class Jobs:
    """Token -> job name, and each job's quota."""

    by_token: dict[str, str]
    quotas: dict[str, JobQuota]

    @classmethod
    def load(cls, path: Path) -> Jobs:
        """Read a jobs file; a malformed one is an InvalidRequest naming what is wrong."""
        try:
            raw: Any = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidRequest(f"cannot read the jobs file {path}: {exc}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("jobs", {}), dict):
            raise InvalidRequest(f"jobs file {path}: expected {{\"admin_token\": ..., \"jobs\": {{name: {{...}}}}}}")
        by_token: dict[str, str] = {}
        quotas: dict[str, JobQuota] = {}
        if raw.get("admin_token"):
            by_token[str(raw["admin_token"])] = "admin"
        for name, job in raw.get("jobs", {}).items():
            if not isinstance(job, dict) or not isinstance(job.get("token"), str) or len(job["token"]) < 16:
                raise InvalidRequest(f"jobs file {path}: job {name!r} needs a 'token' of at least 16 characters")
            if job["token"] in by_token:
                raise InvalidRequest(f"jobs file {path}: job {name!r} reuses another job's token")
            by_token[job["token"]] = str(name)
            for key in ("max_live", "max_rate", "burst"):
                value = job.get(key)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
                                          or (key != "max_rate" and not isinstance(value, int))):
                    kind = "a positive number" if key == "max_rate" else "a positive whole number"
                    raise InvalidRequest(f"jobs file {path}: job {name!r}: {key!r} must be {kind}, got {value!r}")
            quotas[str(name)] = JobQuota(max_live=job.get("max_live"), max_rate=job.get("max_rate"),
                                         burst=job.get("burst"))
        if not by_token:
            raise InvalidRequest(f"jobs file {path} names no token: the gateway would refuse every request")
        return cls(by_token, quotas)


class _JobGuard:
    """Bearer token -> job (into :data:`current_job`); unknown tokens get 401. Pure ASGI (streams work)."""

    def __init__(self, app: ASGIApp, jobs: Jobs) -> None:
        self.app = app
        self.jobs = jobs

    def caller(self, scope: Scope) -> tuple[str, str] | None:
        """The job and token of a request's bearer token, or None when it names no job."""
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        token = given.decode("latin-1").removeprefix("Bearer ")
        job = None
        for known, name in self.jobs.by_token.items():
            if secrets.compare_digest(token, known):
                job = name
        return None if job is None else (job, token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "GET" and open_path(scope["path"])):
            await self.app(scope, receive, send)  # health and the dashboard's static files
            return
        caller = self.caller(scope)
        if caller is None:
            err = Unauthorized("missing or unknown job token: send 'Authorization: Bearer <token>' (DSEC_TOKEN)")
            await JSONResponse(err.to_payload(), status_code=err.status_code)(scope, receive, send)
            return
        reset, reset_token = current_job.set(caller[0]), current_token.set(caller[1])
        try:
            await self.app(scope, receive, send)
        finally:
            current_job.reset(reset)
            current_token.reset(reset_token)


@dataclass
class _Admission:
    """Which requests the gateway's lean protocol answers (:mod:`dsec.cluster.front`): a fast operation of a
    caller the job guard admits, that the replica router would not pass on; as the layers it skips would, it
    sets the caller's job and token (and, for a request another replica passed on, that it was)."""

    fast: FastPath
    guard: _JobGuard
    router: ReplicaRouter | None

    def admit(self, scope: dict[str, Any]) -> Callable[[], Callable[[], None]] | None:
        caller = self.guard.caller(scope)
        if caller is None:
            return None
        forwarded = self.router is not None and self.router.passed_on(scope)
        if self.router is not None and not forwarded and not self.router.serves_here(scope):
            return None
        job, token = caller

        def enter() -> Callable[[], None]:
            resets = current_job.set(job), current_token.set(token), was_forwarded.set(forwarded)

            def leave() -> None:
                current_job.reset(resets[0])
                current_token.reset(resets[1])
                was_forwarded.reset(resets[2])

            return leave

        return enter


def gateway_app(engine: GatewayEngine, jobs: Jobs) -> FastAPI:
    """The node API served over the gateway engine, behind job authentication (and, with replicas, the
    router that passes calls for another replica's sandboxes on to it)."""
    return _gateway(engine, jobs)[0]


def _gateway(engine: GatewayEngine, jobs: Jobs) -> tuple[FastAPI, _Admission]:
    """The gateway's app, and what its lean protocol may answer without it."""
    parts: list[_Admission] = []

    def guard(inner: ASGIApp) -> ASGIApp:
        # In front of FastAPI's middleware stack (see daemon.app): a create or destroy pays for these layers only.
        assert isinstance(inner, FastPath)
        router = ReplicaRouter(inner, routing=engine) if engine.keeper is not None else None
        outer = _JobGuard(router or inner, jobs)
        parts.append(_Admission(inner, outer, router))
        return outer

    app = create_app(engine, guard=guard)
    app.title = "DSec cluster gateway API"
    return app, parts[0]


def gateway_config(engine: GatewayEngine, jobs: Jobs, host: str, port: int) -> uvicorn.Config:
    """The gateway's uvicorn configuration: its app, on the lean protocol for the fast operations."""
    app, admission = _gateway(engine, jobs)
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=30, backlog=4096,
                          http=lean_protocol(admission))


async def _serve(args: argparse.Namespace, source: NodeSource, jobs: Jobs) -> None:
    state = await asyncio.to_thread(ClusterState, args.db, args.sync_commit)
    host, _, port = args.listen.rpartition(":")
    name = args.name or f"{socket.gethostname()}:{port}"
    leases = CellLeases(args.db, name=name, instance=f"{name}/{secrets.token_hex(4)}",
                        url=args.advertise or f"http://{host}:{port}", cells=args.cells, ttl=args.lease_ttl)
    engine = GatewayEngine(state, source, quotas=jobs.quotas, admission_wait=args.admission_wait, leases=leases)
    engine.port_fronts = PortFronts(*ports_address(host, args.advertise))
    # Serving while the cells' rows are read: a restarted gateway takes creates within seconds.
    await engine.start(settle=False)
    config = gateway_config(engine, jobs, host, int(port))
    servers = [uvicorn.Server(config)]
    if args.e2b is not None:
        servers.append(uvicorn.Server(_e2b_config(args, engine, jobs)))
    if args.sandbox_fusion is not None:
        servers.append(uvicorn.Server(_fusion_config(args, engine, jobs)))
    try:
        await asyncio.gather(*(server.serve() for server in servers))
    finally:
        await engine.aclose()


def _e2b_config(args: argparse.Namespace, engine: GatewayEngine, jobs: Jobs) -> uvicorn.Config:
    """The gateway's E2B listener: API keys are the jobs' tokens, each job sees its own sandboxes."""
    from dsec.e2b.options import E2BOptions
    from dsec.e2b.serve import gateway_app as e2b_gateway_app
    from dsec.e2b.serve import uvicorn_settings

    options = E2BOptions(listen=args.e2b, domain=args.e2b_domain, tls_cert=args.e2b_tls_cert,
                         tls_key=args.e2b_tls_key, default_image=args.e2b_default_image,
                         secret_file=args.e2b_secret_file)

    app = e2b_gateway_app(engine, options, jobs.by_token, _set_job)
    host, port = options.address
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=30,
                          **uvicorn_settings(options))


def _set_job(job: str) -> Callable[[], None]:
    token = current_job.set(job)
    return lambda: current_job.reset(token)


def _fusion_config(args: argparse.Namespace, engine: GatewayEngine, jobs: Jobs) -> uvicorn.Config:
    """The gateway's SandboxFusion listener: keys are the jobs' tokens, each request runs on a node the gateway
    places it on (warm pools are the nodes': ``--pool debian-python:function:workdir=/workspace``)."""
    from dsec.fusion.options import FusionOptions, RunnerSettings
    from dsec.fusion.serve import gateway_app as fusion_gateway_app

    options = FusionOptions(args.sandbox_fusion, RunnerSettings(image=args.sandbox_fusion_image))
    host, port = options.address
    return uvicorn.Config(fusion_gateway_app(engine, options, jobs.by_token, _set_job), host=host, port=port,
                          log_level="warning", timeout_keep_alive=30)


_FULL_COLLECTION_AFTER = 1000
"""Middle-generation collections between two full ones (CPython's default: 10). The gateway holds a row per
live sandbox, created after its start froze what it loaded: each full collection walks all of them, and at
the default a 32,000 batch at 2,000 nodes ran six, 3.4 s of its 4.9 s of CPU. Young cycles (a request's
frames and exceptions) are still collected by the young generations."""


def _tune_collector() -> None:
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, _FULL_COLLECTION_AFTER)


def main(argv: list[str] | None = None) -> int:
    """Parse options, join the Ray cluster and serve the gateway until SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m dsec.cluster", description="DSec cluster gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("gateway", help="serve the gateway in the foreground")
    p.add_argument("--listen", default="127.0.0.1:7070", help="HOST:PORT to serve on")
    p.add_argument("--db", required=True, help="PostgreSQL URL of the gateway state (postgresql://...)")
    p.add_argument("--jobs", type=Path, required=True, help="jobs file (tokens and quotas)")
    p.add_argument("--ray-address", default="auto", help="Ray cluster to join (default: auto)")
    p.add_argument("--nodes-from", default=None, metavar="URL",
                   help="read membership from this URL (a JSON list of nodes: the fleet simulator's "
                        "/fleet/membership, or an inventory service) instead of running node daemons on Ray")
    p.add_argument("--node-config", type=Path, default=None, help="JSON of NodeConfig fields for node daemons")
    p.add_argument("--admission-wait", type=float, default=60.0, help="seconds a create may wait for room")
    p.add_argument("--name", default=None,
                   help="this replica's name (default HOSTNAME:PORT), unique among live replicas: one starting "
                        "under a name takes the cells of the name's previous instance at once")
    p.add_argument("--advertise", default=None, metavar="URL",
                   help="the URL other replicas reach this one at (default http://LISTEN)")
    p.add_argument("--cells", type=int, default=8,
                   help="cells the nodes are split into, shared out between the replicas (the same on every replica)")
    p.add_argument("--lease-ttl", type=float, default=8.0,
                   help="seconds a replica's lease on a cell lasts unless renewed (a dead replica's cells are "
                        "taken over after about this long)")
    p.add_argument("--sync-commit", action="store_true",
                   help="wait for PostgreSQL to flush every state commit to disk (default: a PostgreSQL crash "
                        "may lose the last ~0.6 s of state; a gateway crash loses nothing either way)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--e2b", default=None, metavar="HOST:PORT", help="also serve E2B's API (keys: the jobs' tokens)")
    p.add_argument("--e2b-domain", default=None, help="E2B_DOMAIN of the clients (api.DOMAIN, PORT-ID.DOMAIN)")
    p.add_argument("--e2b-tls-cert", type=Path, default=None, help="PEM certificate for HTTPS")
    p.add_argument("--e2b-tls-key", type=Path, default=None, help="PEM key (default: in the certificate)")
    p.add_argument("--e2b-default-image", default="debian-python", help="image of the 'base' template")
    p.add_argument("--e2b-secret-file", type=Path, default=None,
                   help="key of the envd access tokens (created 0600; default: a fresh key per start)")
    p.add_argument("--sandbox-fusion", default=None, metavar="HOST:PORT",
                   help="also serve SandboxFusion's /run_code (keys: the jobs' tokens)")
    p.add_argument("--sandbox-fusion-image", default="debian-python", help="the image /run_code runs on")
    args = parser.parse_args(argv)
    if args.cells < 1 or args.lease_ttl <= 0:
        parser.error("--cells must be at least 1 and --lease-ttl more than 0")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded request otherwise
    _tune_collector()
    try:
        jobs = Jobs.load(args.jobs)
    except InvalidRequest as exc:
        print(f"dsec gateway: {exc}", file=sys.stderr)
        return 2
    if args.nodes_from:
        from dsec.cluster.membership import HttpNodes

        try:
            source = HttpNodes(args.nodes_from)
        except InvalidRequest as exc:
            print(f"dsec gateway: {exc}", file=sys.stderr)
            return 2
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(_serve(args, source, jobs))
        return 0
    import ray

    from dsec.cluster.ray_nodes import NAMESPACE, NodeConfig, RayNodes

    config = NodeConfig(**json.loads(args.node_config.read_text())) if args.node_config else NodeConfig()
    ray.init(address=args.ray_address, namespace=NAMESPACE, log_to_driver=False)
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop: cheaper per request
            runner.run(_serve(args, RayNodes(config), jobs))
    finally:
        ray.shutdown()
    return 0
