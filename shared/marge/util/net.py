"""Network addresses, decided one way everywhere."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or the name `localhost`. A name that merely starts
    with "127." (`127.example.com`) is not: it resolves wherever its DNS says."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"
