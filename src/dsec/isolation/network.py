"""Network policies of container and microvm sandboxes, enforced outside the sandbox.

``network="none"`` (the default) is a fresh network namespace with only loopback (container) or a VM
with no network device (microvm): nothing here runs for it. Any other policy gives the sandbox's
network namespace a veth pair: ``eth0`` inside with ``10.200.x.y/30``,
``dsv<N>`` on the host, a default route through the host side, and ``/etc/resolv.conf`` pointing at
a DNS proxy on the host side of the pair. Everything the sandbox sends is judged by nftables rules in
the host's network namespace, where code inside cannot touch them:

- table ``inet dsec_<tag>`` (one per DSEC_HOME): the set ``ifaces`` of its sandboxes' host-side
  interfaces and a verdict map ``egress`` from interface to the sandbox's own chain ``n<N>``;
- ``forward``: replies to a sandbox pass, anything else towards a sandbox is dropped (no sandbox can
  reach another), a sandbox's own traffic goes through its chain: its allowlist sets (CIDRs, CIDR +
  protocol + port, addresses the DNS proxy resolved for allowed names, with the record's TTL as
  timeout) and a final counted drop; ``"allow"`` accepts everything but other sandboxes and
  link-local (cloud metadata) addresses;
- ``input``: from a sandbox only DNS to the proxy reaches the host (no daemon, no host service);
- ``postrouting``: traffic leaving through a non-sandbox interface is masqueraded.

A policy change (``set_network``) rewrites the sandbox's chain and sets in one nft transaction.
The veth pair disappears with the sandbox's network namespace; :meth:`Network.release` removes the
chain, sets and map entries. IPv4 only; the sandbox gets no IPv6 route. :class:`SandboxNetworks` is
what a backend holds: the table, the DNS proxy and the policy of each of its networked sandboxes.

A microvm's or vm's namespace (:class:`TapNamespace`, named ``dsvm-<tag>-<sandbox id>``, the vm backend's
tag ending in ``.vm``) is made by DSec and
holds QEMU: besides ``eth0`` it has a tap ``tap0`` (``10.200.255.253/30``, the last /30 of the subnet,
the same in every namespace) that QEMU's virtio-net device sits on. Every guest has the same address
(``10.200.255.254``), route and resolver (the tap's address), set at template boot (microvm: by its init;
vm: by the agent, once systemd has booted), so a
template snapshot serves every networked clone. The namespace's own nftables table masquerades the
guest's traffic to ``eth0``'s address and DNATs its DNS to the proxy: from then on the host's rules
above judge it exactly as a container's. Nothing from outside reaches the guest (no forwarding towards
the tap but replies) and nothing of the namespace itself is reachable from the guest.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype

from dsec.errors import InvalidRequest, SandboxError
from dsec.models import NetworkEntry, parse_network

__all__ = ["GUEST_ADDRESS", "GUEST_GATEWAY", "DnsProxy", "Network", "Policy", "SandboxNetworks", "TapNamespace",
           "dsec_tables", "upstream_resolver"]

log = logging.getLogger("dsec.network")

SUBNET = ipaddress.ip_network("10.200.0.0/16")
"""Addresses of sandbox veth pairs: a /30 each (host side .1, sandbox side .2)."""
_MAX_INDEX = SUBNET.num_addresses // 4 - 2
"""The last /30 is no sandbox's veth: it is the link between a microvm guest and its namespace's tap."""
GUEST_GATEWAY = "10.200.255.253"
"""The tap's address in a microvm sandbox's namespace: the guest's default route and resolver."""
GUEST_ADDRESS = "10.200.255.254"
"""Every microvm guest's own address (on a link of its own, masqueraded on the way out)."""
GUEST_MAC = "52:54:00:d5:ec:02"
"""The guest NIC's MAC (the same in every clone of a template: each sits on a link of its own)."""
TAP_MAC = "52:54:00:d5:ec:01"
"""The tap's MAC: fixed, so that the ARP entry a template snapshot carries stays right in every clone."""
_MIN_DNS_TTL = 30
_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
_FORWARD_MARKER = Path("/run/dsec/ip_forward.before")
"""Present while DSec keeps IPv4 forwarding on that it found off (holds the value to restore)."""


