"""The cluster gateway: the node API (`/v1`, the same FastAPI app) over many nodes.

Owns: which node each sandbox lives on (placement through :class:`~dsec.cluster.placement.Placer`), jobs
(a job is a token; its quotas), membership (a node source says which nodes are alive; a node that dies has
its sandboxes marked ``lost`` with the reason) and the durable record of all of it
(:class:`~dsec.cluster.state.ClusterState`). Create answers carry the owning node's URL and a token scoped
to the sandbox, so the SDK sends exec and file calls straight to the node: the gateway forwards them only
for clients that do not follow the endpoint (curl). It must never run sandboxes itself.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import contextvars
import errno
import gc
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import TypeAdapter

from dsec._sdk.lean import LeanError, LeanPool
from dsec._sdk.transport import STREAM_TIMEOUT, Transport, build_request_parts, read_chunks
from dsec.cluster.authority import Authority
from dsec.cluster.cells import CellLeases, cell_of
from dsec.cluster.placement import Capacity, JobQuota, Placer
from dsec.cluster.records import LIVE, Records, Row, shape_of
from dsec.cluster.replica import CellKeeper, adopt_rows
from dsec.cluster.state import ClusterState, NodeRow
from dsec.daemon.audit import AuditQuery
from dsec.daemon.auth import JOB_LABEL, scoped_token
from dsec.daemon.engine import dsec_version
from dsec.daemon.events import EventBus
from dsec.errors import (
    BackendUnavailable,
    ConnectionFailed,
    DaemonStopping,
    DSecError,
    Forbidden,
    NotSupported,
    SandboxLost,
    SandboxNotFound,
    SandboxTimeout,
)
from dsec.models import (
    AuditEntry,
    BatchCreateRequest,
    CallRequest,
    CallResult,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    ImageBuildEvent,
    ImageBuildRequest,
    ImageInfo,
    ImagePullRequest,
    KeyboardRequest,
    LifecycleEvent,
    LoggedCall,
    MouseRequest,
    NodeEndpoint,
    NodeInfo,
    NodeLoad,
    NodeOverview,
    NodeStatistics,
    PoolConfig,
    PoolStatistics,
    SandboxInfo,
    SandboxSpec,
    SandboxStats,
    SnapshotRef,
    TimeoutRequest,
    TrajectoryForkRequest,
)

__all__ = ["BATCH_LABEL", "GatewayEngine", "NodeFacts", "NodeSource", "current_job"]

log = logging.getLogger(__name__)

current_job: contextvars.ContextVar[str] = contextvars.ContextVar("dsec_job", default="default")
"""The job of the request being served (set from its token by the gateway's auth middleware)."""

BATCH_LABEL = "dsec.batch"
"""The label the gateway stamps on every member of a batch (its id): a replica that takes a cell over
destroys the members of batches their replica left unfinished."""


@dataclass(frozen=True)
class NodeFacts:
    """What membership reports of one node: alive or not, and how to reach its daemon."""

    name: str
    alive: bool
    url: str | None = None
    token: str | None = None
    capacity: dict[str, Any] | None = None
    reason: str | None = None


NodeSource = Callable[[], Awaitable[builtins.list[NodeFacts]]]
"""Polled by the gateway: every node membership knows of (Ray in production, a list in unit tests)."""


# Drop idle connections to a node before its uvicorn does (5 s keep-alive): reusing one the server is
# closing at that instant fails the request ("Server disconnected without sending a response").
_NODE_LIMITS = httpx.Limits(max_connections=200, max_keepalive_connections=50, keepalive_expiry=2.0)
_HEALTH_TIMEOUT = httpx.Timeout(5.0)
_PROBE_TIMEOUT = httpx.Timeout(2.0)
_PLACE_ROUNDS = 4
"""A create whose node took none of it is placed again at most this many times (nodes going down one
after another; each round places nothing on the nodes that failed before)."""
_INFO_LIST = TypeAdapter(builtins.list[SandboxInfo])


_NODE_DOWN = frozenset({errno.ECONNREFUSED, errno.ENOENT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT})
"""Connect errors that say the node daemon is not there; others (EMFILE, EADDRNOTAVAIL...) are the gateway's."""


def _took_none(exc: BaseException) -> bool:
    """Whether a node's failed create (on the lean pool, as :meth:`GatewayEngine._reaching` passes it on) left
    nothing on it because of the node: its daemon refused it as it stopped and says it kept nothing
    (``kept=0``: a call cut off at its graceful timeout has no such promise), or the node did not take the
    connection (refused, or no answer within the connect timeout: nothing was sent). A connection lost
    mid-call may have made sandboxes, and a connect that failed on the gateway's side says nothing of the
    node: not these."""
    if not isinstance(exc, BackendUnavailable):
        return False
    if exc.detail.get("lease") == "lost":  # this replica found its lease gone before sending anything
        return True
    cause = exc.__cause__
    if isinstance(cause, DaemonStopping):
        return cause.detail.get("kept") == 0
    if isinstance(cause, ConnectionFailed) and isinstance(cause.__cause__, LeanError):
        inner = cause.__cause__
        why = inner.__cause__
        return inner.kind == "connect" and (isinstance(why, TimeoutError)
                                            or (isinstance(why, OSError) and why.errno in _NODE_DOWN))
    return False


class _Metrics:
    def __init__(self, gateway: GatewayEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.nodes = Gauge("dsec_cluster_nodes_alive", "Nodes alive", registry=self.registry)
        self.live = Gauge("dsec_cluster_sandboxes_live", "Sandboxes placed and alive", registry=self.registry)
        self.waiting = Gauge("dsec_cluster_admission_waiting", "Creates waiting for room", registry=self.registry)
        self.queued = Gauge("dsec_cluster_admission_queued", "Creates that waited for room since start",
                            registry=self.registry)
        self.images = Gauge("dsec_cluster_node_image_cached", "1 for each image a live node's cache holds",
                            ["node", "image"], registry=self.registry)
        self.replaced = Counter("dsec_cluster_creates_replaced",
                                "Sandboxes placed again on another node because theirs took none (stopping "
                                "or not answering)", registry=self.registry)
        self.unready = Gauge("dsec_cluster_nodes_unready",
                             "Nodes alive for Ray on which nothing is placed until their daemon serves again",
                             registry=self.registry)
        self._gateway = gateway

    def render(self) -> bytes:
        g = self._gateway
        self.nodes.set(sum(1 for n in g.placer.nodes.values() if n.alive))
        self.live.set(g.records.live)
        stats = g.placer.statistics()
        self.unready.set(len(g.unready))
        self.waiting.set(int(str(stats["waiting"])))
        self.queued.set(int(str(stats["queued"])))
        self.images.clear()
        for node in g.placer.nodes.values():
            for image in node.images if node.alive else ():
                self.images.labels(node.name, image).set(1)
        return generate_latest(self.registry)


class GatewayEngine:
    """Engine-shaped (the daemon's ``create_app`` serves it): every method places or forwards."""

    def __init__(
        self,
        state: ClusterState,
        nodes: NodeSource,
        *,
        quotas: dict[str, JobQuota] | None = None,
        admission_wait: float = 60.0,
        poll_interval: float = 0.5,
        image_interval: float = 5.0,
        leases: CellLeases | None = None,
    ) -> None:
        self.state = state
        self.source = nodes
        self.placer = Placer()
        self.placer.quotas.update(quotas or {})
        self.admission_wait = admission_wait
        self.poll_interval = poll_interval
        self.image_interval = image_interval
        cells = leases.cells if leases is not None else 1
        self.records = Records(cell_of=lambda node: cell_of(node, cells))
        """The sandboxes of this replica's cells: narrow rows with their indexes and counters."""
        self.authority = Authority(leases, self.records, self.placer)
        self.keeper = CellKeeper(self, leases) if leases is not None else None
        """The lease loop when gateway replicas share the nodes in cells (None: this gateway places on all)."""
        self._creating: collections.Counter[int] = collections.Counter()
        """Cell -> creates in flight on its nodes (a cell is handed back only when none are)."""
        self.reconciled_by_digest = 0
        """Nodes whose records were found true by their count and digest alone (a counter)."""
        self.node_rows: dict[str, NodeRow] = {}
        self.metrics = _Metrics(self)
        self._transports: dict[str, tuple[Transport, httpx.AsyncClient, LeanPool]] = {}
        self._reconciled: set[str] = set()
        self.unready: dict[str, str] = {}
        """Nodes Ray sees alive whose daemon took no create (stopping, or no connection opened) -> why;
        nothing is placed there until its ``/v1/health`` answers that it serves again (each poll asks)."""
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._resyncs: dict[str, asyncio.Task[None]] = {}
        self.events = EventBus("gateway", history=10_000)
        """The nodes' lifecycle events merged, with a history of its own (``/v1/events?since=``)."""
        self._poller: asyncio.Task[None] | None = None
        self._image_poller: asyncio.Task[None] | None = None
        self._lease_loop: asyncio.Task[None] | None = None
        self._last_report: builtins.list[NodeFacts] | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Reload nodes and sandboxes from the database, then follow membership."""
        for node in await asyncio.to_thread(self.state.nodes):
            self.node_rows[node.name] = node
        if self.keeper is not None:
            await self.keeper.leases.setup()
            await self.keeper.tick()  # takes this replica's share of the cells over, rows and nodes included
            self._lease_loop = asyncio.create_task(self.keeper.forever())  # renewing while the rest starts
            await self.keeper.settle()
        else:
            for node in self.node_rows.values():
                self.know(node)
            loaded = adopt_rows(self, await asyncio.to_thread(lambda: builtins.list(self.state.rows())))
            # The rows stay for the gateway's life: out of the collector's way, so a full collection does not
            # walk 380,000 of them.
            gc.collect()
            gc.freeze()
            log.info("reloaded %d sandbox row(s), %d live", loaded, self.records.live)
            # The node daemons outlive a gateway restart at the addresses recorded: reconcile them before the
            # first request (membership, which may take a poll or two to answer, then only confirms them).
            await asyncio.gather(*(self.rejoin(node) for node in builtins.list(self.node_rows.values())
                                   if node.alive))
        await self.poll()
        await self.refresh_images()
        self._poller = asyncio.create_task(self._poll_forever())
        self._image_poller = asyncio.create_task(self._refresh_images_forever())

    def know(self, node: NodeRow) -> None:
        """Account ``node`` in placement, usable only once reconciled (its rows may be adopted into it)."""
        if node.name not in self.placer.nodes:
            self.placer.set_node(node.name, _capacity(node.capacity), usable=False)

    async def release_node(self, node: str) -> None:
        """This replica no longer places on ``node`` (its cell went to another replica)."""
        await self._unfollow(node)
        self._reconciled.discard(node)
        self.unready.pop(node, None)

    async def lose_dead(self, node: NodeRow) -> None:
        """A node of a cell just taken over is dead: its sandboxes still live in the records are lost."""
        self.know(node)
        if any(self.records.rows[sid].state in LIVE for sid in self.records.on_node(node.name)):
            await self._node_died(node, node.reason or "it died while no replica held its cell")

    async def destroy_rows(self, ids: builtins.list[str]) -> None:
        """Destroy sandboxes of this replica's records on their nodes, whatever their job."""
        asking = asyncio.Semaphore(64)

        async def one(sid: str) -> None:
            async with asking:
                row = self.records.rows.get(sid)
                if row is not None:
                    with contextlib.suppress(DSecError):
                        await self._destroy(sid, row)

        await asyncio.gather(*(one(sid) for sid in ids))

    # -- routing between replicas (dsec.cluster.router) ------------------------------------------------------

    def holds(self, sandbox_id: str) -> bool:
        """Whether this replica has a record of the sandbox."""
        return self.keeper is None or sandbox_id in self.records.rows

    async def owners_of(self, sandbox_id: str) -> builtins.list[str]:
        """The replicas that may hold ``sandbox_id``: the owner of its node's cell, or (its row not committed
        yet, or the owner unknown) every other live replica."""
        if self.keeper is None:
            return []
        leases = self.keeper.leases
        node = await asyncio.to_thread(self.state.locate, sandbox_id)
        if node is not None:
            owner = leases.owners.get(self.authority.cell(node))
            if owner is not None and owner[0] == leases.instance:
                return []
            url = leases.owner_url(self.authority.cell(node))
            if url is not None:
                return [url]
        return self.other_replicas()

    def other_replicas(self) -> builtins.list[str]:
        """URLs of the other live replicas."""
        if self.keeper is None:
            return []
        leases = self.keeper.leases
        return [url for instance, url in sorted(leases.peers.items()) if instance != leases.instance]

    def places(self) -> bool:
        """Whether this replica places on any node now."""
        return any(node.alive for node in self.placer.nodes.values())

    def creating_in(self, cell: int) -> int:
        """Creates in flight on the nodes of ``cell``."""
        return self._creating.get(cell, 0)

    async def aclose(self) -> None:
        """Stop following membership and close node connections (sandboxes are left running)."""
        for task in (self._poller, self._image_poller, self._lease_loop):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for name in builtins.list(self._followers):
            await self._unfollow(name)
        for name in builtins.list(self._transports):
            await self._drop_client(name)
        if self.keeper is not None:
            with contextlib.suppress(DSecError):
                await self.keeper.leases.leave()
            await self.keeper.leases.aclose()
        await self.state.aclose()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.poll()
            except Exception:
                log.exception("membership poll failed")

    async def _refresh_images_forever(self) -> None:
        while True:
            # Each round asks every node this replica places on; at most ~100 asks a second on big fleets (the
            # cache a create lands on is noted at once; only evictions wait for a round).
            await asyncio.sleep(max(self.image_interval, len(self._reconciled) / 100))
            try:
                await self.refresh_images()
            except Exception:
                log.exception("image cache poll failed")

    async def refresh_images(self) -> None:
        """Image locality from the nodes' own caches: each live node's ``/v1/health`` lists the images its
        chunk cache holds, which replaces what placement believed (a node that evicted an image loses it)."""
        async def one(name: str) -> None:
            try:
                response = await self._node_request(name, "GET", "/v1/health", timeout=_HEALTH_TIMEOUT)
                info = NodeInfo.model_validate_json(response.content)
            except (DSecError, ValueError) as exc:  # a dying node: membership deals with it
                log.debug("image cache of %s unknown: %s", name, exc)
                return
            node = self.placer.nodes.get(name)
            if node is not None and node.alive:
                self.placer.set_images(name, info.images)

        await asyncio.gather(*(one(n.name) for n in builtins.list(self.placer.nodes.values())
                               if n.alive and n.name in self.node_rows))

    async def poll(self) -> None:
        """Apply one membership report: new nodes are used at once; dead nodes' sandboxes become lost; an
        unready node is used again once its daemon says it serves (its records reconciled first)."""
        back, report = await asyncio.gather(self._serving_again(), self.source())
        if report is self._last_report and not back and not self._unsettled():
            return  # the same report as last time (the source said nothing changed), and nothing to redo
        self._last_report = report
        for facts in report:
            known = self.node_rows.get(facts.name)
            if facts.alive and facts.url and facts.token:
                row = NodeRow(facts.name, facts.url, facts.token, True, facts.capacity or {}, None)
                if known is None or (known.url, known.token, known.alive) != (row.url, row.token, True):
                    await self.state.writer.put_node(row)
                    await self._unfollow(facts.name)
                    await self._drop_client(facts.name)
                    self._reconciled.discard(facts.name)
                    self.unready.pop(facts.name, None)
                    log.info("node %s joined at %s", facts.name, facts.url)
                self.node_rows[facts.name] = row
                if not self.authority.mine(facts.name):
                    continue  # another replica's cell (or one this replica still takes over)
                self.know(row)
                if facts.name in self.unready:
                    if facts.name not in back:
                        continue
                    # Its daemon may have restarted: what it holds now is the truth the records follow.
                    del self.unready[facts.name]
                    self._reconciled.discard(facts.name)
                    log.info("node %s serves again", facts.name)
                if facts.name not in self._reconciled:
                    self.placer.set_node(facts.name, _capacity(row.capacity), usable=False)
                    # Before placement may use it: what the node holds is the truth the records follow.
                    try:
                        await self.reconcile(facts.name)
                    except DSecError as exc:
                        log.warning("node %s: its sandboxes could not be listed yet (%s); retrying", facts.name,
                                    exc)
                        continue
                    self._reconciled.add(facts.name)
                    self._follow(facts.name)
                self.placer.set_node(facts.name, _capacity(row.capacity))
            elif not facts.alive and known is not None and known.alive:
                if self.authority.mine(facts.name) or self.keeper is None:
                    await self._node_died(known, facts.reason or "Ray reports the node dead")
                else:
                    known.alive, known.reason = False, facts.reason

    def _unsettled(self) -> bool:
        """Whether some node this replica should place on is not placed on yet (reconcile to retry)."""
        return any(self.authority.mine(name) and row.alive and name not in self._reconciled
                   for name, row in self.node_rows.items())

    async def _serving_again(self) -> set[str]:
        """The unready nodes whose ``/v1/health`` answers that their daemon serves (not stopping)."""
        async def serves(name: str) -> bool:
            try:
                response = await self._node_request(name, "GET", "/v1/health", timeout=_PROBE_TIMEOUT)
                info = NodeInfo.model_validate_json(response.content)
            except (DSecError, ValueError) as exc:
                log.debug("node %s is not back yet: %s", name, exc)
                return False
            if info.stopping is not None:
                self.unready[name] = f"its daemon is stopping ({info.stopping})"
                return False
            return True

        names = [name for name in self.unready if name in self.node_rows and self.node_rows[name].alive]
        answers = await asyncio.gather(*(serves(name) for name in names))
        return {name for name, ok in zip(names, answers, strict=True) if ok}

    def _hold(self, node: str, why: str) -> None:
        """``node`` took no create: place nothing more there until its daemon serves again (see :meth:`poll`)."""
        self.placer.mark_dead(node)
        row = self.node_rows.get(node)
        if row is None or not row.alive:  # dead meanwhile: membership owns it, nothing to probe
            return
        if node not in self.unready:
            log.warning("node %s takes no creates for now (%s): placing on the other nodes until it serves "
                        "again", node, why)
        self.unready[node] = why

    async def _node_died(self, node: NodeRow, reason: str) -> None:
        node.alive, node.reason = False, reason
        self.unready.pop(node.name, None)
        self.placer.mark_dead(node.name)
        await self._unfollow(node.name)
        await self.state.writer.put_node(node)
        why = f"node {node.name} died: {reason}"
        lost: list[tuple[str, Row]] = []
        freed: collections.Counter[tuple[str, Any]] = collections.Counter()
        for sid in self.records.on_node(node.name):
            row = self.records.rows[sid]
            if row.state in LIVE:
                freed[row.job, row.shape] += 1
                lost.append((sid, self.records.set_state(sid, "lost", why) or row))
        for (job, shape), count in freed.items():
            self.placer.release(job, node.name, shape, count)
        await self.state.writer.put_rows(lost)
        log.warning("node %s died (%s): %d sandbox(es) lost", node.name, reason, len(lost))

    async def rejoin(self, node: NodeRow) -> None:
        """Reconcile ``node`` (under this replica's fence), follow it, and place on it from now on."""
        self.know(node)
        try:
            await self.reconcile(node.name)
        except DSecError as exc:
            log.warning("node %s does not answer at %s yet (%s): membership decides", node.name, node.url, exc)
            return
        self._reconciled.add(node.name)
        self._follow(node.name)
        self.placer.set_node(node.name, _capacity(node.capacity))

    async def reconcile(self, node: str) -> None:
        """Make the records of ``node`` follow what it holds (at gateway start and when a node joins).

        A create is answered before its record is committed, so a gateway that crashed in between has no
        row for a sandbox the node made: the node's record carries the job (the ``dsec.job`` label the
        gateway stamps on every spec), so it is adopted here, with its quota and capacity. A record whose
        sandbox the node no longer holds ended while the gateway was away: an expired one keeps its
        reason (the job is told ``SandboxTimeout``), a destroyed one is forgotten."""
        # Under this replica's fence: the node refuses creates a previous owner of its cell still sends, so
        # what it says now stays the truth the records follow.
        health = NodeInfo.model_validate_json((await self._node_request(
            node, "GET", "/v1/health", timeout=_HEALTH_TIMEOUT, headers=self.authority.fence(node))).content)
        if health.placed is not None and (health.placed, health.digest) == self.records.digest(node):
            self.reconciled_by_digest += 1
            return  # the node holds exactly what the records say: no listing
        response = await self._node_request(node, "GET", "/v1/sandboxes", timeout=_HEALTH_TIMEOUT)
        held = {info.id: info for info in _INFO_LIST.validate_json(response.content)}
        adopted = []
        for info in held.values():
            job = info.labels.get(JOB_LABEL)
            if info.id in self.records.rows or job is None:  # known, or not created through the gateway
                continue
            self.placer.adopt(job, node, info.spec)
            adopted.append((info.id, self._new_row(info, node, job)))
        if adopted:
            log.warning("node %s: adopted %d sandbox(es) the gateway had no record of", node, len(adopted))
            for sid, row in adopted:
                self.records.put(sid, row)
            await self.state.writer.put_rows(adopted)
            doomed = [sid for sid, row in adopted if row.batch is not None and row.batch in self.authority.aborted]
            if doomed:  # members of a batch another replica left unfinished
                await self.destroy_rows(doomed)
        gone = [sid for sid in self.records.on_node(node)
                if self.records.rows[sid].state in LIVE and sid not in held]
        asking = asyncio.Semaphore(32)

        async def why_gone(sid: str) -> None:
            async with asking:
                try:
                    await self._node_request(node, "GET", f"/v1/sandboxes/{sid}", timeout=_HEALTH_TIMEOUT)
                except SandboxTimeout as exc:
                    self._ended(sid, exc.message)
                except SandboxNotFound:
                    self._ended(sid, None)

        await asyncio.gather(*(why_gone(sid) for sid in gone))

    def _ended(self, sid: str, expired: str | None) -> None:
        """The node says the sandbox is gone: free its room; keep an expired one (with the reason) so its job
        is told why, forget a destroyed one."""
        row = self.records.rows.get(sid)
        if row is None:
            return
        if row.state in LIVE:
            self.placer.release(row.job, row.node, row.shape)
        if expired is None:
            self.records.remove(sid)
            self.state.writer.submit_delete([sid])
            return
        self.state.writer.submit_rows([(sid, self.records.set_state(sid, "expired", expired) or row)])

    # -- node plumbing ------------------------------------------------------------------------------------

    def _entry(self, node: str) -> tuple[Transport, httpx.AsyncClient, LeanPool]:
        entry = self._transports.get(node)
        if entry is None:
            row = self.node_rows[node]
            transport = Transport(row.url, row.token)
            entry = self._transports[node] = (transport, transport.build(_NODE_LIMITS),
                                              transport.build_lean(max_connections=200, keepalive_expiry=2.0))
        return entry

    def _client(self, node: str) -> tuple[Transport, httpx.AsyncClient]:
        transport, http, _lean = self._entry(node)
        return transport, http

    async def _drop_client(self, node: str) -> None:
        entry = self._transports.pop(node, None)
        if entry is not None:
            await entry[1].aclose()
            await entry[2].aclose()

    @contextlib.contextmanager
    def _reaching(self, node: str) -> Iterator[None]:
        try:
            yield
        except DaemonStopping as exc:  # a ConnectionFailed too: the same reason to translate it
            raise BackendUnavailable(f"node {node} is stopping ({exc.message}); its sandboxes stay, and it takes "
                                     "calls again once it is back", node=node) from exc
        except ConnectionFailed as exc:
            # Not the client's ConnectionFailed (that would read as "the gateway is down").
            raise BackendUnavailable(
                f"node {node} does not answer ({exc.message}); if it died, Ray reports it and its sandboxes "
                "are marked lost within seconds", node=node) from exc

    async def _node_request(self, node: str, method: str, path: str, **kw: Any) -> httpx.Response:
        transport, http = self._client(node)
        with self._reaching(node):
            return await transport.request(http, method, path, **kw)

    async def _node_post(self, node: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
        """POST serialised JSON to a node on its lean pool (the create hot path); the answer's body."""
        transport, _http, lean = self._entry(node)
        with self._reaching(node):
            return await transport.post_json(lean, path, body, timeout=STREAM_TIMEOUT, headers=headers)

    def _any_node(self) -> str:
        alive = sorted(n.name for n in self.placer.nodes.values() if n.alive)
        if not alive:
            raise BackendUnavailable("no live node in the cluster")
        return alive[0]

    def _row(self, sandbox_id: str) -> Row:
        row = self._mine(sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
        if row.state == "lost":
            raise SandboxLost(row.reason or "its node died", sandbox_id=sandbox_id, node=row.node)
        if row.state == "expired":
            raise SandboxTimeout(row.reason or f"sandbox {sandbox_id} passed its timeout and was destroyed",
                                 sandbox_id=sandbox_id)
        return row

    def _mine(self, sandbox_id: str) -> Row | None:
        """The row of ``sandbox_id`` if the request's job may see it (admin sees all)."""
        row = self.records.rows.get(sandbox_id)
        job = current_job.get()
        return row if row is not None and (row.job == job or job == "admin") else None

    @contextlib.contextmanager
    def _on_node(self, sandbox_id: str) -> Iterator[None]:
        """Around a call to the row's node: its answer that the sandbox expired or is gone updates the row."""
        try:
            yield
        except SandboxTimeout as exc:
            self._ended(sandbox_id, exc.message)
            raise
        except SandboxNotFound:
            self._ended(sandbox_id, None)
            raise

    def _with_endpoint(self, info: SandboxInfo, node: str) -> SandboxInfo:
        url = self.node_rows[node].url
        token = scoped_token(self.node_rows[node].token, info.id)
        return info.model_copy(update={"endpoint": NodeEndpoint(url=url, token=token)})

    def _new_row(self, info: SandboxInfo, node: str, job: str, spec: bytes | None = None) -> Row:
        """The row of a sandbox a node made (``spec``: the JSON the node was sent, when the caller has it)."""
        raw = self.records.intern(spec if spec is not None else info.spec.model_dump_json().encode())
        detail = info.model_dump_json(exclude={"endpoint"}).encode() if info.trajectory is not None else None
        return Row(node, job, info.state, shape_of(info.spec), raw, info.created_at,
                   info.trajectory.name if info.trajectory is not None else None, info.reason, detail,
                   info.spec.labels.get(BATCH_LABEL))

    async def _remember(self, infos: builtins.list[SandboxInfo], node: str, job: str, *,
                        durable: bool = True, spec: bytes | None = None) -> builtins.list[SandboxInfo]:
        """Record sandboxes a node made (``spec``: the JSON it was sent); ``durable=False`` answers before the
        commit (the node's own record carries the job label, from which :meth:`reconcile` rebuilds a row a
        gateway crash lost)."""
        rows = [(info.id, self._new_row(info, node, job, spec)) for info in infos]
        for sid, row in rows:
            self.records.put(sid, row)
        if infos and infos[0].image:
            self.placer.add_image(node, infos[0].image)
        if durable:
            await self.state.writer.put_rows(rows)
        else:
            self.state.writer.submit_rows(rows)
        return [self._with_endpoint(info, node) for info in infos]

    # -- control plane ------------------------------------------------------------------------------------

    async def health(self) -> NodeInfo:
        """The cluster as one node: a backend is ``ok`` when any live node runs it."""
        backends: dict[str, str] = {}
        for node in self.placer.nodes.values():
            for name, slots in node.capacity.slots.items():
                if node.alive and slots > 0:
                    backends[name] = "ok"
        return NodeInfo(node="gateway", version=dsec_version(), backends=backends, sandboxes=self.records.live)

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Place one sandbox (a trajectory re-attaches on its live node, else is rebuilt anywhere)."""
        job = current_job.get()
        spec = _stamped(spec, job)
        if spec.trajectory is not None:
            sid = self.records.trajectory(spec.trajectory)
            row = self.records.rows.get(sid or "")
            if row is not None and row.state in ("running", "paused") and row.job == job:
                response = await self._node_request(row.node, "POST", "/v1/sandboxes",
                                                    json_body=spec.model_dump(mode="json"))
                return (await self._remember([SandboxInfo.model_validate(response.json())], row.node, job))[0]
        return (await self._create_placed(spec, 1, job))[0]

    async def create_many(self, request: BatchCreateRequest) -> builtins.list[SandboxInfo]:
        """Place a batch in one decision, create each node's share in one request; all or nothing."""
        job = current_job.get()
        return await self._create_placed(_stamped(request.spec, job), request.count, job)

    async def _create_placed(self, spec: SandboxSpec, count: int, job: str) -> builtins.list[SandboxInfo]:
        """Place, create each node's share, and place again the shares of nodes that took none of theirs
        (their daemon stopping, or no connection opened): a rolling restart of node daemons costs a job
        nothing. Any other failure undoes the whole batch. With replicas, a batch is recorded open before
        its first create and done before it is answered (see :mod:`dsec.cluster.cells`)."""
        deadline = time.monotonic() + self.admission_wait
        batch = None
        if count > 1 and self.keeper is not None:
            batch = "bt-" + secrets.token_hex(8)
            spec = spec.model_copy(update={"labels": {**spec.labels, BATCH_LABEL: batch}})
        body = spec.model_dump_json().encode()
        created: builtins.list[SandboxInfo] = []
        try:
            counts = await self._place(spec, count, job, deadline)
            if batch is not None:
                try:
                    await self.authority.open_batch(batch, job, count, builtins.list(counts))
                except BaseException:
                    self._give_back(job, spec, counts)
                    raise
            await self._create_rounds(spec, body, job, counts, deadline, created)
            if batch is not None and not await self.authority.close_batch(batch, done=True):
                raise BackendUnavailable("another gateway replica took over a cell of this batch before it was "
                                         "answered: it was undone, nothing of it is kept")
        except BaseException:  # a share failed, or the client left while placing again: undo every round
            await asyncio.gather(*(self.destroy(info.id) for info in created), return_exceptions=True)
            if batch is not None:
                with contextlib.suppress(DSecError):
                    await self.authority.close_batch(batch, done=False)
            raise
        return created

    async def _place(self, spec: SandboxSpec, count: int, job: str, deadline: float) -> dict[str, int]:
        """A placement within the job's quota (rate tokens drawn, allowances reserved): node -> count. One that
        lands in a cell whose lease this replica just lost is made again without that cell."""
        await self.authority.draw_tokens(job, count)
        for attempt in range(3):
            try:
                return await self._place_once(spec, count, job, deadline)
            except BackendUnavailable as exc:
                if exc.detail.get("lease") != "lost" or attempt == 2 or self.keeper is None:
                    raise
                for node in self.keeper.nodes_in(int(exc.detail["cell"])):
                    self.placer.mark_dead(node)  # the lease loop settles the cell at its next round
                self.placer.refund(job, count)
        raise AssertionError("unreachable")

    async def _place_once(self, spec: SandboxSpec, count: int, job: str, deadline: float) -> dict[str, int]:
        placement = await self.placer.place(spec, count, job, max(0.0, deadline - time.monotonic()))
        for node, n in placement.counts.items():  # from here on, its cells are not handed back under it
            self._creating[self.authority.cell(node)] += n
        try:
            await self.authority.admit(job, placement.counts)  # settled share by share (_share_done)
        except BaseException:
            for node, n in placement.counts.items():
                self.placer.release(job, node, spec, n)
                cell = self.authority.cell(node)
                self._creating[cell] -= n
                if self._creating[cell] <= 0:
                    del self._creating[cell]
            raise
        return placement.counts

    def _give_back(self, job: str, spec: SandboxSpec, counts: dict[str, int]) -> None:
        """A placement none of which was sent: its room, reservations and in-flight counts go back."""
        for node, n in counts.items():
            self.placer.release(job, node, spec, n)
            self._share_done(job, node, n)

    def _share_done(self, job: str, node: str, n: int) -> None:
        cell = self.authority.cell(node)
        self._creating[cell] -= n
        if self._creating[cell] <= 0:
            del self._creating[cell]
        self.authority.settle(job, {cell: n})

    async def _create_rounds(self, spec: SandboxSpec, body: bytes, job: str, counts: dict[str, int],
                             deadline: float, created: builtins.list[SandboxInfo]) -> None:
        """Each node's share in one request, placed again (at most a few rounds) where a node took none."""

        async def on(node: str, n: int) -> builtins.list[SandboxInfo]:
            try:
                headers = self.authority.fence(node)
                # Serialized once by pydantic's Rust core and parsed the same way: no dict round trip.
                if n == 1:
                    infos = [SandboxInfo.model_validate_json(await self._node_post(node, "/v1/sandboxes", body,
                                                                                   headers))]
                else:
                    batch = BatchCreateRequest(count=n, spec=spec).model_dump_json().encode()
                    infos = _INFO_LIST.validate_json(await self._node_post(node, "/v1/sandboxes/batch", batch,
                                                                           headers))
            except BaseException as exc:
                if isinstance(exc, BackendUnavailable) and exc.detail.get("lease") == "lost":
                    for other in self.keeper.nodes_in(self.authority.cell(node)) if self.keeper else ():
                        self.placer.mark_dead(other)  # the lease loop drops the cell at its next round
                elif _took_none(exc):  # held before its room is given back: that room must not draw waiters
                    self._hold(node, str(exc))
                self.placer.release(job, node, spec, n)
                self._share_done(job, node, n)
                raise
            try:
                return await self._remember(infos, node, job, durable=False, spec=body)
            finally:
                self._share_done(job, node, n)

        for round_ in range(1, _PLACE_ROUNDS + 1):
            results = await asyncio.gather(*(on(node, n) for node, n in counts.items()), return_exceptions=True)
            created += [info for r in results if not isinstance(r, BaseException) for info in r]
            errors = [r for r in results if isinstance(r, BaseException)]
            missed = [(node, n, r) for (node, n), r in zip(counts.items(), results, strict=True)
                      if isinstance(r, BackendUnavailable) and _took_none(r)]
            if not errors:
                return
            if len(missed) < len(errors) or round_ == _PLACE_ROUNDS:
                break
            again = sum(n for _node, n, _err in missed)
            self.placer.refund(job, again)
            try:
                counts = await self._place(spec, again, job, deadline)
            except DSecError as exc:
                first = missed[0][2]
                errors = [BackendUnavailable(f"{first.message}; no other node could take its {again} "
                                             f"sandbox(es): {exc.message}", **first.detail)]
                errors[0].__cause__ = exc
                break
            self.metrics.replaced.inc(again)
            log.info("%d sandbox(es) placed again on %s: %s", again, ", ".join(counts),
                     "; ".join(f"{node} took none ({err.message})" for node, _n, err in missed))
        hard = [e for e in errors if not _took_none(e)]
        raise (hard or errors)[0]

    async def list(
        self, labels: dict[str, str], backend: str | None = None, state: str | None = None, *,
        after: str | None = None, limit: int | None = None,
    ) -> builtins.list[SandboxInfo]:
        """The job's sandboxes as last seen (lost ones included, with their reason), in id order: at most
        ``limit`` of them after the id ``after`` (a page; the next starts after its last id)."""
        job = current_job.get()
        found: builtins.list[SandboxInfo] = []
        for sid in self.records.page(None if job == "admin" else job, after, limit or 0):
            row = self.records.rows[sid]
            if (row.state == "expired" or (backend is not None and row.shape.backend != backend)
                    or (state is not None and row.state != state)):
                continue
            if labels and any(self.records.spec(row).labels.get(k) != v for k, v in labels.items()):
                continue
            info = self.records.info(sid, row)
            found.append(self._with_endpoint(info, row.node) if row.state in LIVE else info)
            if limit is not None and len(found) >= limit:
                break
        return found

    async def get(self, sandbox_id: str) -> SandboxInfo:
        """Fresh info from the owning node (a lost sandbox answers its last info and the reason)."""
        row = self._mine(sandbox_id)
        if row is not None and row.state == "lost":
            return self.records.info(sandbox_id, row)
        row = self._row(sandbox_id)
        with self._on_node(sandbox_id):
            response = await self._node_request(row.node, "GET", f"/v1/sandboxes/{sandbox_id}")
        return self._refresh(sandbox_id, SandboxInfo.model_validate(response.json()))

    def _refresh(self, sandbox_id: str, info: SandboxInfo) -> SandboxInfo:
        """The node's fresh info into the row; one the node is expiring right now ends the row (room given back)."""
        row = self.records.rows.get(sandbox_id)
        if row is None:
            return info
        if info.state == "expired":
            if row.state in LIVE:
                self._ended(sandbox_id, info.reason or f"sandbox {sandbox_id} passed its timeout and was destroyed")
            return self.records.info(sandbox_id, self.records.rows.get(sandbox_id, row))
        if info.state != row.state and info.state in LIVE:  # paused, resumed
            self.state.writer.submit_rows([(sandbox_id, self.records.set_state(sandbox_id, info.state) or row)])
        return self._with_endpoint(info, row.node)

    async def destroy(self, sandbox_id: str) -> None:
        """Destroy on the owning node, free its capacity, forget it (a lost one is just forgotten)."""
        row = self._mine(sandbox_id)
        if row is not None:
            await self._destroy(sandbox_id, row)

    async def _destroy(self, sandbox_id: str, row: Row) -> None:
        if row.state in LIVE:
            with contextlib.suppress(SandboxNotFound):
                await self._node_request(row.node, "DELETE", f"/v1/sandboxes/{sandbox_id}")
            now = self.records.rows.get(sandbox_id)
            if now is not None and now.state in LIVE:  # not ended meanwhile (an event, a reconcile)
                self.placer.release(row.job, row.node, row.shape)
        if self.records.remove(sandbox_id) is not None:
            # Not waited for: a restarted gateway forgets a row whose sandbox its node no longer holds.
            self.state.writer.submit_delete([sandbox_id])

    # -- forwarded data plane (for clients that do not follow the endpoint) ------------------------------

    async def _json(self, sandbox_id: str, method: str, suffix: str, **kw: Any) -> Any:
        row = self._row(sandbox_id)
        with self._on_node(sandbox_id):
            response = await self._node_request(row.node, method, f"/v1/sandboxes/{sandbox_id}{suffix}", **kw)
        return response.json() if response.content else None

    def exec_stream(self, sandbox_id: str, request: ExecRequest, seq: int | None = None) -> AsyncIterator[ExecEvent]:
        """Relay the owning node's exec stream."""
        return self._exec(sandbox_id, request, seq)

    async def _exec(self, sandbox_id: str, request: ExecRequest, seq: int | None) -> AsyncIterator[ExecEvent]:
        row = self._row(sandbox_id)
        transport, http = self._client(row.node)
        path = f"/v1/sandboxes/{sandbox_id}/exec" + (f"?seq={seq}" if seq is not None else "")
        async with transport.stream(http, "POST", path, json_body=request.model_dump(mode="json")) as response:
            async for line in response.aiter_lines():
                if line.strip():
                    yield ExecEvent.model_validate_json(line)

    async def call(self, sandbox_id: str, request: CallRequest) -> CallResult:
        """Forward ``sb.call``."""
        return CallResult.model_validate(await self._json(sandbox_id, "POST", "/call",
                                                          json_body=request.model_dump(mode="json")))

    async def read_file(self, sandbox_id: str, path: str, limit: int, seq: int | None = None) -> bytes:
        """Forward a file read."""
        row = self._row(sandbox_id)
        params: dict[str, Any] = {"path": path} | ({"seq": seq} if seq is not None else {})
        return (await self._node_request(row.node, "GET", f"/v1/sandboxes/{sandbox_id}/files",
                                         params=params)).content

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, mode: int | None = None, seq: int | None = None
    ) -> None:
        """Forward a file write."""
        params: dict[str, Any] = {"path": path}
        if mode is not None:
            params["mode"] = format(mode, "o")
        if seq is not None:
            params["seq"] = seq
        await self._json(sandbox_id, "PUT", "/files", params=params, content=data)

    async def list_files(self, sandbox_id: str, path: str, seq: int | None = None) -> builtins.list[FileEntry]:
        """Forward a directory listing."""
        params: dict[str, Any] = {"path": path} | ({"seq": seq} if seq is not None else {})
        return [FileEntry.model_validate(e) for e in await self._json(sandbox_id, "GET", "/files/list",
                                                                      params=params)]

    async def stats(self, sandbox_id: str) -> SandboxStats:
        """Forward stats."""
        return SandboxStats.model_validate(await self._json(sandbox_id, "GET", "/stats"))

    async def _info_call(self, sandbox_id: str, method: str, suffix: str, **kw: Any) -> SandboxInfo:
        return self._refresh(sandbox_id, SandboxInfo.model_validate(await self._json(sandbox_id, method, suffix, **kw)))

    async def pause(self, sandbox_id: str, release_memory: bool = False) -> SandboxInfo:
        """Forward pause."""
        params = {"release_memory": "true"} if release_memory else None
        return await self._info_call(sandbox_id, "POST", "/pause", params=params)

    async def exec(self, sandbox_id: str, request: ExecRequest, seq: int | None = None) -> ExecResult:
        """Forward a one-response exec."""
        params = {"seq": seq} if seq is not None else None
        return ExecResult.model_validate(await self._json(sandbox_id, "POST", "/exec/result", params=params,
                                                          json_body=request.model_dump(mode="json")))

    async def screenshot(self, sandbox_id: str, seq: int | None = None) -> bytes:
        """Forward a screenshot (vm backend)."""
        row = self._row(sandbox_id)
        params = {"seq": seq} if seq is not None else None
        return (await self._node_request(row.node, "GET", f"/v1/sandboxes/{sandbox_id}/screenshot",
                                         params=params)).content

    async def mouse(self, sandbox_id: str, request: MouseRequest, seq: int | None = None) -> None:
        """Forward a pointer action (vm backend)."""
        await self._json(sandbox_id, "POST", "/mouse" + (f"?seq={seq}" if seq is not None else ""),
                         json_body=request.model_dump(mode="json"))

    async def keyboard(self, sandbox_id: str, request: KeyboardRequest, seq: int | None = None) -> None:
        """Forward keyboard input (vm backend)."""
        await self._json(sandbox_id, "POST", "/keyboard" + (f"?seq={seq}" if seq is not None else ""),
                         json_body=request.model_dump(mode="json", exclude_none=True))

    async def reveal(self, sandbox_id: str, seq: int | None = None) -> SandboxInfo:
        """Forward reveal (hidden paths; a logged call on a trajectory)."""
        params = {"seq": seq} if seq is not None else None
        return await self._info_call(sandbox_id, "POST", "/reveal", params=params)

    async def renew_lease(self, sandbox_id: str) -> SandboxInfo:
        """Forward a lease renewal."""
        return await self._info_call(sandbox_id, "POST", "/lease")

    def statistics(self) -> NodeStatistics:
        """Warm pools and admission are per node; the gateway has its own queue (see ``/metrics``)."""
        raise NotSupported("warm pools and the admission queue are per node: ask a node daemon for its statistics")

    async def declare_pool(self, config: PoolConfig) -> PoolStatistics:
        """Pools are declared per node (``dsec serve --pool`` in the node config)."""
        raise NotSupported("warm pools are declared on each node daemon (--pool / DSEC_POOLS in the node config), "
                           "not through the gateway")

    async def owner_labels(self, sandbox_id: str) -> dict[str, str] | None:
        """The labels of a sandbox the gateway knows (jobs are scoped by the gateway's own middleware)."""
        row = self.records.rows.get(sandbox_id)
        return None if row is None else dict(self.records.spec(row).labels)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Forward resume."""
        return await self._info_call(sandbox_id, "POST", "/resume")

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        """Forward a new deadline."""
        body = TimeoutRequest(timeout=timeout).model_dump()
        return await self._info_call(sandbox_id, "POST", "/timeout", json_body=body)

    async def set_network(self, sandbox_id: str, network: str | builtins.list[str]) -> SandboxInfo:
        """Forward a network policy change."""
        return await self._info_call(sandbox_id, "PUT", "/network", json_body={"network": network})

    async def snapshot(self, sandbox_id: str, seq: int | None = None) -> SnapshotRef:
        """Forward snapshot (the snapshot store is shared, so any node can restore it)."""
        params = {"seq": seq} if seq is not None else None
        return SnapshotRef.model_validate(await self._json(sandbox_id, "POST", "/snapshot", params=params))

    async def fork(self, sandbox_id: str, count: int) -> builtins.list[SandboxInfo]:
        """Fork on the owning node; the copies are the job's and count against its quota."""
        row = self._row(sandbox_id)
        items = await self._json(sandbox_id, "POST", "/fork", json_body={"count": count})
        infos = [SandboxInfo.model_validate(item) for item in items]
        for info in infos:
            self.placer.adopt(row.job, row.node, info.spec)
        return await self._remember(infos, row.node, row.job)

    async def branch_trajectory(self, request: TrajectoryForkRequest) -> SandboxInfo:
        """Branch on a live node (the trajectory log is shared in PostgreSQL)."""
        node = self._any_node()
        response = await self._node_request(node, "POST", "/v1/trajectories/fork",
                                            json_body=request.model_dump(mode="json"))
        info = SandboxInfo.model_validate(response.json())
        self.placer.adopt(current_job.get(), node, info.spec)
        return (await self._remember([info], node, current_job.get()))[0]

    async def trajectory_log(self, name: str, start: int, limit: int) -> builtins.list[LoggedCall]:
        """Read the shared trajectory log through any live node."""
        response = await self._node_request(self._any_node(), "GET", "/v1/trajectories/log",
                                            params={"name": name, "start": start, "limit": limit})
        return [LoggedCall.model_validate(item) for item in response.json()]

    async def list_images(self) -> builtins.list[ImageInfo]:
        """Images of the shared store, as a live node sees them."""
        response = await self._node_request(self._any_node(), "GET", "/v1/images")
        return [ImageInfo.model_validate(item) for item in response.json()]

    async def pull_image(self, request: ImagePullRequest) -> ImageInfo:
        """Pull into the shared store through a live node."""
        response = await self._node_request(self._any_node(), "POST", "/v1/images/pull",
                                            json_body=request.model_dump(mode="json"))
        return ImageInfo.model_validate(response.json())

    async def build_image(self, request: ImageBuildRequest, context: IO[bytes]) -> AsyncIterator[ImageBuildEvent]:
        """Build on a live node into the shared store, passing its output on; closing the stream cancels it."""
        node = self._any_node()
        transport, http = self._client(node)
        params, headers = build_request_parts(request)
        with self._reaching(node):
            async with transport.stream(http, "POST", "/v1/images/build", params=params, headers=headers,
                                        content=read_chunks(context)) as response:
                async for line in response.aiter_lines():
                    if line:
                        yield ImageBuildEvent.model_validate_json(line)

    async def get_image(self, name: str) -> ImageInfo:
        """One image of the shared store."""
        response = await self._node_request(self._any_node(), "GET", f"/v1/images/{name}")
        return ImageInfo.model_validate(response.json())


    # -- operator views (dashboard, CLI) --------------------------------------------------------------------

    async def _each_node(self, path: str, params: dict[str, Any] | None = None) -> builtins.list[tuple[str, Any]]:
        """``GET path`` on every live node; nodes that fail are logged and left out."""
        alive = sorted(n.name for n in self.placer.nodes.values() if n.alive)

        async def one(node: str) -> tuple[str, Any]:
            return node, (await self._node_request(node, "GET", path, params=params)).json()

        results = await asyncio.gather(*(one(n) for n in alive), return_exceptions=True)
        found = []
        for result in results:
            if isinstance(result, BaseException):
                log.warning("GET %s on a node failed: %s", path, result)
            else:
                found.append(result)
        return found

    def _admin_only(self, what: str) -> None:
        if current_job.get() != "admin":
            raise Forbidden(f"{what} spans every job's sandboxes: it needs the gateway's admin token")

    async def audit_log(self, query: AuditQuery) -> builtins.list[AuditEntry]:
        """Every live node's audit trail for ``query``, merged newest first (admin only).

        Nodes do not know the gateway's jobs: the job (and, for calls sent straight to the node with a
        sandbox-scoped token, the caller) is filled in from the gateway's own records, and a ``job`` filter is
        applied here, after the merge (so it may return fewer than ``limit`` entries per page)."""
        self._admin_only("the audit trail")
        params = {k: v for k, v in vars(query).items() if v is not None and k != "job"}
        merged = []
        for _, items in await self._each_node("/v1/audit", params):
            for item in items:
                entry = AuditEntry.model_validate(item)
                row = self.records.rows.get(entry.sandbox_id)
                if row is not None:
                    entry.job = entry.job or row.job
                    if entry.who == "sandbox-token":
                        entry.who = f"job:{row.job}"
                if query.job is None or entry.job == query.job:
                    merged.append(entry)
        return sorted(merged, key=lambda e: e.at, reverse=True)[:query.limit]

    async def sandbox_logs(self, sandbox_id: str, limit: int = 100, before: int | None = None
                           ) -> builtins.list[AuditEntry]:
        """The command history kept by the sandbox's node (also after the sandbox is gone)."""
        row = self._mine(sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
        params: dict[str, Any] = {"limit": limit} if before is None else {"limit": limit, "before": before}
        response = await self._node_request(row.node, "GET", f"/v1/sandboxes/{sandbox_id}/logs", params=params)
        entries = [AuditEntry.model_validate(item) for item in response.json()]
        for entry in entries:
            entry.job = entry.job or row.job
            if entry.who == "sandbox-token":
                entry.who = f"job:{row.job}"
        return entries

    def subscribe(self, since: int | None = None) -> AsyncIterator[LifecycleEvent]:
        """Every node's lifecycle events, merged and numbered by the gateway (admin only); ``since`` replays the
        gateway's kept history after that number first, as a node daemon does.

        The gateway follows each live node's stream from the moment the node is reconciled (after a
        gateway restart, from the node's own kept history), so the history holds the nodes' recent events
        in the order the gateway received them; a node's ``seq`` is replaced by the gateway's."""
        self._admin_only("the event stream")
        return self.events.subscribe(since)

    def _follow(self, node: str) -> None:
        task = self._followers.get(node)
        if task is None or task.done():
            self._followers[node] = asyncio.create_task(self._follow_node(node), name=f"dsec-events-{node}")

    async def _unfollow(self, node: str) -> None:
        task = self._followers.pop(node, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _follow_node(self, node: str) -> None:
        """Follow one node's event stream for as long as it lives: each event goes into the gateway's
        history and keeps the records true (a sandbox the node expired or destroyed frees its room now, not
        when a client next asks). A dropped stream is re-opened from the node's kept history, skipping what
        was already seen (by time: a restarted node daemon numbers from 1 again)."""
        seen = (0.0, 0)
        opened = 0
        while True:
            try:
                transport, http = self._client(node)
                async with transport.stream(http, "GET", "/v1/events?since=0") as response:
                    opened += 1
                    if opened > 1:  # events may have passed beyond the node's kept history meanwhile
                        self._resync(node, "its event stream was re-opened")
                    async for line in response.aiter_lines():
                        if not line:
                            continue
                        event = LifecycleEvent.model_validate_json(line)
                        if event.kind == "lagged":
                            self._resync(node, f"its event stream skipped {event.detail.get('dropped', '?')} event(s)")
                        elif (event.at, event.seq) <= seen:
                            continue
                        seen = (event.at, event.seq)
                        self._apply(node, event)
                        self.events.forward(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a node that dies: membership stops this follower
                log.info("event stream of node %s ended (%s); re-opening", node, exc)
            await asyncio.sleep(1.0)

    def _resync(self, node: str, why: str) -> None:
        """Reconcile ``node`` soon (once, however many times asked meanwhile): events about it were missed."""
        task = self._resyncs.get(node)
        if task is not None and not task.done():
            return

        async def again() -> None:
            try:
                await self.reconcile(node)
                log.info("node %s reconciled: %s", node, why)
            except DSecError as exc:
                log.warning("node %s could not be reconciled after %s: %s", node, why, exc)

        self._resyncs[node] = asyncio.create_task(again(), name=f"dsec-resync-{node}")

    def _apply(self, node: str, event: LifecycleEvent) -> None:
        sid = event.sandbox_id or ""
        row = self.records.rows.get(sid)
        if row is None or row.node != node or row.state not in LIVE:
            return
        if event.kind == "expired":
            self._ended(sid, event.reason or f"sandbox {sid} passed its timeout and was destroyed")
        elif event.kind == "destroyed":
            self._ended(sid, None)

    async def overview(self) -> NodeOverview:
        """Every node's overview summed; the node list from placement (dead nodes included, marked). Admin only."""
        self._admin_only("the overview")
        answers = {node: NodeOverview.model_validate(doc) for node, doc in await self._each_node("/v1/overview")}
        total = NodeOverview(at=time.time(), nodes=[])
        for name, node in sorted(self.placer.nodes.items()):
            got = answers.get(name)
            if got is None or not got.nodes:
                live = self.records.live_on(name)
                total.nodes.append(NodeLoad(node=name, alive=node.alive and got is not None, sandboxes=live))
                continue
            total.nodes.append(got.nodes[0].model_copy(update={"node": name, "alive": node.alive}))
            total.created += got.created
            total.create_seconds_sum += got.create_seconds_sum
            total.exec_seconds_sum += got.exec_seconds_sum
            total.exec_count += got.exec_count
            for key, value in got.execs.items():
                total.execs[key] = total.execs.get(key, 0) + value
            for key, value in got.failures.items():
                total.failures[key] = total.failures.get(key, 0) + value
            for key, count in got.audit.items():
                total.audit[key] = total.audit.get(key, 0) + count
            total.pools.extend(got.pools)
            if not total.images:
                total.images = got.images  # one shared store; the first node's cache stands for the rest
        return total


def _stamped(spec: SandboxSpec, job: str) -> SandboxSpec:
    """The spec with the job's label (set by the gateway, never taken from the client): the node's record
    then names the job, which is what a restarted gateway rebuilds a lost row from."""
    if spec.labels.get(JOB_LABEL) == job:
        return spec
    return spec.model_copy(update={"labels": {**spec.labels, JOB_LABEL: job}})


def _capacity(raw: dict[str, Any]) -> Capacity:
    return Capacity(cpu=float(raw.get("cpu", 0.0)), memory=int(raw.get("memory", 0)),
                    slots={str(k): int(v) for k, v in dict(raw.get("slots", {})).items()})
