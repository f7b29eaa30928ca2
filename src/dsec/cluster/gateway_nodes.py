"""The gateway's side of membership: which nodes placement uses and what each one holds.

Owns following a node source (a poll, faster while nodes settle, at once when a node's event stream
breaks), a node's whole life in the gateway (joined, reconciled against what it holds, followed on its event
stream, held while its daemon stops, dead with its sandboxes lost), and the image locality placement reads
(pushed on the node's stream, polled from nodes that do not push). It must never place a sandbox or answer
a client's request; a node's records follow what the node says, never the reverse.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import logging
from typing import Any

import httpx

from dsec.api.operations import close_stream
from dsec.cluster.gateway_base import GatewayBase, _capacity
from dsec.cluster.records import LIVE, Row
from dsec.cluster.state import NodeRow
from dsec.daemon.auth import JOB_LABEL
from dsec.errors import (
    DSecError,
    SandboxNotFound,
    SandboxTimeout,
)
from dsec.models import (
    LifecycleEvent,
)

__all__ = ["NodeMembership"]

log = logging.getLogger(__name__)

_HEALTH_TIMEOUT = httpx.Timeout(5.0)
_PROBE_TIMEOUT = httpx.Timeout(2.0)


class NodeMembership(GatewayBase):
    """Membership and the truth of each node: which nodes placement uses, what each holds."""

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
            try:
                await self.refresh_images()
            except Exception:
                log.exception("image cache poll failed")
            # Each round asks every node this replica places on; at most ~100 asks a second on big fleets (the
            # cache a create lands on is noted at once; only evictions wait for a round).
            await asyncio.sleep(max(self.image_interval, len(self._reconciled) / 100))

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
                if not self.authority.mine(facts.name) or self._taken_over(facts.name):
                    continue  # another replica's cell, or one this replica is taking over (which reconciles it)
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
                   and not self._taken_over(name) for name, row in self.node_rows.items())

    def _taken_over(self, node: str) -> bool:
        """Whether ``node``'s cell is being taken over right now (the takeover reconciles it)."""
        return self.keeper is not None and self.keeper.taking(self.authority.cell(node))

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
        # A sandbox destroyed (its row removed) while the listing was on its way is in it: not adopted again.
        with self.records.removals(node) as destroyed:
            held = {info.id: info for info in
                    await self._ask(node, lambda api: api.with_timeout(_HEALTH_TIMEOUT).list())}
        adopted = []
        for info in held.values():
            job = info.labels.get(JOB_LABEL)
            if info.id in self.records.rows or job is None or info.id in destroyed:  # known, foreign or gone
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