@dataclass(frozen=True)
class Policy:
    """A parsed ``network=`` value."""

    mode: str
    """``"none"``, ``"allow"`` or ``"list"``."""
    entries: tuple[NetworkEntry, ...] = ()

    @classmethod
    def parse(cls, value: str | Sequence[str]) -> Policy:
        try:
            mode, entries = parse_network(value)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return cls(mode, entries)

    def name_allowed(self, name: str) -> list[NetworkEntry]:
        """The domain entries that allow DNS name ``name`` (empty: not allowed)."""
        return [e for e in self.entries if e.matches_name(name)]


def upstream_resolver() -> tuple[str, int]:
    """Where the DNS proxy sends allowed queries: ``DSEC_DNS_UPSTREAM`` (``host[:port]``), else the
    first nameserver of the host's /etc/resolv.conf."""
    value = os.environ.get("DSEC_DNS_UPSTREAM", "")
    if not value:
        with contextlib.suppress(OSError):
            for line in Path("/etc/resolv.conf").read_text().splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    value = parts[1]
                    break
    host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    return (host or "127.0.0.1", int(port) if port else 53)


def _addresses(index: int) -> tuple[str, str]:
    base = int(SUBNET.network_address) + 4 * index
    return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))


def _run(argv: list[str], stdin: str) -> None:
    proc = subprocess.run(argv, input=stdin.encode(), capture_output=True, check=False)
    if proc.returncode != 0:
        raise SandboxError(f"{argv[0]} failed: {proc.stderr.decode(errors='replace').strip()[-500:]}")


def dsec_tables() -> list[str]:
    """Names of DSec's nft tables on this host (``dsec_<tag>``, one per DSEC_HOME with networked sandboxes)."""
    out = subprocess.run(["nft", "list", "tables", "inet"], capture_output=True, text=True, check=False).stdout
    return [line.split()[-1] for line in out.splitlines()
            if line.startswith("table inet ") and line.split()[-1].startswith("dsec_")]


