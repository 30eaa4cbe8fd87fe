"""Which ``Host`` a request may name: the defence against DNS rebinding. A plain ASGI
middleware.

A page on ``http://rebind.evil.example`` whose DNS name its owner then points at 127.0.0.1
is, to the browser, the same origin as before: CORS does not apply, and the page reads
every response of a server on this machine. The request still says ``Host:
rebind.evil.example``. So a server on a loopback address answers only the names that are
its own: loopback addresses, ``localhost`` and its subdomains (RFC 6761; browsers resolve
them to loopback themselves), the host it listens on, and ``[server] allowed_hosts``. On
any other address the names it is reached by cannot be known, so the check runs only when
``allowed_hosts`` lists them.

The port is not compared: a tunnel or a proxy (``ssh -L 9000:localhost:8000``) changes it,
and a rebinding page can choose its port but not make its name ours. A request with no
Host header, or an empty one (HTTP/1.0 clients), is served: every browser sends one.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

import attrs
from starlette.types import ASGIApp, Receive, Scope, Send

from laya_core.config.manifest import ServerConfig
from laya_core.http.errors import APIError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(text: str) -> IPAddress | None:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return ip


def _is_localhost(name: str) -> bool:
    return name == "localhost" or name.endswith(".localhost")


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` (the manifest's ``[server] host``) listens on loopback
    only: a loopback address, ``localhost``, or a name all of whose addresses are loopback
    (Debian's /etc/hosts gives the machine's own name 127.0.1.1)."""
    ip = _ip(host)
    if ip is not None:
        return ip.is_loopback
    if _is_localhost(host.lower()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    ips = [_ip(str(info[4][0]).split("%")[0]) for info in infos]
    return bool(ips) and all(ip is not None and ip.is_loopback for ip in ips)


def host_name(header: str) -> str | None:
    """The host of a Host header without its port, lowercased, IPv6 without brackets;
    None when the header is not ``host[:port]``."""
    header = header.strip().lower()
    if header.startswith("["):
        name, bracket, rest = header[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return name if _ip(name) is not None else None
    name, colon, port = header.rpartition(":")
    if not colon:
        name = port
    elif not port.isdigit():
        return None
    name = name.removesuffix(".")
    return name if name and ":" not in name else None


@attrs.frozen
class HostRule:
    """The Host names a server answers to (see the module's docstring)."""

    listen_host: str  # [server] host, lowercased
    allowed: tuple[str, ...]  # [server] allowed_hosts: names, addresses, ".suffix"

    def allows(self, header: str) -> bool:
        name = host_name(header)
        if name is None:
            return False
        ip = _ip(name)
        if ip is not None:
            listen = _ip(self.listen_host)
            return ip.is_loopback or ip == listen or bool(listen and listen.is_unspecified) \
                or any(ip == _ip(a) for a in self.allowed)
        if _is_localhost(name) or name == self.listen_host or name in self.allowed:
            return True
        return any(a.startswith(".") and (name.endswith(a) or name == a[1:])
                   for a in self.allowed)

    def names(self) -> str:
        """The names it answers to, for an error message."""
        own = ["localhost", "loopback addresses"]
        listen = _ip(self.listen_host)
        if listen is not None and listen.is_unspecified:
            own.append("any IP address")
        elif listen is None or not listen.is_loopback:
            own.append(self.listen_host)
        return ", ".join(own + list(self.allowed))


def host_rule(server: ServerConfig) -> HostRule | None:
    """The rule for a server, or None where no Host is refused: not on loopback and no
    ``allowed_hosts``, or ``"*"`` among them."""
    if "*" in server.allowed_hosts:
        return None
    if not server.allowed_hosts and not is_loopback(server.host):
        return None
    return HostRule(server.host.lower().removesuffix("."), server.allowed_hosts)


class HostCheckMiddleware:
    """Answers a request whose Host header the rule refuses with a 403 error object."""

    def __init__(self, app: ASGIApp, rule: HostRule) -> None:
        self.app = app
        self.rule = rule

    def _refused(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        for key, value in headers:
            if key != b"host":
                continue
            host = value.decode("latin-1")
            # Hypercorn gives a request without Host an empty one (HTTP/1.0 clients).
            if host.strip() and not self.rule.allows(host):
                return host
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the app serves no websockets; lifespan has no Host
            await self.app(scope, receive, send)
            return
        host = self._refused(scope["headers"])
        if host is None:
            await self.app(scope, receive, send)
            return
        error = APIError(
            403, f"the Host header {host!r} does not name this server, which answers to "
            f"{self.rule.names()}. A name of your own (a proxy's, a tunnel's) can be added to "
            "[server] allowed_hosts (laya serve --allowed-hosts); this check stops web pages "
            "whose DNS name points at this machine from reading its responses",
            param="Host", code="host_not_allowed")
        await error.response()(scope, receive, send)
