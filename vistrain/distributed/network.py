"""The network settings a job across machines needs, checked before anything starts.

Every rank tells its peers an address to connect to. gloo takes it from ``GLOO_SOCKET_IFNAME`` (an
interface), else from resolving the machine's host name; NCCL from ``NCCL_SOCKET_IFNAME``, else its
own choice of interface. docs/distributed.md ("Network settings across nodes") says what to set.
"""

import socket
from typing import Mapping, Optional

from vistrain.config.errors import ConfigError


def check_gloo_interface(
    backend: str, spans_machines: bool, init_method: str, environ: Mapping[str, str]
) -> None:
    """ConfigError (one line) for a gloo job across machines that would announce 127.0.0.1 to its
    peers: without ``GLOO_SOCKET_IFNAME`` gloo takes this machine's address from its host name, and
    where that resolves to a loopback address the other nodes' ranks fail to connect (after the
    timeout). Jobs whose rendezvous is itself on a loopback address run on one machine: fine."""
    if backend != "gloo" or not spans_machines or environ.get("GLOO_SOCKET_IFNAME"):
        return
    host = _rendezvous_host(init_method, environ)
    if host is None or _is_loopback(host):
        return
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return  # gloo will say what it cannot resolve
    if _is_loopback(address):
        raise ConfigError(
            f"this machine's host name {name!r} resolves to {address}, which gloo would announce to the "
            f"ranks of other nodes: set GLOO_SOCKET_IFNAME to the interface that reaches {host} (e.g. eth0) "
            f"on every node"
        )


def _rendezvous_host(init_method: str, environ: Mapping[str, str]) -> Optional[str]:
    if init_method.startswith("tcp://"):
        return init_method[len("tcp://") :].rpartition(":")[0]
    if init_method.startswith("env://"):
        return environ.get("MASTER_ADDR")
    return None  # file://: no address to compare with


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