class Network:
    """nftables + veth plumbing of one DSEC_HOME's sandboxes (blocking calls: run them in a thread)."""

    def __init__(self, tag: str) -> None:
        self.table = f"dsec_{tag}"

    # -- table -----------------------------------------------------------------------------------

    def ensure_table(self) -> None:
        """Create the table and its base chains if missing (idempotent) and enable IPv4 forwarding."""
        t = self.table
        # Declared (a no-op when they exist), then the base chains' rules replaced in the same transaction:
        # a daemon restarted after a crash must not append a second copy of them.
        _run(["nft", "-f", "-"], f"""
table inet {t} {{
  set ifaces {{ type ifname; }}
  map egress {{ type ifname : verdict; }}
  chain forward {{ type filter hook forward priority filter; policy accept; }}
  chain input {{ type filter hook input priority filter; policy accept; }}
  chain postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}
}}
flush chain inet {t} forward
flush chain inet {t} input
flush chain inet {t} postrouting
add rule inet {t} forward oifname @ifaces ct state established,related accept
add rule inet {t} forward oifname @ifaces counter drop
add rule inet {t} forward iifname @ifaces iifname vmap @egress
add rule inet {t} forward iifname @ifaces counter drop
add rule inet {t} input iifname @ifaces udp dport 53 accept
add rule inet {t} input iifname @ifaces ct state established,related accept
add rule inet {t} input iifname @ifaces counter drop
add rule inet {t} postrouting iifname @ifaces oifname != @ifaces masquerade
""")
        if _FORWARD.read_text().strip() != "1":
            # Routing is what a sandbox with network needs; the forward chain above keeps other
            # interfaces' traffic as it was (this table accepts everything not from or to a sandbox).
            # The marker lets the last table's removal switch it off again.
            log.warning("enabling net.ipv4.ip_forward for sandbox networking")
            _FORWARD_MARKER.parent.mkdir(parents=True, exist_ok=True)
            _FORWARD_MARKER.write_text("0")
            _FORWARD.write_text("1")

    def drop_table(self) -> None:
        """Remove the table (when no sandbox of this home is left); the last DSec table to go turns
        IPv4 forwarding back off if DSec turned it on."""
        with contextlib.suppress(SandboxError):  # already gone
            _run(["nft", "-f", "-"], f"delete table inet {self.table}\n")
        if _FORWARD_MARKER.exists() and not dsec_tables():
            _FORWARD.write_text(_FORWARD_MARKER.read_text().strip() or "0")
            _FORWARD_MARKER.unlink(missing_ok=True)

    # -- one sandbox -----------------------------------------------------------------------------

    def attach(self, target: int | str) -> int:
        """Give a sandbox's network namespace a veth pair; returns its index. ``target``: the pid of a
        process in the namespace, or the name of a named namespace (``ip netns``)."""
        nsfile = f"/proc/{target}/ns/net" if isinstance(target, int) else f"/run/netns/{target}"
        used = {int(p.name[3:]) for p in Path("/sys/class/net").iterdir()
                if p.name.startswith("dsv") and p.name[3:].isdigit()}
        for index in range(_MAX_INDEX + 1):
            if index in used:
                continue
            host, inside = _addresses(index)
            iface = f"dsv{index}"
            try:
                _run(["ip", "-batch", "-"], f"link add {iface} type veth peer name eth0 netns {target}\n")
            except SandboxError as exc:
                if "File exists" in str(exc):
                    continue  # taken by a concurrent create (of this or another daemon)
                raise
            _run(["ip", "-batch", "-"], f"addr add {host}/30 dev {iface}\nlink set {iface} up\n")
            _run(["nsenter", f"--net={nsfile}", "ip", "-batch", "-"],
                 f"addr add {inside}/30 dev eth0\nlink set eth0 up\nroute add default via {host}\n")
            return index
        raise SandboxError(f"no free sandbox network in {SUBNET}")

    def apply(self, index: int, policy: Policy, resolved: dict[tuple[str, int | None], int] | None = None) -> None:
        """Install ``policy`` for sandbox ``index`` atomically (replacing any previous one)."""
        t, n, iface = self.table, f"n{index}", f"dsv{index}"
        lines = [
            f"add chain inet {t} {n}",
            f"add set inet {t} {n}_any {{ type ipv4_addr; flags interval; }}",
            f"add set inet {t} {n}_port {{ type ipv4_addr . inet_proto . inet_service; flags interval; }}",
            f"add set inet {t} {n}_dns {{ type ipv4_addr; flags timeout; }}",
            f"add set inet {t} {n}_dnsport {{ type ipv4_addr . inet_proto . inet_service; flags timeout; }}",
            f"flush chain inet {t} {n}",
            f"flush set inet {t} {n}_any",
            f"flush set inet {t} {n}_port",
            f"flush set inet {t} {n}_dns",
            f"flush set inet {t} {n}_dnsport",
            f"add element inet {t} ifaces {{ {iface} }}",
        ]
        if policy.mode == "allow":
            lines += [f"add rule inet {t} {n} ip daddr {{ {SUBNET}, 169.254.0.0/16 }} counter drop",
                      f"add rule inet {t} {n} accept"]
        else:
            any_port = sorted({e.cidr for e in policy.entries if e.cidr and e.port is None})
            with_port = sorted({(e.cidr, e.port) for e in policy.entries if e.cidr and e.port is not None})
            if any_port:
                lines.append(f"add element inet {t} {n}_any {{ {', '.join(any_port)} }}")
            if with_port:
                elements = ", ".join(f"{c} . {proto} . {p}" for c, p in with_port for proto in ("tcp", "udp"))
                lines.append(f"add element inet {t} {n}_port {{ {elements} }}")
            lines += [
                f"add rule inet {t} {n} ip daddr @{n}_any accept",
                f"add rule inet {t} {n} ip daddr . meta l4proto . th dport @{n}_port accept",
                f"add rule inet {t} {n} ip daddr @{n}_dns accept",
                f"add rule inet {t} {n} ip daddr . meta l4proto . th dport @{n}_dnsport accept",
                f"add rule inet {t} {n} counter drop",
            ]
        # The map entry last: the chain is complete before any packet can be sent to it.
        lines.append(f"add element inet {t} egress {{ {iface} : jump {n} }}")
        _run(["nft", "-f", "-"], "\n".join(lines) + "\n")
        for (address, port), ttl in (resolved or {}).items():
            self.allow_resolved(index, address, port, ttl)

    def allow_resolved(self, index: int, address: str, port: int | None, ttl: int) -> None:
        """Let sandbox ``index`` reach ``address`` (a DNS answer for an allowed name) for ``ttl`` seconds."""
        t, n = self.table, f"n{index}"
        timeout = f"timeout {max(ttl, _MIN_DNS_TTL)}s"
        if port is None:
            element = f"add element inet {t} {n}_dns {{ {address} {timeout} }}"
        else:
            element = (f"add element inet {t} {n}_dnsport {{ {address} . tcp . {port} {timeout}, "
                       f"{address} . udp . {port} {timeout} }}")
        _run(["nft", "-f", "-"], element + "\n")

    def release(self, index: int) -> None:
        """Remove sandbox ``index``'s chain, sets and entries (and its veth, if the namespace still holds it)."""
        t, n, iface = self.table, f"n{index}", f"dsv{index}"
        for stmt in (f"delete element inet {t} egress {{ {iface} }}", f"delete element inet {t} ifaces {{ {iface} }}",
                     f"delete chain inet {t} {n}", f"delete set inet {t} {n}_any", f"delete set inet {t} {n}_port",
                     f"delete set inet {t} {n}_dns", f"delete set inet {t} {n}_dnsport"):
            with contextlib.suppress(SandboxError):  # already gone
                _run(["nft", "-f", "-"], stmt + "\n")
        if Path(f"/sys/class/net/{iface}").exists():
            with contextlib.suppress(SandboxError):
                _run(["ip", "-batch", "-"], f"link del {iface}\n")

    def indexes(self) -> list[int]:
        """Sandbox indexes that have a chain in this home's table."""
        proc = subprocess.run(["nft", "list", "chains", "inet"], capture_output=True, text=True, check=False)
        found, current = [], None
        for line in proc.stdout.splitlines():
            words = line.split()
            if words[:2] == ["table", "inet"] and len(words) > 2:
                current = words[2]
            elif current == self.table and words[:1] == ["chain"] and words[1][1:].isdigit():
                found.append(int(words[1][1:]))
        return found


