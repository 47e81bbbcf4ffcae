"""A socket guard for the test suite: traffic may go to loopback only (127.0.0.0/8, ::1).

The guard wraps Python's socket layer while the tests run:

* `connect`, `connect_ex`, `sendto` and `sendmsg` of an IPv4 / IPv6 socket to an address
  outside loopback raise `OutsideTraffic` before the call reaches the kernel, so no packet
  is sent (a UDP `connect` sends none anyway; a TCP one would send a SYN);
* name lookups (`getaddrinfo`, which `create_connection`, urllib3 and httpx go through,
  and `gethostbyname[_ex]`) of any name but `localhost` raise before the resolver is
  asked: a lookup is itself traffic to a DNS server. IP literals resolve (no traffic),
  and their connect is checked;
* Unix sockets (AF_UNIX) and the kernel's own families (netlink) pass.

Every refusal is also recorded, so a library that catches the error (most retry loops
do) cannot hide it: the hooks at the end of this module (a pytest plugin: `conftest.py`
imports them, `pytest -p netguard` loads them alone) fail the test during which it happened.

The guard sees Python's sockets only. C extensions that open their own (gRPC inside Ray)
are fenced by a network namespace instead (`netns.py`).
"""

from __future__ import annotations

import ipaddress
import socket
import threading

import pytest

#: names that resolve to loopback from /etc/hosts, never through a DNS server
LOCAL_NAMES = frozenset({"localhost", "localhost.", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
INET = (socket.AF_INET, socket.AF_INET6)


class OutsideTraffic(PermissionError):
    """A socket call the guard refused: its address is outside loopback."""


def is_loopback(host) -> bool:
    """Whether `host` (an IP literal, with an optional IPv6 zone) is a loopback address."""
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    try:
        ip = ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _is_literal(host) -> bool:
    try:
        ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        return False
    return True


class Guard:
    """The wrappers, what they replaced, and every refusal (`violations`, in order)."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self._lock = threading.Lock()
        self._saved: dict[tuple[object, str], object] = {}

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def refuse(self, what: str, address) -> None:
        message = f"{what} {address!r}: outside loopback (tests may reach 127.0.0.0/8 and ::1 only)"
        with self._lock:
            self.violations.append(message)
        raise OutsideTraffic(message)

    def take(self) -> list[str]:
        """The refusals since the last call."""
        with self._lock:
            taken, self.violations = self.violations, []
        return taken

    def check_address(self, what: str, family, address) -> None:
        if family not in INET or not isinstance(address, tuple) or not address:
            return  # AF_UNIX paths, netlink, and sockets with no address (sendto on a connected socket)
        host = address[0]
        if isinstance(host, bytes):
            host = host.decode(errors="replace")
        if is_loopback(host) or (not _is_literal(host) and str(host).lower() in LOCAL_NAMES):
            return
        self.refuse(what, address)

    def check_name(self, what: str, host) -> None:
        if host is None:
            return
        if isinstance(host, bytes):
            host = host.decode(errors="replace")
        if _is_literal(host) or str(host).lower() in LOCAL_NAMES:
            return
        self.refuse(what, host)

    def install(self) -> None:
        """Wrap the socket layer (idempotent)."""
        if self.installed:
            return
        guard = self
        cls = socket.socket
        connect, connect_ex, sendto, sendmsg = cls.connect, cls.connect_ex, cls.sendto, cls.sendmsg
        getaddrinfo, byname, byname_ex = socket.getaddrinfo, socket.gethostbyname, socket.gethostbyname_ex

        def guarded_connect(self, address):
            guard.check_address("connect to", self.family, address)
            return connect(self, address)

        def guarded_connect_ex(self, address):
            guard.check_address("connect to", self.family, address)
            return connect_ex(self, address)

        def guarded_sendto(self, data, *args):
            guard.check_address("sendto", self.family, args[-1] if args else None)
            return sendto(self, data, *args)

        def guarded_sendmsg(self, buffers, *args):
            guard.check_address("sendmsg to", self.family, args[2] if len(args) > 2 else None)
            return sendmsg(self, buffers, *args)

        def guarded_getaddrinfo(host, *args, **kwargs):
            guard.check_name("name lookup of", host)
            return getaddrinfo(host, *args, **kwargs)

        def guarded_byname(host):
            guard.check_name("name lookup of", host)
            return byname(host)

        def guarded_byname_ex(host):
            guard.check_name("name lookup of", host)
            return byname_ex(host)

        for owner, name, wrapper in ((cls, "connect", guarded_connect), (cls, "connect_ex", guarded_connect_ex),
                                     (cls, "sendto", guarded_sendto), (cls, "sendmsg", guarded_sendmsg),
                                     (socket, "getaddrinfo", guarded_getaddrinfo),
                                     (socket, "gethostbyname", guarded_byname),
                                     (socket, "gethostbyname_ex", guarded_byname_ex)):
            self._saved[(owner, name)] = owner.__dict__.get(name)
            setattr(owner, name, wrapper)

    def uninstall(self) -> None:
        for (owner, name), before in self._saved.items():
            if before is None:
                delattr(owner, name)  # it was inherited from the C type
            else:
                setattr(owner, name, before)
        self._saved.clear()


#: the suite's one guard (conftest installs it for the whole test run; the Ray host installs its own)
GUARD = Guard()


# --- the pytest plugin ---------------------------------------------------------------------------------------


def pytest_configure(config):
    """The guard is up before any test module is imported, and stays up for the whole test run."""
    GUARD.install()


def pytest_unconfigure(config):
    GUARD.uninstall()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fail the phase (setup, call or teardown) during which a socket went for an address outside loopback, even
    when the code under test caught the guard's error (a retry loop, a broad `except`)."""
    outcome = yield
    refused = GUARD.take()
    if refused:
        report = outcome.get_result()
        message = "network guard: " + "; ".join(dict.fromkeys(refused))
        report.outcome = "failed"
        report.longrepr = message if not report.longrepr else f"{message}\n{report.longrepr}"
