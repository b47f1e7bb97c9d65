"""Processes and sockets of a test's servers, read from /proc: what listens where, who belongs to a session, which
processes of a title are this test's own."""

from __future__ import annotations

import os
from pathlib import Path

LOOPBACK = {"127.0.0.1", "::1"}


def listening_addresses(pids: list[int]) -> list[tuple[str, int, str]]:
    """(address, port, owner's command line) of every TCP socket in LISTEN state that one of `pids` holds (from
    each process's own /proc/PID/net/tcp{,6}: the tables of its network namespace)."""
    import ipaddress

    inodes: dict[str, str] = {}
    for pid in pids:
        try:
            owner = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = owner
        except OSError:
            continue
    out = []
    tables, namespaces = [], set()
    for pid in pids:
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if namespace in namespaces:  # one read of each namespace's tables
            continue
        namespaces.add(namespace)
        for name, width in (("tcp", 4), ("tcp6", 16)):
            try:
                tables.append((Path(f"/proc/{pid}/net/{name}").read_text(), width))
            except OSError:
                continue
    seen = set()
    for text, width in tables:
        for line in text.splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))  # little-endian 32-bit words
            address = ipaddress.ip_address(raw)
            address = getattr(address, "ipv4_mapped", None) or address
            if inode not in seen:
                seen.add(inode)
                out.append((str(address), int(hex_port, 16), inodes[inode]))
    return out


def pids_in_session(session_id: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session_id:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def pids_with_title(prefix: str, root: int | None = None) -> list[int]:
    """This test's processes whose command line starts with `prefix` (Ray titles its workers
    `ray::<Class>[.<method>]`): descendants of `root` (default: this process, which started the test's Ray;
    `marge.util.local_ray.process_tree`), never another run's on the same machine (a shared CI runner, a user's
    job)."""
    from marge.util.local_ray import process_tree

    pids = []
    for pid in process_tree({os.getpid() if root is None else root}):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(prefix.encode()):
                pids.append(pid)
        except OSError:
            continue
    return sorted(pids)