class _DnsServer(asyncio.DatagramProtocol):
    def __init__(self, proxy: DnsProxy, index: int) -> None:
        self.proxy, self.index = proxy, index
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        task = asyncio.get_running_loop().create_task(self.proxy.answer(self.index, data))
        self.proxy.tasks.add(task)

        def reply(done: asyncio.Task[bytes | None]) -> None:
            self.proxy.tasks.discard(done)
            response = None if done.cancelled() or done.exception() else done.result()
            if response is not None and self.transport is not None:
                self.transport.sendto(response, addr)

        task.add_done_callback(reply)


class DnsProxy:
    """Answers each networked sandbox's DNS queries on its host-side address: allowed names are
    resolved upstream and their addresses opened in the sandbox's nft sets for the answer's TTL; any
    other name gets REFUSED (and nothing is opened)."""

    def __init__(self, network: Network, policy_of: Callable[[int], Policy | None]) -> None:
        self.network = network
        self.policy_of = policy_of
        self.upstream = upstream_resolver()
        self.servers: dict[int, asyncio.DatagramTransport] = {}
        self.tasks: set[asyncio.Task[bytes | None]] = set()
        self._open: dict[int, dict[tuple[str, int | None], float]] = {}
        """Per sandbox: (address, port) -> when its nft element expires (a repeated answer within the
        first half of that time costs no nft call: a sandbox looping on lookups cannot load the host)."""

    async def serve(self, index: int) -> None:
        """Listen for sandbox ``index``'s queries (idempotent)."""
        if index in self.servers:
            return
        host, _ = _addresses(index)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _DnsServer(self, index), local_addr=(host, 53))
        self.servers[index] = transport

    def stop(self, index: int) -> None:
        self._open.pop(index, None)
        transport = self.servers.pop(index, None)
        if transport is not None:
            transport.close()

    def forget(self, index: int) -> None:
        """The sandbox's policy changed (its sets were flushed): open resolved addresses again."""
        self._open.pop(index, None)

    def close(self) -> None:
        for index in list(self.servers):
            self.stop(index)
        for task in list(self.tasks):
            task.cancel()

    async def answer(self, index: int, data: bytes) -> bytes | None:
        """The reply to one query from sandbox ``index`` (None: unparseable, dropped)."""
        try:
            query = dns.message.from_wire(data)
        except dns.exception.DNSException:
            return None
        policy = self.policy_of(index)
        if not query.question or policy is None:
            return _refused(query)
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True)
        entries = policy.name_allowed(name) if policy.mode == "list" else ([] if policy.mode == "none" else None)
        if entries == []:
            return _refused(query)
        try:
            response = await dns.asyncquery.udp(query, self.upstream[0], port=self.upstream[1], timeout=3.0)
        except (dns.exception.DNSException, OSError) as exc:
            log.info("dns upstream %s failed for %s: %s", self.upstream, name, exc)
            reply = dns.message.make_response(query)
            reply.set_rcode(dns.rcode.SERVFAIL)
            return reply.to_wire()
        if entries:  # allowlist: open what the answer names, for as long as it may be cached
            opened: dict[tuple[str, int | None], int] = {}
            for rrset in response.answer:
                if rrset.rdtype == dns.rdatatype.A:
                    for rdata in rrset:
                        for entry in entries:
                            opened[(rdata.address, entry.port)] = int(rrset.ttl)
            now = time.monotonic()
            known = self._open.setdefault(index, {})
            fresh = {key: ttl for key, ttl in opened.items()
                     if known.get(key, 0.0) - now < max(ttl, _MIN_DNS_TTL) / 2}
            if fresh:
                await asyncio.to_thread(_open_all, self.network, index, fresh)
                for key, ttl in fresh.items():
                    known[key] = now + max(ttl, _MIN_DNS_TTL)
        return response.to_wire()


