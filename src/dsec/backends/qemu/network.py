"""A QEMU guest's network: a NIC on a tap in the sandbox's own network namespace, the policy enforced outside.

Owns the tap namespaces ``dsvm-<net_tag>-<id>`` of one backend and its :class:`SandboxNetworks` (the nft table
``dsec_<tag>_<backend>``, veth pairs, DNS proxy); must never touch another backend's: the microvm and vm
backends of one home use tags of their own, so neither's orphan sweep can remove the other's namespaces.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dsec.errors import NotSupported
from dsec.isolation.network import GUEST_ADDRESS, GUEST_GATEWAY, GUEST_MAC, Policy, SandboxNetworks, TapNamespace
from dsec.models import SandboxRecord

__all__ = ["GuestNetwork"]

# A networked guest's NIC backend (the tap of its namespace) and the address its init gives it.
_NIC_NETDEV = ["-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no"]
_NIC_CMDLINE = f" dsec.net={GUEST_ADDRESS}/30:{GUEST_GATEWAY}"


class GuestNetwork:
    """The networks of one backend's guests (``nic_device``: QEMU's device for their NIC)."""

    def __init__(self, name: str, net_tag: str, table_tag: str, nic_device: str) -> None:
        self.name = name
        self.net_tag = net_tag
        self.nic_device = nic_device
        self.networks = SandboxNetworks(table_tag)

    def namespace(self, sandbox_id: str) -> TapNamespace:
        return TapNamespace(self.net_tag, sandbox_id)

    def command(self, record: SandboxRecord, cmd: list[str]) -> list[str]:
        """``cmd`` as a networked sandbox's QEMU runs it: with its NIC, inside its namespace (nsenter execs it),
        where it opens the tap and has no other network. Unchanged for a sandbox without a NIC."""
        if not record.backend_state.get("netns"):
            return cmd
        append = cmd.index("-append") + 1
        nic = ["-device", f"{self.nic_device},netdev=net0,mac={GUEST_MAC}"]
        return self.namespace(record.id).enter(
            [*cmd[:append], cmd[append] + _NIC_CMDLINE, *cmd[append + 1:], *_NIC_NETDEV, *nic])

    async def up(self, record: SandboxRecord, policy: Policy) -> None:
        """The sandbox's network namespace with the tap its NIC sits on; unless ``policy`` is none, its veth
        pair and rules too (:mod:`dsec.isolation.network`)."""
        namespace = self.namespace(record.id)
        record.backend_state["netns"] = namespace.name
        await asyncio.to_thread(namespace.create)
        if policy.mode != "none":
            await self._attach(record, policy)

    async def _attach(self, record: SandboxRecord, policy: Policy) -> None:
        namespace = self.namespace(record.id)
        resolver = await self.networks.connect(record.backend_state, namespace.name, policy)
        await asyncio.to_thread(namespace.route_dns, resolver)

    def down(self, sandbox_id: str, state: dict[str, Any]) -> None:
        """Remove the sandbox's rules, veth pair and namespace (blocking; nothing to do without them)."""
        self.networks.release(state)
        self.namespace(sandbox_id).delete()

    async def set_policy(self, record: SandboxRecord, network: str | list[str]) -> None:
        """Swap a live sandbox's policy (one nft transaction on the host, as on the container backend).

        A sandbox created with ``network="none"`` has no network device, and a guest cannot gain one while it
        runs: it is refused, unless the new policy is ``"none"`` too."""
        policy = Policy.parse(network)
        if not record.backend_state.get("netns"):
            if policy.mode == "none":
                return
            raise NotSupported(f"sandbox {record.id} was created with network='none' and has no network device; a "
                               f"{self.name} sandbox cannot gain one while it runs: create it with its set-up policy "
                               f"(e.g. network='allow') and switch to 'none' later")
        if not await self.networks.set_policy(record.backend_state, policy) and policy.mode != "none":
            await self._attach(record, policy)

    async def namespaces(self) -> list[str]:
        """Sandbox ids that have a namespace of this backend."""
        names = await asyncio.to_thread(TapNamespace.names, self.net_tag)
        return [n for n in names if n.startswith(("sb-", "tpl-"))]
