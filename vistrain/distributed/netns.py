"""Two hosts on one machine: network namespaces joined by a veth pair, optionally shaped.

Benchmarks and tests of multi-node runs (``dev/nodes/bench_two_hosts.py``, ``tests/test_two_hosts.py``)
need ranks that talk over a real link with its own addresses, byte counters and bandwidth. As
root, ``ip netns add`` makes two network stacks ("hosts" A and B); a veth pair joins them, each end
gets an address of the benchmarking range 198.18.0.0/15 (RFC 2544, never routed), and ``tc qdisc
add dev <veth> root tbf rate <R>mbit`` on both ends limits each direction to R Mbit/s. Processes
started with :meth:`TwoHosts.command` run inside a host (``ip netns exec``); gloo must be told the
interface (``GLOO_SOCKET_IFNAME``), otherwise it resolves the host name to 127.0.0.1.

Names carry this process's id and a counter, so runs at the same time never collide; the
namespaces (and with them the veth pair and its qdiscs) are deleted on exit from the ``with``
block, on errors, Ctrl-C and SIGTERM alike.
"""

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

ADDRESSES = ("198.18.0.1", "198.18.0.2")  # host A, host B (inside the namespaces only)
_counter = itertools.count()  # names of this process's host pairs (an id, not shared state)


def unavailable_reason() -> Optional[str]:
    """Why this process cannot build two hosts (None when it can): needs root, ``ip`` and ``tc``,
    and a kernel that lets it add a network namespace."""
    if os.name != "posix" or os.geteuid() != 0:
        return "creating network namespaces needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} (iproute2) not found"
    name = f"vistrain-probe-{os.getpid()}-{next(_counter)}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip() or probe.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@dataclass
class TwoHosts:
    """Hosts A (index 0) and B (1): namespace ``namespaces[i]``, veth end ``interfaces[i]`` with
    address ``ADDRESSES[i]``; ``rate_mbit``: each direction's limit (None: unshaped)."""

    namespaces: List[str]
    interfaces: List[str]
    rate_mbit: Optional[float]

    @property
    def addresses(self):
        return ADDRESSES

    def command(self, host: int, argv: List[str]) -> List[str]:
        """``argv`` run inside ``host``."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def env(self, host: int, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """``base`` (default: this environment) with gloo's and NCCL's socket interface set to
        ``host``'s veth end."""
        env = dict(os.environ if base is None else base)
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = self.interfaces[host]
        return env

    def tx_bytes(self, host: int) -> int:
        """Bytes ``host`` has sent over the link (its veth end's ``statistics/tx_bytes``: frames
        with their Ethernet, IP and TCP headers)."""
        path = f"/sys/class/net/{self.interfaces[host]}/statistics/tx_bytes"
        out = _ip("netns", "exec", self.namespaces[host], "cat", path)
        return int(out)


def _ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def _tc(namespace: str, *args: str) -> None:
    out = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {namespace}: {out.stderr.strip()}")


def _build(hosts: TwoHosts) -> None:
    """The namespaces, the veth pair between them, addresses, links up, shaping."""
    for ns in hosts.namespaces:
        _ip("netns", "add", ns)
    a, b = hosts.interfaces
    _ip(
        "link",
        "add",
        a,
        "netns",
        hosts.namespaces[0],
        "type",
        "veth",
        "peer",
        "name",
        b,
        "netns",
        hosts.namespaces[1],
    )
    for ns, interface, address in zip(hosts.namespaces, hosts.interfaces, ADDRESSES):
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", interface)
        _ip("-n", ns, "link", "set", interface, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        # no IPv6 on the link: its neighbour discovery would add frames to the byte counters
        subprocess.run(
            ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv6.conf.{interface}.disable_ipv6=1"],
            capture_output=True,
        )
        if hosts.rate_mbit is not None:
            # tbf: a token bucket of 256 KiB, packets wait at most 100 ms (netem is not available
            # everywhere; tbf and htb are)
            rate = f"{hosts.rate_mbit}mbit"
            _tc(
                ns,
                "qdisc",
                "add",
                "dev",
                interface,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "100ms",
            )


def _delete(hosts: TwoHosts) -> None:
    """Delete the namespaces (their veth ends and qdiscs go with them); quiet when absent."""
    for ns in hosts.namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextlib.contextmanager
def two_hosts(rate_mbit: Optional[float] = None):
    """Build two hosts joined by a link of ``rate_mbit`` Mbit/s each way (None: as fast as the
    machine), yield a :class:`TwoHosts`, delete everything on exit, also on SIGTERM."""
    tag = f"{os.getpid()}n{next(_counter)}"
    hosts = TwoHosts(
        namespaces=[f"vistrain-{tag}-a", f"vistrain-{tag}-b"],
        interfaces=[f"vt{tag}a", f"vt{tag}b"],  # interface names: at most 15 characters
        rate_mbit=rate_mbit,
    )
    with _sigterm_raises():
        try:
            _build(hosts)
            yield hosts
        finally:
            _delete(hosts)


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises SystemExit inside the block (so ``finally`` clauses run), main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
