"""The cluster gateway: the node API (`/v1`, the same FastAPI app) over many nodes.

Owns which node each sandbox lives on (placement through :class:`~dsec.cluster.placement.Placer`, a batch
as one decision with one request per node, placed again where a node took none, all or nothing), jobs (a
job is a token; its quotas), routing between replicas, and forwarding what it does not answer itself to the
sandbox's node. Create answers carry the owning node's URL and a token scoped to the sandbox, so the SDK
sends exec and file calls straight to the node: the gateway forwards them only for clients that do not
follow the endpoint (curl). It builds on :mod:`~dsec.cluster.gateway_base` (state, records, node clients),
:mod:`~dsec.cluster.gateway_nodes` (membership) and :mod:`~dsec.cluster.gateway_views` (operator views), and
implements :class:`~dsec.api.protocol.NodeAPI`. It must never run sandboxes itself.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import gc
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from dsec._http.http11 import Http11Error
from dsec.api.client import NodeClient
from dsec.api.operations import Operation
from dsec.api.protocol import NodeAPI
from dsec.cluster.gateway_base import (
    BATCH_LABEL,
    NodeFacts,
    NodeSource,
    current_job,
    current_token,
)
from dsec.cluster.gateway_nodes import NodeMembership
from dsec.cluster.gateway_views import OperatorViews
from dsec.cluster.records import LIVE, Row
from dsec.cluster.replica import adopt_rows
from dsec.cluster.router import FORWARDED_HEADER, was_forwarded
from dsec.cluster.surface import GatewaySurface
from dsec.daemon.auth import JOB_LABEL
from dsec.errors import (
    BackendUnavailable,
    ConnectionFailed,
    DaemonStopping,
    DSecError,
    NotSupported,
    SandboxNotFound,
)
from dsec.models import (
    BatchCreateEvent,
    BatchCreateRequest,
    BatchDestroyRequest,
    BatchDestroyResult,
    SandboxInfo,
    SandboxSpec,
    TrajectoryForkRequest,
    TrajectoryInfo,
)

__all__ = ["BATCH_LABEL", "GatewayEngine", "NodeFacts", "NodeSource", "current_job", "current_token"]

log = logging.getLogger(__name__)

_PLACE_ROUNDS = 4
"""A create whose node took none of it is placed again at most this many times (nodes going down one
after another; each round places nothing on the nodes that failed before)."""

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


class GatewayEngine(NodeMembership, OperatorViews, GatewaySurface, NodeAPI):
    """The node API over a cluster (the daemon's ``create_app`` serves it): the operations it defines place,
    merge or check jobs; every other operation goes to the sandbox's node (:meth:`perform`)."""

    async def start(self, *, settle: bool = True) -> None:
        """Reload nodes and sandboxes from the database, then follow membership. With replicas and ``settle``
        false, return once the takeover of this replica's cells is under way: each node is placed on as soon
        as its cell's rows are read and it is reconciled, and a call about a sandbox not in memory yet waits
        for the takeovers (see :meth:`rows_ready`), so a restarted gateway serves creates before it has read
        every row."""
        for node in await asyncio.to_thread(self.state.nodes):
            self.node_rows[node.name] = node
        if self.keeper is not None:
            await self.keeper.leases.setup()
            await self.keeper.tick()  # takes this replica's share of the cells over, rows and nodes included
            self._lease_loop = asyncio.create_task(self.keeper.forever())  # renewing while the rest starts
            if settle:
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
        # Image locality is a preference, not a condition of a create: its first round runs while creates are
        # served (a node that pushes its state says its cache on its stream anyway).
        self._poller = asyncio.create_task(self._poll_forever())
        self._image_poller = asyncio.create_task(self._refresh_images_forever())

    def holds(self, sandbox_id: str) -> bool:
        """Whether this replica has a record of the sandbox."""
        return self.keeper is None or sandbox_id in self.records.rows

    async def rows_ready(self) -> None:
        """Until the cells being taken over have their rows in memory (at once when none is)."""
        if self.keeper is not None and self.keeper.taking():
            await self.keeper.settle()

    async def owners_of(self, sandbox_id: str) -> builtins.list[str]:
        """The replicas that may hold ``sandbox_id``: the owner of its node's cell, or (its row not committed
        yet, or the owner unknown) every other live replica."""
        if self.keeper is None:
            return []
        await self.rows_ready()
        if sandbox_id in self.records.rows:
            return []
        leases = self.keeper.leases
        node = await asyncio.to_thread(self.state.locate, sandbox_id)
        if node is None:
            return self.other_replicas()
        cell = self.authority.cell(node)
        deadline = time.monotonic() + self._handover_wait()
        while True:  # a cell handed back has no owner until another replica's next round takes it
            owner = await leases.owner(cell)
            if owner is not None and owner[0] == leases.instance:
                if cell in leases.leases and not self.keeper.taking(cell):
                    return []  # this replica's (its row ended meanwhile, or it answers that it has none)
            elif owner is not None and owner[1] is not None:
                return [owner[1]]
            if time.monotonic() > deadline:
                return self.other_replicas()
            await asyncio.sleep(0.2)
            await self.rows_ready()
            if sandbox_id in self.records.rows:
                return []

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

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Place one sandbox (a trajectory re-attaches on its live node, else is rebuilt anywhere)."""
        job = current_job.get()
        spec = _stamped(spec, job)
        if spec.trajectory is not None:
            if self.records.trajectory(spec.trajectory) is None:
                await self.rows_ready()
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
        attempt = 0
        while True:
            try:
                return await self._place_once(spec, count, job, deadline)
            except BackendUnavailable as exc:
                if self.keeper is None:
                    raise
                if exc.detail.get("lease") == "lost" and attempt < 2:
                    attempt += 1
                    for node in self.keeper.nodes_in(int(exc.detail["cell"])):
                        self.placer.mark_dead(node)  # the lease loop settles the cell at its next round
                    self.placer.refund(job, count)
                elif "backend" in exc.detail and self.keeper.taking() and time.monotonic() < deadline:
                    # No node runs the backend yet, but cells are being taken over (a restart): each of their
                    # nodes is placed on once reconciled, within moments.
                    await asyncio.sleep(0.05)
                else:
                    raise

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

        async def one(node: str, n: int) -> builtins.list[builtins.list[SandboxInfo] | BaseException]:
            # A single create (one node's share): awaited here, not in a task of its own as gather would.
            try:
                return [await on(node, n)]
            except Exception as exc:
                return [exc]

        for round_ in range(1, _PLACE_ROUNDS + 1):
            if len(counts) == 1:
                results = await one(*next(iter(counts.items())))
            else:
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
        await self.rows_ready()
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
        if sandbox_id not in self.records.rows:
            await self.rows_ready()  # passed on by another replica while this one takes its cell over
        row = self._mine(sandbox_id)
        if row is not None:
            await self._destroy(sandbox_id, row)

    async def _destroy(self, sandbox_id: str, row: Row) -> None:
        await self.port_fronts.drop(sandbox_id)
        if row.state in LIVE:
            with contextlib.suppress(SandboxNotFound):
                await self._ask(row.node, lambda node: node.destroy(sandbox_id))
        self._forget([sandbox_id])

    async def destroy_many(self, request: BatchDestroyRequest) -> BatchDestroyResult:
        """One batch destroy per node holding some of them; ids this job has no row of are ``missing``. An id
        no replica holds but the database records is in a cell changing hands: asked again once it has."""
        job = request.job
        result = BatchDestroyResult()
        ids = builtins.list(request.ids)
        deadline = time.monotonic() + self._handover_wait()
        while True:
            if any(sid not in self.records.rows for sid in ids):
                await self.rows_ready()
            rows, missing = [], []
            for sid in ids:
                row = self._mine(sid)
                if row is None or (job is not None and row.job != job):
                    missing.append(sid)
                else:
                    rows.append((sid, row))
            done = await self._destroy_held(rows)
            result.destroyed += done.destroyed
            result.missing += done.missing
            result.failed.update(done.failed)
            if not missing or was_forwarded.get():
                result.missing += missing
                return result
            missing = await self._destroy_elsewhere(job, missing, result)
            moving = await self._in_handover(missing, job) if time.monotonic() < deadline else set()
            result.missing += [sid for sid in missing if sid not in moving]
            if not moving:
                return result
            ids = [sid for sid in missing if sid in moving]
            log.info("batch destroy: %d sandbox(es) in a cell changing hands; asked again once it has its owner",
                     len(ids))
            await asyncio.sleep(0.2)

    def _handover_wait(self) -> float:
        """How long a request waits for a cell changing hands to have its new owner (a lease's life and the
        new owner's takeover)."""
        return 0.0 if self.keeper is None else 3 * self.keeper.leases.ttl

    async def _in_handover(self, ids: builtins.list[str], job: str | None) -> set[str]:
        """Which of ``ids`` (no replica holds them) the database records: their cell is changing hands (handed
        back or its owner gone, the next owner not serving them yet)."""
        if self.keeper is None or not ids:
            return set()
        caller = current_job.get()
        job = job if job is not None else (None if caller == "admin" else caller)
        return await asyncio.to_thread(self.state.recorded, ids, job)

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

    async def perform(self, op: Operation[Any, Any], /, *args: Any, **kwargs: Any) -> Any:
        """An operation the gateway does not answer itself: a sandbox's goes to the sandbox's node (its answer
        that the sandbox expired or is gone updates the records), one on a store every node shares to any live
        node; any other is per node."""
        if op.sandbox_scoped:
            sandbox_id = op.arguments(args, kwargs)["sandbox_id"]
            if sandbox_id not in self.records.rows:
                await self.rows_ready()
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


def _stamped(spec: SandboxSpec, job: str) -> SandboxSpec:
    """The spec with the job's label (set by the gateway, never taken from the client): the node's record
    then names the job, which is what a restarted gateway rebuilds a lost row from."""
    if spec.labels.get(JOB_LABEL) == job:
        return spec
    return spec.model_copy(update={"labels": {**spec.labels, JOB_LABEL: job}})
