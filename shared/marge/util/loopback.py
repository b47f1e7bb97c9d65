"""Keep DDP's rendezvous store on loopback when the whole run is on one machine (the embedded default).

torch.distributed's TCPStore server, which rank 0 starts for the process group's rendezvous, listens on every
interface (`::`/0.0.0.0) whatever MASTER_ADDR says, and torch has no setting for its bind address. It takes
a listening socket instead (`master_listen_fd`), and a multi-tenant store reuses the server already running on
its port in the same process. So, in rank 0's process and only when MASTER_ADDR is a loopback address, this
starts that server first, on a socket bound to MASTER_ADDR itself; the store torch then creates is a tenant
of it. The driver installs it in the local cluster's worker processes (Ray's `worker_process_setup_hook`);
on a multi-node cluster MASTER_ADDR is not loopback and nothing changes.

The same hook points gloo at the node's Ray address on a host whose name resolves to loopback
(`bind_gloo_to_node_address`), where ranks on other nodes could not otherwise reach this one.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

from marge.util.net import is_loopback

log = logging.getLogger(__name__)

SETUP_HOOK = f"{__name__}.install"
"""What a program that starts a local Ray for trainers hands it as `worker_process_setup_hook` (`local_ray`)."""

_SERVERS: list = []
"""The loopback servers started in this process (kept alive for the process group's lifetime)."""


def start_loopback_server(host: str, port: int, world_size: int, timeout: timedelta, use_libuv: bool = True):
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    store = TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False, multi_tenant=True,
                     use_libuv=use_libuv, master_listen_fd=sock.detach())  # the store owns the socket now
    _SERVERS.append(store)
    return store


def install() -> None:
    """Ray's `worker_process_setup_hook`: wrap torch's store factory as described in the module docstring."""
    import importlib

    try:  # `import torch.distributed.rendezvous as m` would bind the function torch.distributed exports by that name
        rendezvous = importlib.import_module("torch.distributed.rendezvous")
    except ImportError:  # a worker without torch.distributed has no rendezvous to guard
        return
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None or getattr(original, "loopback_guarded", False):
        if original is None:
            log.warning("this torch has no _create_c10d_store: DDP's rendezvous store listens on every interface")
        return

    def create_c10d_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        agent_store = getattr(rendezvous, "_torchelastic_use_agent_store", lambda: False)()
        if rank == 0 and is_loopback(hostname) and not agent_store:
            start_loopback_server(hostname, port, world_size, timeout, use_libuv)
        return original(hostname, port, rank, world_size, timeout, use_libuv)

    # a mark on the function and a private torch name, neither of which the types declare
    setattr(create_c10d_store, "loopback_guarded", True)
    setattr(rendezvous, "_create_c10d_store", create_c10d_store)
    bind_gloo_to_node_address()


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds `address`, if any."""
    import psutil  # a dependency of Ray

    return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == address for a in addrs)),
                None)


def bind_gloo_to_node_address() -> None:
    """Gloo gives the other ranks the address this host's name resolves to; where it resolves to loopback (an
    /etc/hosts line `127.0.0.1 <hostname>`, common on bare machines and in containers and network namespaces), a
    rank on another node would be told to connect to 127.0.0.1 and the process group never forms. Unless
    GLOO_SOCKET_IFNAME is set, this names the interface holding the node's Ray address instead; on one machine
    (a loopback node address) or where the name resolves elsewhere it changes nothing."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        resolved = socket.gethostbyname(socket.gethostname())
    except OSError:
        resolved = None
    if resolved is not None and not is_loopback(resolved):
        return
    try:
        import ray

        node_address = ray.util.get_node_ip_address()
    except Exception:  # not in a Ray worker: nothing to bind to
        return
    if is_loopback(node_address):
        return
    name = interface_of(node_address)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("this host's name resolves to %s: gloo binds interface %s (the node's address %s) so that ranks on "
                 "other nodes can reach this one", resolved, name, node_address)
