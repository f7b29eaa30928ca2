"""The cluster gateway's state and its reach into nodes, which its parts build on.

Owns the gateway's in-memory state (records, placement, node rows, followers, connections: one
:class:`~dsec.api.client.NodeClient` a node over one shared set of connections), the request's job and
token (:data:`current_job`, :data:`current_token`), what membership reports of a node (:class:`NodeFacts`),
and the record keeping every part shares: reading a row as the request's job may see it, recording what a
node made, ending and forgetting rows, destroying held sandboxes one batch per node. Its parts are
:mod:`~dsec.cluster.gateway_nodes` (membership), :mod:`~dsec.cluster.gateway_views` (operator views) and
:mod:`~dsec.cluster.gateway` (the engine: creates and forwarding). It must never decide placement or
membership itself, and never runs sandboxes.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from dsec._http.connections import Connections
from dsec.api.client import NodeClient
from dsec.cluster.authority import Authority
from dsec.cluster.cells import CellLeases, cell_of
from dsec.cluster.placement import Capacity, JobQuota, Placer
from dsec.cluster.records import LIVE, Records, Row, shape_of
from dsec.cluster.replica import CellKeeper
from dsec.cluster.state import ClusterState, NodeRow
from dsec.cluster.surface import PortFronts
from dsec.daemon.auth import scoped_token
from dsec.daemon.events import EventBus
from dsec.errors import (
    BackendUnavailable,
    ConnectionFailed,
    DaemonStopping,
    DSecError,
    SandboxLost,
    SandboxNotFound,
    SandboxTimeout,
)
from dsec.models import (
    BatchDestroyRequest,
    BatchDestroyResult,
    NodeEndpoint,
    SandboxInfo,
)

__all__ = ["BATCH_LABEL", "GatewayBase", "NodeFacts", "NodeSource", "current_job", "current_token"]

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


_NODES_AT_ONCE = 64
"""Nodes a batch destroy asks at once."""


class _Metrics:
    def __init__(self, gateway: GatewayBase) -> None:
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


class GatewayBase:
    """The gateway's state and its reach: the records, placement, node clients (the parts build on it)."""

    if TYPE_CHECKING:  # the rest of what the lease loop needs of it (a CellHost), from the parts
        def know(self, node: NodeRow) -> None: ...
        async def rejoin(self, node: NodeRow) -> None: ...
        async def release_node(self, node: str) -> None: ...
        async def lose_dead(self, node: NodeRow) -> None: ...
        def creating_in(self, cell: int) -> int: ...

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
        # stream stays open, so streams are not bounded; they are read by the lean client (httpx's per-chunk
        # cost was a fifth of the gateway's CPU under load).
        self.connections = Connections(max_per_origin=200, keepalive_expiry=2.0, stream_limit=None,
                                       user_agent="dsec-gateway", lean_streams=True)
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
        gateway crash lost); the same infos come back, each with its endpoint."""
        rows = [(info.id, self._new_row(info, node, job, spec)) for info in infos]
        for sid, row in rows:
            self.records.put(sid, row)
        if infos and infos[0].image:
            self.placer.add_image(node, infos[0].image)
        if durable:
            await self.state.writer.put_rows(rows)
        else:
            self.state.writer.submit_rows(rows, new=True)
        url, token = self.node_rows[node].url, self.node_rows[node].token
        for info in infos:  # decoded for this call and not shared yet: given their endpoint in place, not copied
            info.endpoint = NodeEndpoint(url=url, token=scoped_token(token, info.id))
        return infos

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

    async def destroy_rows(self, ids: builtins.list[str]) -> None:
        """Destroy sandboxes of this replica's records on their nodes, whatever their job (one batch destroy
        per node); one a node could not destroy stays in the records, and its next reconcile decides."""
        rows = [(sid, row) for sid in ids if (row := self.records.rows.get(sid)) is not None]
        result = await self._destroy_held(rows)
        if result.failed:
            log.warning("%d sandbox(es) could not be destroyed: %s", len(result.failed),
                        "; ".join(f"{sid}: {why}" for sid, why in builtins.list(result.failed.items())[:3]))

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


def _capacity(raw: dict[str, Any]) -> Capacity:
    return Capacity(cpu=float(raw.get("cpu", 0.0)), memory=int(raw.get("memory", 0)),
                    slots={str(k): int(v) for k, v in dict(raw.get("slots", {})).items()})
