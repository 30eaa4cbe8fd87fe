"""Which Host headers a server answers (laya_core/http/hosts.py), as pure logic; the real
server's refusals are in tests/integration/test_cross_site.py."""

from __future__ import annotations

import pytest

from laya_core.config.manifest import ServerConfig
from laya_core.http.hosts import HostRule, host_name, host_rule, is_loopback


@pytest.mark.parametrize(("header", "name"), [
    ("localhost", "localhost"), ("LocalHost:8000", "localhost"), ("127.0.0.1:80", "127.0.0.1"),
    ("[::1]", "::1"), ("[::1]:8000", "::1"), ("laya.example.com.:443", "laya.example.com"),
    ("[::1", None), ("[::1]x", None), ("[name]:80", None), ("a:b:c", None), ("h:port", None),
    ("", None), (":80", None),
])
def test_host_name(header: str, name: str | None) -> None:
    assert host_name(header) == name


def rule(host: str = "127.0.0.1", *allowed: str) -> HostRule:
    found = host_rule(ServerConfig(host=host, allowed_hosts=allowed))
    assert found is not None
    return found


@pytest.mark.parametrize("header", [
    "localhost", "localhost:8000", "127.0.0.1", "127.0.0.1:8000", "127.0.0.2:1234", "[::1]",
    "[::1]:8000", "[::ffff:127.0.0.1]:8000", "app.localhost:3000", "LOCALHOST.",
])
def test_loopback_names_are_served(header: str) -> None:
    assert rule().allows(header) and rule("::1").allows(header)


@pytest.mark.parametrize("header", [
    "rebind.evil.example", "rebind.evil.example:8000", "localhost.evil.example",
    "10.0.0.5:8000", "[2001:db8::1]", "evil:notaport", "127.0.0.1.evil.example",
])
def test_other_hosts_are_refused_on_loopback(header: str) -> None:
    assert not rule().allows(header)


def test_allowed_hosts_add_names_addresses_and_domains() -> None:
    r = rule("127.0.0.1", "laya.internal", "10.0.0.5", ".example.com")
    for header in ("laya.internal:8000", "10.0.0.5", "example.com", "a.b.example.com:1"):
        assert r.allows(header), header
    for header in ("laya.internal.evil", "10.0.0.6", "badexample.com", "example.org"):
        assert not r.allows(header), header


def test_where_the_check_runs() -> None:
    assert host_rule(ServerConfig(host="0.0.0.0")) is None  # reached by names nobody listed
    assert host_rule(ServerConfig(host="192.168.1.5")) is None
    assert host_rule(ServerConfig(host="127.0.0.1", allowed_hosts=("*",))) is None
    assert is_loopback("localhost") and is_loopback("::1") and is_loopback("127.8.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")
    # On 0.0.0.0 with names listed, the check runs; any address is the server's own.
    wide = rule("0.0.0.0", "laya.example.com")
    assert wide.allows("192.168.1.5:8000") and wide.allows("laya.example.com")
    assert not wide.allows("rebind.evil.example")
    # On a name, that name is the server's own.
    assert rule("localhost").allows("localhost:8000")
    named = rule("192.168.1.5", "laya.lan")
    assert named.allows("192.168.1.5") and named.allows("laya.lan")
    assert not named.allows("192.168.1.6")
