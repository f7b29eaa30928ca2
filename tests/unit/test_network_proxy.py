"""The DNS proxy's decisions and the policy parser, without nftables (a recording stand-in for the
rules) and against a real DNS server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

import dns.message
import dns.rcode
import dns.rrset
import pytest

from dsec.errors import InvalidRequest
from dsec.isolation.network import DnsProxy, Network, Policy

ANSWERS = {"pypi.org": "192.0.2.10", "files.pythonhosted.org": "192.0.2.11", "evil.example": "192.0.2.66"}


class RecordingNetwork(Network):
    """Records what the proxy would open instead of calling nft."""

    def __init__(self) -> None:
        super().__init__("unit")
        self.opened: list[tuple[int, str, int | None, int]] = []

    def allow_resolved(self, index: int, address: str, port: int | None, ttl: int) -> None:
        self.opened.append((index, address, port, ttl))


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    asked: list[str] = []

    def serve() -> None:
        while True:
            try:
                data, addr = sock.recvfrom(4096)
            except OSError:
                return
            if not data:
                return
            query = dns.message.from_wire(data)
            name = query.question[0].name.to_text(omit_final_dot=True)
            asked.append(name)
            reply = dns.message.make_response(query)
            if name in ANSWERS:
                reply.answer.append(dns.rrset.from_text(name + ".", 120, "IN", "A", ANSWERS[name]))
            else:
                reply.set_rcode(dns.rcode.NXDOMAIN)
            sock.sendto(reply.to_wire(), addr)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setenv("DSEC_DNS_UPSTREAM", f"127.0.0.1:{sock.getsockname()[1]}")
    yield asked
    with contextlib.suppress(OSError):  # ENOTCONN on an unconnected UDP socket, but it still wakes recvfrom
        sock.shutdown(socket.SHUT_RDWR)
    thread.join(5)
    sock.close()


def ask(proxy: DnsProxy, index: int, name: str) -> dns.message.Message:
    query = dns.message.make_query(name, "A")
    wire = asyncio.run(proxy.answer(index, query.to_wire()))
    assert wire is not None
    return dns.message.from_wire(wire)


def test_allowlist_answers_allowed_names_and_opens_their_addresses(upstream: list[str]) -> None:
    net = RecordingNetwork()
    policies = {3: Policy.parse(["pypi.org:443", "*.pythonhosted.org"])}
    proxy = DnsProxy(net, policies.get)
    reply = ask(proxy, 3, "pypi.org")
    assert reply.rcode() == dns.rcode.NOERROR and reply.answer[0][0].address == "192.0.2.10"
    assert net.opened == [(3, "192.0.2.10", 443, 120)]
    reply = ask(proxy, 3, "files.pythonhosted.org")
    assert net.opened[-1] == (3, "192.0.2.11", None, 120)
    # a name outside the list is refused and never asked upstream, and opens nothing
    upstream.clear()
    opened = len(net.opened)
    assert ask(proxy, 3, "evil.example").rcode() == dns.rcode.REFUSED
    assert ask(proxy, 3, "pythonhosted.org").rcode() == dns.rcode.REFUSED  # "*." means subdomains only
    assert upstream == [] and len(net.opened) == opened


def test_repeated_lookups_cost_no_rule_updates_until_half_the_ttl(upstream: list[str]) -> None:
    net = RecordingNetwork()
    proxy = DnsProxy(net, {1: Policy.parse(["pypi.org"])}.get)
    for _ in range(20):
        assert ask(proxy, 1, "pypi.org").rcode() == dns.rcode.NOERROR
    assert net.opened == [(1, "192.0.2.10", None, 120)]
    proxy.forget(1)  # a policy change flushed the sets
    ask(proxy, 1, "pypi.org")
    assert len(net.opened) == 2


def test_none_refuses_allow_forwards_garbage_is_dropped(upstream: list[str]) -> None:
    net = RecordingNetwork()
    proxy = DnsProxy(net, {1: Policy.parse("none"), 2: Policy.parse("allow")}.get)
    assert ask(proxy, 1, "pypi.org").rcode() == dns.rcode.REFUSED
    assert ask(proxy, 2, "evil.example").answer[0][0].address == "192.0.2.66"
    assert net.opened == []  # "allow" needs no per-address rule
    assert ask(proxy, 9, "pypi.org").rcode() == dns.rcode.REFUSED  # unknown sandbox network
    assert asyncio.run(proxy.answer(2, b"\x00\x01garbage")) is None


def test_unreachable_upstream_is_servfail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_DNS_UPSTREAM", "127.0.0.1:9")  # discard port: nothing answers
    proxy = DnsProxy(RecordingNetwork(), {1: Policy.parse("allow")}.get)
    assert ask(proxy, 1, "pypi.org").rcode() == dns.rcode.SERVFAIL


@pytest.mark.parametrize("bad", [["10.0.0.0/33"], ["host_with_underscore.org"], ["1.2.3.4:70000"], ["2001:db8::/32"],
                                 [""], "open"])
def test_bad_entries_are_invalid_requests_naming_the_entry(bad: str | list[str]) -> None:
    with pytest.raises(InvalidRequest) as err:
        Policy.parse(bad)
    shown = bad if isinstance(bad, str) else bad[0]
    assert repr(shown) in str(err.value) or shown in str(err.value)