def _open_all(network: Network, index: int, opened: dict[tuple[str, int | None], int]) -> None:
    for (address, port), ttl in opened.items():
        network.allow_resolved(index, address, port, ttl)


def _refused(query: dns.message.Message) -> bytes:
    reply = dns.message.make_response(query)
    reply.set_rcode(dns.rcode.REFUSED)
    reply.flags |= dns.flags.RA
    return reply.to_wire()


class SandboxNetworks:
    """A backend's networked sandboxes: its nft table, the DNS proxy and each sandbox's policy.

    The sandbox's record keeps its index (``backend_state["net_index"]``); the container and microvm
    backends each hold one, with a table of their own (``tag`` differs), so neither one's orphan sweep
    can release the other's sandboxes. Call from the event loop; blocking work runs in threads.
    """

    def __init__(self, tag: str) -> None:
        self.network = Network(tag)
        self.policies: dict[int, Policy] = {}
        """Network index -> policy of this daemon's networked sandboxes (read by the DNS proxy)."""
        self.dns = DnsProxy(self.network, self.policies.get)
        self._table_ready = False

    async def connect(self, state: dict[str, object], target: int | str, policy: Policy) -> str:
        """Give the sandbox (its namespace: a pid or a namespace name) its veth pair, ``policy`` and DNS;
        notes the index in ``state`` and returns the host side's address (the sandbox's resolver)."""
        if not self._table_ready:
            await asyncio.to_thread(self.network.ensure_table)
            self._table_ready = True
        index = await asyncio.to_thread(self.network.attach, target)
        state["net_index"] = index
        await asyncio.to_thread(self.network.apply, index, policy)
        self.policies[index] = policy
        await self.dns.serve(index)
        return str(self.dns.servers[index].get_extra_info("sockname")[0])

    async def set_policy(self, state: dict[str, object], policy: Policy) -> bool:
        """Swap a connected sandbox's policy (one nft transaction); False if it has no veth pair yet."""
        index = state.get("net_index")
        if not isinstance(index, int):
            return False
        await asyncio.to_thread(self.network.apply, index, policy)
        self.policies[index] = policy
        self.dns.forget(index)
        return True

    def forget(self, state: dict[str, object]) -> None:
        """Stop serving the sandbox's DNS (it is being destroyed; :meth:`release` removes its rules)."""
        index = state.get("net_index")
        if isinstance(index, int):
            self.dns.stop(index)
            self.policies.pop(index, None)

    def release(self, state: dict[str, object]) -> None:
        """Remove the sandbox's chain, sets and veth (blocking)."""
        index = state.get("net_index")
        if isinstance(index, int):
            self.network.release(index)

    async def recover(self, state: dict[str, object], network: str | Sequence[str]) -> None:
        """Re-adopt a sandbox that outlived a daemon: its rules and veth live in the kernel, its DNS
        proxy lived in the old daemon."""
        index = state.get("net_index")
        if isinstance(index, int):
            self.policies[index] = Policy.parse(network)
            self._table_ready = True
            await self.dns.serve(index)

    async def sweep(self) -> None:
        """Release the chains of sandboxes no recovered record claims (call after ``recover``)."""
        for index in await asyncio.to_thread(self.network.indexes):
            if index not in self.policies:
                await asyncio.to_thread(self.network.release, index)

    async def aclose(self) -> None:
        """Stop the DNS proxy; drop the table if no networked sandbox is left (live ones keep it for
        the next daemon)."""
        self.dns.close()
        self.policies.clear()
        self._table_ready = False
        if not await asyncio.to_thread(self.network.indexes):
            await asyncio.to_thread(self.network.drop_table)


