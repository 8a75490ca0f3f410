"""Which ``Host`` headers the server answers: the guard against DNS rebinding.

A web page on another site can point its own name at 127.0.0.1 (DNS rebinding) and then talk
to a local server as "same origin"; its requests still carry that site's name in ``Host``.
So a name must be a localhost name (``localhost``, ``*.localhost``), the address the server
is bound to, or one given with ``--allow-host``. An IP literal is always answered: a page
reaches it only from that address itself, which rebinding cannot fake. A request without
``Host`` (HTTP/1.0) comes from no browser, which always sends one.
"""

from __future__ import annotations

import ipaddress


class HostAllowList:
    def __init__(self, bound_host: str, extra: tuple[str, ...] = ()):
        self.names = frozenset(_name(h) for h in (bound_host, *extra) if h)

    def allows(self, header: bytes | None) -> bool:
        if header is None:
            return True
        try:
            name = _name(_strip_port(header.decode("ascii")))
        except UnicodeDecodeError:
            return False
        if name == "localhost" or name.endswith(".localhost") or name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _name(host: str) -> str:
    return host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")


def _strip_port(host: str) -> str:
    """'[::1]:8080' -> '[::1]', 'example.com:80' -> 'example.com'."""
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host
