"""Separate hosts on one machine: Linux network namespaces joined by a bridge, on a private subnet (root only).

Each `NetNode` is a network namespace with its own loopback and one address on a /24 the network picks from
10.213.0.0/16 after checking that no route and no address of the machine overlaps it. The bridge that joins the
namespaces has no address, so the machine's own namespace has no route into the subnet: traffic stays between
the namespaced addresses (and each namespace's loopback), never reaching the machine's interfaces or the outside.
Processes are started inside a namespace with `ip netns exec`, in sessions of their own; `teardown` kills every
process in every namespace by PID (`ip netns pids`), then deletes the namespaces and the bridge, also after a
failed test. A node is cut off by taking its link on the bridge down, and lost by killing its processes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


class NamespacesUnavailable(RuntimeError):
    """Why this machine cannot make network namespaces (the tests that need them skip, saying so)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def machine_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the machine routes or has an address in (all routing tables)."""
    nets = []
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "")
        if dst == "default":
            continue
        try:
            nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
        except ValueError:
            continue
    for link in json.loads(ip("-j", "-4", "addr").stdout or "[]"):
        for a in link.get("addr_info", []):
            nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return nets


def free_subnet() -> ipaddress.IPv4Network:
    taken = machine_networks()
    candidates = list(range(1, 255))
    random.Random(os.getpid()).shuffle(candidates)
    for third in candidates:
        subnet = ipaddress.ip_network(f"10.213.{third}.0/24")
        if not any(subnet.overlaps(n) for n in taken):
            return subnet
    raise NamespacesUnavailable("no free /24 in 10.213.0.0/16 on this machine")


def check_available() -> None:
    if os.geteuid() != 0:
        raise NamespacesUnavailable("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("the `ip` command (iproute2) is not installed")
    probe = f"mgprobe{os.getpid() % 100000}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise NamespacesUnavailable(f"`ip netns add` failed: {made.stderr.strip()}")
    ip("netns", "del", probe, check=False)


def remove_stale() -> list[str]:
    """Namespaces and links a killed test run left behind (their creator's PID, the tag, is gone): their processes
    are killed and they are removed. Returns what was removed."""
    removed = []
    for name in ip("netns", "list", check=False).stdout.split():
        if name.startswith("mg") and "n" in name[2:] and name[2:].split("n")[0].isdigit():
            tag = name[2:].split("n")[0]
            if not Path(f"/proc/{int(tag)}").exists():
                stale = NamespacedNetwork(0, tag=tag)
                stale.nodes = [NetNode(name, "", "")]
                stale.kill(stale.nodes[0], signal.SIGKILL)
                ip("netns", "del", name, check=False)
                removed.append(name)
    for line in ip("-o", "link").stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        tag = link[4:] if link.startswith("mgbr") else link[3:8] if link.startswith(("mgh", "mgp")) else ""
        if tag.isdigit() and not Path(f"/proc/{int(tag)}").exists():
            ip("link", "del", link, check=False)
            removed.append(link)
    return removed


@dataclass
class NetNode:
    name: str
    """The namespace."""
    address: str
    host_link: str
    """Its veth's end on the bridge (down: the node is cut off)."""


@dataclass
class NamespacedNetwork:
    count: int
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000:05d}")
    nodes: list[NetNode] = field(default_factory=list)
    subnet: ipaddress.IPv4Network | None = None

    @property
    def bridge(self) -> str:
        return f"mgbr{self.tag}"

    def create(self) -> "NamespacedNetwork":
        check_available()
        self.subnet = free_subnet()
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("link", "set", self.bridge, "up")
            for k in range(self.count):
                node = NetNode(f"mg{self.tag}n{k}", str(self.subnet.network_address + k + 1), f"mgh{self.tag}{k}")
                peer = f"mgp{self.tag}{k}"
                ip("netns", "add", node.name)
                self.nodes.append(node)
                ip("link", "add", node.host_link, "type", "veth", "peer", "name", peer)
                ip("link", "set", node.host_link, "master", self.bridge)
                ip("link", "set", node.host_link, "up")
                ip("link", "set", peer, "netns", node.name)
                ip("-n", node.name, "addr", "add", f"{node.address}/{self.subnet.prefixlen}", "dev", peer)
                ip("-n", node.name, "link", "set", peer, "up")
                ip("-n", node.name, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as e:
            self.teardown()
            raise NamespacesUnavailable(f"could not build the namespaced network: {getattr(e, 'stderr', e)}") from None
        return self

    def popen(self, node: NetNode, argv: list[str], env: dict[str, str], log: Path, **kwargs) -> subprocess.Popen:
        """`argv` inside `node`'s namespace, in a session of its own, output to `log`."""
        with open(log, "ab") as out:
            return subprocess.Popen(["ip", "netns", "exec", node.name, *argv], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, **kwargs)

    def run(self, node: NetNode, argv: list[str], env: dict[str, str], timeout: float = 120,
            **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", node.name, *argv], env=env, capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def pids(self, node: NetNode) -> list[int]:
        done = ip("netns", "pids", node.name, check=False)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    def kill(self, node: NetNode, sig: int = signal.SIGKILL, wait_s: float = 10) -> list[int]:
        """Send `sig` to every process in `node`'s namespace and wait until they are gone; returns their PIDs."""
        victims = self.pids(node)
        for pid in victims:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait_s
        while self.pids(node) and time.time() < deadline:
            time.sleep(0.1)
        return victims

    def cut(self, node: NetNode) -> None:
        ip("link", "set", node.host_link, "down")

    def restore(self, node: NetNode) -> None:
        ip("link", "set", node.host_link, "up")

    def teardown(self) -> None:
        for node in self.nodes:
            self.kill(node, signal.SIGTERM, wait_s=10)
            self.kill(node, signal.SIGKILL, wait_s=5)
            ip("link", "del", node.host_link, check=False)  # both ends (the kernel frees a namespace's own lazily)
            ip("netns", "del", node.name, check=False)
        ip("link", "del", self.bridge, check=False)
        self.nodes = []

    def leftovers(self) -> list[str]:
        """Namespaces and links of this network still on the machine (empty after teardown)."""
        names = ip("netns", "list", check=False).stdout.split()
        links = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link").stdout.splitlines()]
        return [n for n in names + links if n.startswith((f"mg{self.tag}", f"mgbr{self.tag}", f"mgh{self.tag}",
                                                           f"mgp{self.tag}"))]
