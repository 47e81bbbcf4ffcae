"""The network guard fails a test that reaches for an address outside loopback, and lets loopback and Unix sockets be.

The proof runs pytest with the guard (`-p netguard`) on a small file of tests that put back the kinds of connect
the suite must never make: to documentation addresses (RFC 5737 / RFC 3849, never routed, built from their parts so
no test names one as a literal) and to a name under `.invalid` (RFC 6761, never resolves). That inner pytest runs
in a loopback-only network namespace, so even a broken guard would send nothing off this machine; where no
namespace can be made, only the cases that send no packet even unguarded run (a UDP `connect` only picks a peer).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import netns

TESTS = Path(__file__).resolve().parent

INNER = '''
import os
import socket
import threading

import pytest

DOC4 = ".".join(("192", "0", "2", "1"))
DOC6 = ":".join(("2001", "db8", "", "1"))


def udp(family=socket.AF_INET):
    return socket.socket(family, socket.SOCK_DGRAM)


# --- outside loopback: each must fail ---------------------------------------------------------------------------

def test_udp_connect_v4():
    with udp() as s:
        s.connect((DOC4, 9))


def test_udp_connect_ex_v6():
    with udp(socket.AF_INET6) as s:
        s.connect_ex((DOC6, 9, 0, 0))


def test_udp_connect_v4_mapped_in_v6():
    with udp(socket.AF_INET6) as s:
        s.connect(("::ffff:" + DOC4, 9))


def test_caught_by_the_code_under_test():
    with udp() as s:
        try:
            s.connect((DOC4, 9))
        except OSError:
            pass  # a retry loop or a broad except must not hide it


def test_in_a_thread():
    def reach():
        with udp() as s:
            try:
                s.connect((DOC4, 9))
            except OSError:
                pass
    worker = threading.Thread(target=reach)
    worker.start()
    worker.join()


def test_sendto_unbound():
    with udp() as s:
        s.sendto(b"x", (DOC4, 9))


def test_tcp_create_connection():
    socket.create_connection((DOC4, 9), timeout=1).close()


def test_name_lookup():
    socket.getaddrinfo("kvevict.example.invalid", 80)


def test_connect_by_name():
    with socket.socket() as s:
        s.connect(("kvevict.example.invalid", 80))


def test_create_connection_by_name():
    socket.create_connection(("kvevict.example.invalid", 80), timeout=1).close()


# --- loopback and Unix sockets: each must pass -------------------------------------------------------------------

def test_allowed_loopback_tcp_and_udp():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        for host in ("127.0.0.1", "localhost"):
            with socket.create_connection((host, port), timeout=5):
                server.accept()[0].close()
    with udp() as s:
        s.sendto(b"x", ("127.0.0.1", 9))
        s.connect(("127.0.0.2", 9))


def test_allowed_unix(tmp_path):
    path = str(tmp_path / "sock")
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as client:
        server.bind(path)
        server.listen(1)
        client.connect(path)
    a, b = socket.socketpair()
    a.sendall(b"ok")
    assert b.recv(2) == b"ok"
    a.close()
    b.close()
'''

#: the inner tests that send no packet even if the guard let them through
SILENT = ("test_udp_connect_v4", "test_udp_connect_ex_v6", "test_udp_connect_v4_mapped_in_v6",
          "test_caught_by_the_code_under_test", "test_in_a_thread")
ALLOWED = ("test_allowed_loopback_tcp_and_udp", "test_allowed_unix")


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Each inner test's outcome ('passed' / 'failed' / 'error') and its failure message."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        kind = "passed" if problem is None else ("failed" if problem.tag == "failure" else "error")
        text = "" if problem is None else (problem.get("message") or "") + (problem.text or "")
        found[case.get("name")] = (kind, text)
    return found


def test_the_guard_fails_every_connect_outside_loopback(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    in_namespace = netns.unavailable() is None
    select = [] if in_namespace else ["-k", " or ".join(SILENT + ALLOWED)]
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "netguard", "-p", "no:cacheprovider",
            f"--junitxml={tmp_path / 'junit.xml'}", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py"),
            *select]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run(netns.command(argv) if in_namespace else argv, capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    got = outcomes(tmp_path / "junit.xml")
    outside = [name for name in got if name not in ALLOWED]
    assert set(SILENT) <= set(outside) and (not in_namespace or len(outside) == 10), done.stdout
    for name in ALLOWED:
        assert got[name][0] == "passed", got[name][1]
    for name in outside:
        kind, text = got[name]
        assert kind == "failed", (name, kind, text)
        assert "network guard:" in text and "outside loopback" in text, (name, text)
        assert ("kvevict.example.invalid" in text) == ("name" in name), (name, text)
        assert "OSError: [Errno" not in text, (name, text)  # refused by the guard, not by the kernel
    assert done.returncode == 1