class TapNamespace:
    """The named network namespace of one microvm sandbox (or template boot): a tap for QEMU's NIC,
    forwarding to ``eth0`` (the veth :meth:`Network.attach` adds) and the guest-facing NAT. Blocking."""

    PREFIX = "dsvm-"

    def __init__(self, tag: str, sandbox_id: str) -> None:
        self.name = f"{self.PREFIX}{tag}-{sandbox_id}"
        self.path = Path("/run/netns") / self.name

    @classmethod
    def names(cls, tag: str) -> list[str]:
        """Sandbox ids that have a namespace of home ``tag`` on this host."""
        prefix = f"{cls.PREFIX}{tag}-"
        root = Path("/run/netns")
        return sorted(p.name[len(prefix):] for p in root.iterdir() if p.name.startswith(prefix)) if root.is_dir() \
            else []

    def exists(self) -> bool:
        return self.path.exists()

    def create(self) -> None:
        """The namespace with its tap up on :data:`GUEST_GATEWAY` and its filter rules (idempotent
        removal first: a half-made namespace of a crashed create goes)."""
        self.delete()
        _run(["ip", "netns", "add", self.name], "")
        try:
            # Forwarding on (the guest's traffic leaves through eth0), IPv6 off (the guest gets no route).
            _run(["nsenter", f"--net={self.path}", "sh", "-c",
                  "echo 1 > /proc/sys/net/ipv4/ip_forward && echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 "
                  "&& echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"], "")
            _run(["ip", "-n", self.name, "-batch", "-"],
                 f"tuntap add dev tap0 mode tap\nlink set tap0 address {TAP_MAC}\n"
                 f"addr add {GUEST_GATEWAY}/30 dev tap0\nlink set tap0 up\nlink set lo up\n")
            # The namespace's own address is no service: the guest reaches nothing in it but the DNAT below;
            # from outside, only replies are forwarded towards the guest.
            _run(["nsenter", f"--net={self.path}", "nft", "-f", "-"], """
table ip dsec {
  chain input { type filter hook input priority filter; policy drop; ct state established,related accept; }
  chain forward { type filter hook forward priority filter; policy drop;
    ct state established,related accept; iifname "tap0" oifname "eth0" accept; }
  chain postrouting { type nat hook postrouting priority srcnat; oifname "eth0" masquerade; }
  chain prerouting { type nat hook prerouting priority dstnat; }
}
""")
        except BaseException:
            self.delete()
            raise

    def route_dns(self, resolver: str) -> None:
        """Send the guest's DNS (to the tap's address) to the proxy at ``resolver`` (the veth's host side)."""
        _run(["nsenter", f"--net={self.path}", "nft", "-f", "-"],
             f"flush chain ip dsec prerouting\nadd rule ip dsec prerouting iifname \"tap0\" ip daddr {GUEST_GATEWAY} "
             f"udp dport 53 dnat to {resolver}\n")

    def delete(self) -> None:
        """Remove the namespace (its tap and its end of the veth pair go with it; the host end too).
        Idempotent: a concurrent removal (a create's clean-up and an orphan sweep) is no error."""
        if not self.exists():
            return
        try:
            _run(["ip", "netns", "del", self.name], "")
        except SandboxError:
            if self.exists():
                raise

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (``nsenter`` execs it: the pid stays the command's)."""
        return ["nsenter", f"--net={self.path}", "--", *argv]
