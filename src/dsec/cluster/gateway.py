"""The cluster gateway: the node API (`/v1`, the same FastAPI app) over many nodes.

Owns: which node each sandbox lives on (placement through :class:`~dsec.cluster.placement.Placer`), jobs
(a job is a token; its quotas), membership (a node source says which nodes are alive; a node that dies has
its sandboxes marked ``lost`` with the reason) and the durable record of all of it
(:class:`~dsec.cluster.state.ClusterState`). Create answers carry the owning node's URL and a token scoped
to the sandbox, so the SDK sends exec and file calls straight to the node: the gateway forwards them only
for clients that do not follow the endpoint (curl). It implements :class:`~dsec.api.protocol.NodeAPI` and
calls its nodes through one :class:`~dsec.api.client.NodeClient` each, over one set of connections. It must
never run sandboxes itself.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from dsec._http.connections import Connections
from dsec._http.http11 import Http11Error
from dsec._version import __version__
from dsec.api.client import NodeClient
from dsec.api.operations import Operation, close_stream
from dsec.api.protocol import NodeAPI
from dsec.cluster.authority import Authority
from dsec.cluster.cells import CellLeases, cell_of
from dsec.cluster.placement import Capacity, JobQuota, Placer
from dsec.cluster.records import LIVE, Records, Row, shape_of
from dsec.cluster.replica import CellKeeper, adopt_rows
from dsec.cluster.router import FORWARDED_HEADER, was_forwarded
from dsec.cluster.state import ClusterState, NodeRow
from dsec.cluster.surface import GatewaySurface, PortFronts
from dsec.daemon.audit import AuditQuery
from dsec.daemon.auth import JOB_LABEL, scoped_token
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
    AuditOutcome,
    BatchCreateEvent,
    BatchCreateRequest,
    BatchDestroyRequest,
    BatchDestroyResult,
    LifecycleEvent,
    NodeEndpoint,
    NodeInfo,
    NodeLoad,
    NodeOverview,
    NodeStatistics,
    PoolConfig,
    PoolStatistics,
    SandboxInfo,
    SandboxSpec,
    TrajectoryForkRequest,
    TrajectoryInfo,
)

__all__ = ["BATCH_LABEL", "GatewayEngine", "NodeFacts", "NodeSource", "current_job", "current_token"]

log = logging.getLogger(__name__)

T = TypeVar("T")

current_job: contextvars.ContextVar[str] = contextvars.ContextVar("dsec_job", default="default")
"""The job of the request being served (set from its token by the gateway's auth middleware)."""
current_token: contextvars.ContextVar[str | None] = contextvars.ContextVar("dsec_token", default=None)
"""The caller's token (what a call passed on to another replica is sent with)."""

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


_HEALTH_TIMEOUT = httpx.Timeout(5.0)
_PROBE_TIMEOUT = httpx.Timeout(2.0)
_PLACE_ROUNDS = 4
"""A create whose node took none of it is placed again at most this many times (nodes going down one
after another; each round places nothing on the nodes that failed before)."""
_NODES_AT_ONCE = 64
"""Nodes a batch destroy asks at once."""


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
    if isinstance(cause, ConnectionFailed) and isinstance(cause.__cause__, Http11Error):
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


class GatewayEngine(GatewaySurface, NodeAPI):
    """The node API over a cluster (the daemon's ``create_app`` serves it): the operations it defines place,
    merge or check jobs; every other operation goes to the sandbox's node (:meth:`perform`)."""

    def __init__(
        self,
        state: ClusterState,
        nodes: NodeSource,
        *,
        quotas: dict[str, JobQuota] | None = None,
        admission_wait: float = 60.0,
        poll_interval: float = 0.5,
        idle_poll_interval: float = 5.0,
        image_interval: float = 5.0,
        leases: CellLeases | None = None,
    ) -> None:
        self.state = state
        self.source = nodes
        self.placer = Placer()
        self.placer.quotas.update(quotas or {})
        self.admission_wait = admission_wait
        self.poll_interval = poll_interval
        self.idle_poll_interval = idle_poll_interval
        self.image_interval = image_interval
        self._membership_due = asyncio.Event()
        """Set when a node's event stream broke: membership is read at once (the node or its daemon died)."""
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
        # One set of connections for every node; idle ones are dropped before a node's uvicorn does (5 s
        # keep-alive): reusing one the server is closing at that instant fails the request. Every node's event
        # stream stays open, so streams are not bounded.
        self.connections = Connections(max_per_origin=200, keepalive_expiry=2.0, stream_limit=None,
                                       user_agent="dsec-gateway")
        self._nodes: dict[str, NodeClient] = {}
        self._reconciled: set[str] = set()
        self.unready: dict[str, str] = {}
        """Nodes Ray sees alive whose daemon took no create (stopping, or no connection opened) -> why;
        nothing is placed there until its ``/v1/health`` answers that it serves again (each poll asks)."""
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._pushing: set[str] = set()
        """Nodes whose event stream says their state (image cache, drain): their health is not polled."""
        self._resyncs: dict[str, asyncio.Task[None]] = {}
        self.events = EventBus("gateway", history=10_000)
        """The nodes' lifecycle events merged, with a history of its own (``/v1/events?since=``)."""
        self._poller: asyncio.Task[None] | None = None
        self._image_poller: asyncio.Task[None] | None = None
        self._lease_loop: asyncio.Task[None] | None = None
        self._last_report: builtins.list[NodeFacts] | None = None
        self.port_fronts = PortFronts()
        """The gateway's listeners for exposed ports (:mod:`dsec.cluster.surface`; the server sets where)."""

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
        """Destroy sandboxes of this replica's records on their nodes, whatever their job (one batch destroy
        per node); one a node could not destroy stays in the records, and its next reconcile decides."""
        rows = [(sid, row) for sid in ids if (row := self.records.rows.get(sid)) is not None]
        result = await self._destroy_held(rows)
        if result.failed:
            log.warning("%d sandbox(es) could not be destroyed: %s", len(result.failed),
                        "; ".join(f"{sid}: {why}" for sid, why in builtins.list(result.failed.items())[:3]))

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
        self._nodes.clear()
        await self.port_fronts.aclose()
        await self.connections.aclose()
        if self.keeper is not None:
            with contextlib.suppress(DSecError):
                await self.keeper.leases.leave()
            await self.keeper.leases.aclose()
        await self.state.aclose()

    async def _poll_forever(self) -> None:
        """Membership every ``poll_interval`` while something settles (nodes joining, held, not reconciled
        yet), every ``idle_poll_interval`` otherwise, and at once when a node's event stream breaks: a node
        that dies is noticed by its stream, so a big cluster's membership is not read twice a second."""
        while True:
            settling = bool(self.unready) or self._unsettled() or bool(getattr(self.source, "settling", False))
            # asyncio.timeout, not wait_for: on 3.11 wait_for trades a cancel landing with the event for the
            # event, and this loop would outlive the gateway's close.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval if settling else self.idle_poll_interval):
                    await self._membership_due.wait()
            self._membership_due.clear()
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
        chunk cache holds, which replaces what placement believed (a node that evicted an image loses it).
        A node whose event stream says its state (``node`` events) is not asked."""
        async def one(name: str) -> None:
            try:
                info = await self._ask(name, lambda node: node.with_timeout(_HEALTH_TIMEOUT).health())
            except DSecError as exc:  # a dying node: membership deals with it
                log.debug("image cache of %s unknown: %s", name, exc)
                return
            node = self.placer.nodes.get(name)
            if node is not None and node.alive:
                self.placer.set_images(name, info.images)

        await asyncio.gather(*(one(n.name) for n in builtins.list(self.placer.nodes.values())
                               if n.alive and n.name in self.node_rows and n.name not in self._pushing))

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
                info = await self._ask(name, lambda node: node.with_timeout(_PROBE_TIMEOUT).health())
            except DSecError as exc:
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
                self.port_fronts.forget(sid)
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
        fence = self.authority.fence(node)
        health = await self._ask(node, lambda api: api.with_timeout(_HEALTH_TIMEOUT).with_headers(fence).health())
        if health.placed is not None and (health.placed, health.digest) == self.records.digest(node):
            self.reconciled_by_digest += 1
            return  # the node holds exactly what the records say: no listing
        held = {info.id: info for info in await self._ask(node, lambda api: api.with_timeout(_HEALTH_TIMEOUT).list())}
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
                    await self._ask(node, lambda api: api.with_timeout(_HEALTH_TIMEOUT).get(sid))
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
        self.port_fronts.forget(sid)
        if row.state in LIVE:
            self.placer.release(row.job, row.node, row.shape)
        if expired is None:
            self.records.remove(sid)
            self.state.writer.submit_delete([sid])
            return
        self.state.writer.submit_rows([(sid, self.records.set_state(sid, "expired", expired) or row)])

    # -- node plumbing ------------------------------------------------------------------------------------

    def _node(self, node: str) -> NodeClient:
        """The node API of ``node`` (its daemon's URL and admin token), over the gateway's connections."""
        client = self._nodes.get(node)
        if client is None:
            row = self.node_rows[node]
            client = self._nodes[node] = NodeClient(row.url, row.token, connections=self.connections)
        return client

    async def _drop_client(self, node: str) -> None:
        client = self._nodes.pop(node, None)
        if client is not None:
            self.connections.forget(client.origin)

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

    async def _ask(self, node: str, call: Callable[[NodeClient], Awaitable[T]]) -> T:
        """``call`` on ``node``'s API; its failure to answer is the node's (:class:`BackendUnavailable`)."""
        with self._reaching(node):
            return await call(self._node(node))

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
        return NodeInfo(node="gateway", version=__version__, backends=backends, sandboxes=self.records.live)

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Place one sandbox (a trajectory re-attaches on its live node, else is rebuilt anywhere)."""
        job = current_job.get()
        spec = _stamped(spec, job)
        if spec.trajectory is not None:
            sid = self.records.trajectory(spec.trajectory)
            row = self.records.rows.get(sid or "")
            if row is not None and row.state in ("running", "paused") and row.job == job:
                info = await self._ask(row.node, lambda node: node.create(spec))
                return (await self._remember([info], row.node, job))[0]
        return (await self._create_placed(spec, 1, job))[0]

    async def create_many(self, request: BatchCreateRequest) -> builtins.list[SandboxInfo]:
        """Place a batch in one decision, create each node's share in one request; all or nothing."""
        job = current_job.get()
        return await self._create_placed(_stamped(request.spec, job), request.count, job)

    async def create_many_stream(self, request: BatchCreateRequest) -> AsyncIterator[BatchCreateEvent]:
        """:meth:`create_many`, each node's share sent as soon as that node answered; a client that leaves
        undoes the batch, as one that leaves a plain batch create does."""
        job = current_job.get()
        shares: asyncio.Queue[builtins.list[SandboxInfo]] = asyncio.Queue()
        work = asyncio.create_task(self._create_placed(_stamped(request.spec, job), request.count, job,
                                                       shares.put_nowait))
        try:
            while not work.done() or not shares.empty():
                if shares.empty():
                    waiting = asyncio.ensure_future(shares.get())
                    await asyncio.wait({waiting, work}, return_when=asyncio.FIRST_COMPLETED)
                    if not waiting.done():
                        waiting.cancel()
                        continue
                    share = waiting.result()
                else:
                    share = shares.get_nowait()
                for info in share:
                    yield BatchCreateEvent(type="sandbox", sandbox=info)
            work.result()  # the batch's failure (it was undone): the stream's error item
            yield BatchCreateEvent(type="done")
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)

    async def _create_placed(self, spec: SandboxSpec, count: int, job: str,
                             on_share: Callable[[builtins.list[SandboxInfo]], None] | None = None
                             ) -> builtins.list[SandboxInfo]:
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
            await self._create_rounds(spec, body, job, counts, deadline, created, on_share)
            if batch is not None and not await self.authority.close_batch(batch, done=True):
                raise BackendUnavailable("another gateway replica took over a cell of this batch before it was "
                                         "answered: it was undone, nothing of it is kept")
        except BaseException:  # a share failed, or the client left while placing again: undo every round
            await self.destroy_rows([info.id for info in created])
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
                             deadline: float, created: builtins.list[SandboxInfo],
                             on_share: Callable[[builtins.list[SandboxInfo]], None] | None = None) -> None:
        """Each node's share in one request, placed again (at most a few rounds) where a node took none."""

        async def on(node: str, n: int) -> builtins.list[SandboxInfo]:
            try:
                fence = self.authority.fence(node)
                if n == 1:
                    infos = [await self._ask(node, lambda api: api.with_headers(fence).create(spec))]
                else:
                    share = BatchCreateRequest(count=n, spec=spec)
                    infos = await self._ask(node, lambda api: api.with_headers(fence).create_many(share))
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
                made = await self._remember(infos, node, job, durable=False, spec=body)
            finally:
                self._share_done(job, node, n)
            if on_share is not None:
                on_share(made)
            return made

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
        self, labels: Mapping[str, str] | None = None, backend: str | None = None, state: str | None = None, *,
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
            info = await self._ask(row.node, lambda node: node.get(sandbox_id))
        return self._refresh(sandbox_id, info)

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
        await self.port_fronts.drop(sandbox_id)
        if row.state in LIVE:
            with contextlib.suppress(SandboxNotFound):
                await self._ask(row.node, lambda node: node.destroy(sandbox_id))
        self._forget([sandbox_id])

    def _forget(self, ids: Iterable[str]) -> None:
        """Drop the rows of sandboxes no node holds any more, giving back the room of those still live here."""
        removed = []
        for sid in ids:
            row = self.records.rows.get(sid)
            if row is not None and row.state in LIVE:  # not ended meanwhile (an event, a reconcile)
                self.placer.release(row.job, row.node, row.shape)
            if self.records.remove(sid) is not None:
                removed.append(sid)
        if removed:
            # Not waited for: a restarted gateway forgets a row whose sandbox its node no longer holds.
            self.state.writer.submit_delete(removed)

    async def destroy_many(self, request: BatchDestroyRequest) -> BatchDestroyResult:
        """One batch destroy per node holding some of them; ids this job has no row of are ``missing``."""
        job = request.job
        rows, missing = [], []
        for sid in request.ids:
            row = self._mine(sid)
            if row is None or (job is not None and row.job != job):
                missing.append(sid)
            else:
                rows.append((sid, row))
        result = await self._destroy_held(rows)
        if missing and not was_forwarded.get():
            missing = await self._destroy_elsewhere(job, missing, result)
        result.missing += missing
        return result

    async def _destroy_elsewhere(self, job: str | None, ids: builtins.list[str], result: BatchDestroyResult
                                 ) -> builtins.list[str]:
        """Sandboxes this replica has no row of, destroyed by the other replicas that have (one request to
        each in turn, with the caller's token, passed on no further); the ids none of them has."""
        for url in self.other_replicas():
            if not ids:
                break
            api = NodeClient(url, current_token.get(), connections=self.connections)
            try:
                done = await api.with_headers({FORWARDED_HEADER: "1"}).destroy_many(
                    BatchDestroyRequest(ids=ids, job=job))
            except DSecError as exc:
                log.warning("replica %s did not take a batch destroy of %d sandbox(es): %s", url, len(ids), exc)
                continue
            result.destroyed += done.destroyed
            result.failed.update(done.failed)
            ids = done.missing
        return ids

    async def _destroy_held(self, rows: builtins.list[tuple[str, Row]]) -> BatchDestroyResult:
        """Destroy sandboxes this replica has rows of: a lost or expired one is only forgotten (``missing``), a
        live one is destroyed by its node, in one request per node (:data:`_NODES_AT_ONCE` nodes at once)."""
        result = BatchDestroyResult()
        by_node: dict[str, builtins.list[str]] = {}
        for sid, row in rows:
            if row.state in LIVE:
                by_node.setdefault(row.node, []).append(sid)
            else:
                result.missing.append(sid)
        self._forget(result.missing)
        asking = asyncio.Semaphore(_NODES_AT_ONCE)

        async def on(node: str, ids: builtins.list[str]) -> None:
            async with asking:
                try:
                    done = await self._ask(node, lambda api: api.destroy_many(BatchDestroyRequest(ids=ids)))
                except DSecError as exc:
                    result.failed.update((sid, f"{type(exc).__name__}: {exc.message}") for sid in ids)
                    return
            result.destroyed += done.destroyed
            result.missing += done.missing
            result.failed.update(done.failed)
            self._forget([*done.destroyed, *done.missing])

        await asyncio.gather(*(on(node, ids) for node, ids in by_node.items()))
        return result

    # -- forwarded (for clients that do not follow the endpoint, and every operation not defined here) --------

    async def perform(self, op: Operation[Any, Any], /, *args: Any, **kwargs: Any) -> Any:
        """An operation the gateway does not answer itself: a sandbox's goes to the sandbox's node (its answer
        that the sandbox expired or is gone updates the records), one on a store every node shares to any live
        node; any other is per node."""
        if op.sandbox_scoped:
            sandbox_id = op.arguments(args, kwargs)["sandbox_id"]
            row = self._row(sandbox_id)
            with self._on_node(sandbox_id):
                answer = await self._ask(row.node, lambda node: node.perform(op, *args, **kwargs))
            return self._refresh(sandbox_id, answer) if isinstance(answer, SandboxInfo) else answer
        if op.shared:
            return await self._ask(self._any_node(), lambda node: node.perform(op, *args, **kwargs))
        raise NotSupported(f"{op.name} is answered by each node daemon, not through the gateway")

    async def perform_stream(self, op: Operation[Any, Any], /, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """A streamed operation, relayed from the sandbox's node (or, on a shared store, from any live node: an
        image build into the shared store)."""
        if op.sandbox_scoped:
            sandbox_id = op.arguments(args, kwargs)["sandbox_id"]
            node = self._row(sandbox_id).node
            with self._on_node(sandbox_id), self._reaching(node):
                async for item in self._node(node).perform_stream(op, *args, **kwargs):
                    yield item
            return
        if not op.shared:
            raise NotSupported(f"{op.name} is answered by each node daemon, not through the gateway")
        node = self._any_node()
        with self._reaching(node):
            async for item in self._node(node).perform_stream(op, *args, **kwargs):
                yield item

    async def statistics(self) -> NodeStatistics:
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

    async def fork(self, sandbox_id: str, count: int) -> builtins.list[SandboxInfo]:
        """Fork on the owning node; the copies are the job's and count against its quota."""
        row = self._row(sandbox_id)
        with self._on_node(sandbox_id):
            infos = await self._ask(row.node, lambda node: node.fork(sandbox_id, count))
        for info in infos:
            self.placer.adopt(row.job, row.node, info.spec)
        return await self._remember(infos, row.node, row.job)

    async def branch_trajectory(self, request: TrajectoryForkRequest) -> SandboxInfo:
        """Branch on a live node (the trajectory log is shared in PostgreSQL)."""
        node = self._any_node()
        info = await self._ask(node, lambda api: api.branch_trajectory(request))
        self.placer.adopt(current_job.get(), node, info.spec)
        return (await self._remember([info], node, current_job.get()))[0]

    async def end_trajectory(self, name: str) -> TrajectoryInfo:
        """Destroy the trajectory's sandbox through the records (its capacity freed), then end it on a node."""
        node = await self._drop_trajectory_sandbox(name)
        return await self._ask(node, lambda api: api.end_trajectory(name))

    async def delete_trajectory(self, name: str) -> None:
        """As :meth:`end_trajectory`, then delete it (the log and the snapshot store are shared)."""
        node = await self._drop_trajectory_sandbox(name)
        await self._ask(node, lambda api: api.delete_trajectory(name))

    async def _drop_trajectory_sandbox(self, name: str) -> str:
        """Destroy the live sandbox of trajectory ``name`` the request's job may see; the node to ask next."""
        for sid, row in builtins.list(self.records.rows.items()):
            if row.state in LIVE and self.records.spec(row).trajectory == name and self._mine(sid) is row:
                await self._destroy(sid, row)
                return row.node
        return self._any_node()

    async def metrics_text(self) -> bytes:
        """The gateway's own metrics (nodes, live sandboxes, admission, image locality)."""
        return self.metrics.render()

    # -- operator views (dashboard, CLI) --------------------------------------------------------------------

    async def _each_node(self, what: str, call: Callable[[NodeClient], Awaitable[T]]) -> builtins.list[tuple[str, T]]:
        """``call`` on every live node; nodes that fail are logged and left out."""
        alive = sorted(n.name for n in self.placer.nodes.values() if n.alive)

        async def one(node: str) -> tuple[str, T]:
            return node, await self._ask(node, call)

        results = await asyncio.gather(*(one(n) for n in alive), return_exceptions=True)
        found = []
        for result in results:
            if isinstance(result, BaseException):
                log.warning("%s of a node failed: %s", what, result)
            else:
                found.append(result)
        return found

    def _admin_only(self, what: str) -> None:
        if current_job.get() != "admin":
            raise Forbidden(f"{what} spans every job's sandboxes: it needs the gateway's admin token")

    async def audit_log(self, *, sandbox_id: str | None = None, who: str | None = None, job: str | None = None,
                        outcome: AuditOutcome | None = None, since: float | None = None, until: float | None = None,
                        before: int | None = None, limit: int = 100) -> builtins.list[AuditEntry]:
        """Every live node's audit trail for these filters, merged newest first (admin only).

        Nodes do not know the gateway's jobs: the job (and, for calls sent straight to the node with a
        sandbox-scoped token, the caller) is filled in from the gateway's own records, and a ``job`` filter is
        applied here, after the merge (so it may return fewer than ``limit`` entries per page)."""
        self._admin_only("the audit trail")
        query = AuditQuery(sandbox_id=sandbox_id, who=who, job=job, outcome=outcome, since=since, until=until,
                           before=before, limit=limit)  # refused here, as a node would, rather than on each node
        merged = []
        answers = await self._each_node("the audit trail", lambda node: node.audit_log(
            sandbox_id=sandbox_id, who=who, outcome=outcome, since=since, until=until, before=before, limit=limit))
        for _, entries in answers:
            for entry in entries:
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
        entries = await self._ask(row.node, lambda node: node.sandbox_logs(sandbox_id, limit, before))
        for entry in entries:
            entry.job = entry.job or row.job
            if entry.who == "sandbox-token":
                entry.who = f"job:{row.job}"
        return entries

    def subscribe(self, since: int | None = None, node_state: bool = False) -> AsyncIterator[LifecycleEvent]:
        """Every node's lifecycle events, merged and numbered by the gateway (admin only); ``since`` replays the
        gateway's kept history after that number first, as a node daemon does.

        The gateway follows each live node's stream from the moment the node is reconciled (after a
        gateway restart, from the node's own kept history), so the history holds the nodes' recent events
        in the order the gateway received them; a node's ``seq`` is replaced by the gateway's."""
        self._admin_only("the event stream")
        if node_state:
            raise NotSupported("a gateway has no node state of its own: its nodes' `node` events say theirs")
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
        opened, state_at = 0, 0.0
        while True:
            try:
                events = self._node(node).subscribe(0, node_state=True)
                first = True
                try:
                    async for event in events:
                        if first:
                            first, opened = False, opened + 1
                            if opened > 1:  # events may have passed beyond the node's kept history meanwhile
                                self._resync(node, "its event stream was re-opened")
                        if event.kind == "node":  # the state now comes first, then older ones from the history
                            if event.at >= state_at:
                                state_at = event.at
                                self._node_state(node, event)
                            continue
                        if event.kind == "lagged":
                            self._resync(node, f"its event stream skipped {event.detail.get('dropped', '?')} event(s)")
                        elif (event.at, event.seq) <= seen:
                            continue
                        seen = (event.at, event.seq)
                        self._apply(node, event)
                        self.events.forward(event)
                finally:
                    self._pushing.discard(node)  # polled again until the re-opened stream says its state
                    self._membership_due.set()
                    await close_stream(events)
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

    def _node_state(self, node: str, event: LifecycleEvent) -> None:
        """A node said its state on its stream: its image cache (which placement's locality uses), and whether
        it stops (nothing more is placed there until it serves again)."""
        self._pushing.add(node)
        images, stopping = event.detail.get("images"), event.detail.get("stopping")
        slot = self.placer.nodes.get(node)
        if isinstance(images, dict) and slot is not None and slot.alive:
            self.placer.set_images(node, {str(k): int(v) for k, v in images.items()})
        if stopping:
            self._hold(node, f"its daemon is stopping ({stopping})")

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
        answers = dict(await self._each_node("the overview", lambda node: node.overview()))
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
