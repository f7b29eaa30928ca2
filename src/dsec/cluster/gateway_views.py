"""What the gateway answers about the cluster as a whole, for operators and dashboards.

Owns the answers that span nodes: health (the cluster as one node), metrics, the merged audit trail and
command logs (with the gateway's jobs filled in), the merged event stream, the overview; and the refusals of
what is per node (statistics, pools). It must never change records or placement: it reads them, and asks
nodes through the gateway's clients.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from dsec._version import __version__
from dsec.api.client import NodeClient
from dsec.cluster.gateway_base import GatewayBase, current_job
from dsec.daemon.audit import AuditQuery
from dsec.errors import (
    Forbidden,
    NotSupported,
    SandboxNotFound,
)
from dsec.models import (
    AuditEntry,
    AuditOutcome,
    LifecycleEvent,
    NodeInfo,
    NodeLoad,
    NodeOverview,
    NodeStatistics,
    PoolConfig,
    PoolStatistics,
)

__all__ = ["OperatorViews"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class OperatorViews(GatewayBase):
    """What the gateway answers about the whole cluster: health, metrics, audit, events, overview."""

    async def health(self) -> NodeInfo:
        """The cluster as one node: a backend is ``ok`` when any live node runs it."""
        backends: dict[str, str] = {}
        for node in self.placer.nodes.values():
            for name, slots in node.capacity.slots.items():
                if node.alive and slots > 0:
                    backends[name] = "ok"
        return NodeInfo(node="gateway", version=__version__, backends=backends, sandboxes=self.records.live)

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

    async def metrics_text(self) -> bytes:
        """The gateway's own metrics (nodes, live sandboxes, admission, image locality)."""
        return self.metrics.render()

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
