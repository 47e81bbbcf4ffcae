"""Starting, reaching and stopping an engine (`audit/launch.py`, `audit/relay.py`), on a stand-in engine.

The stand-in is a Python HTTP server that forks a worker first (as vLLM forks its engine core and workers)
and writes the worker's pid to a file: `/health` must be waited for, the yielded URL must reach it, and when
the block ends no process of its group may be left. Listening on a Unix socket, it is reached through the
relay; run in a network namespace of its own, through the relay too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import urllib.request

import pytest

from kvevict.audit.launch import free_port, serve
from kvevict.errors import KvevictError

import netns

ENGINE = r"""
import http.server, os, socketserver, subprocess, sys, time
time.sleep(0.5)  # not ready at once: /health must be waited for
worker = subprocess.Popen(["sleep", "600"])
open(sys.argv[2], "w").write(f"{worker.pid} {os.getpid()}")

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ok" if self.path == "/health" else b"namespace:" + os.readlink("/proc/self/ns/net").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self):
        return "local"

    def log_message(self, *args):
        pass

where = sys.argv[1]
if where.isdigit():
    http.server.HTTPServer(("127.0.0.1", int(where)), Handler).serve_forever()
else:
    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        pass
    Server(where, Handler).serve_forever()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead but not yet reaped by its parent
        return stat.read().split(")")[-1].split()[0] != "Z"


def read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def gone(pid: int, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_port_server_is_waited_for_reached_and_stopped_with_its_workers(tmp_path):
    port, pidfile = free_port(), tmp_path / "worker.pid"
    with serve([sys.executable, "-c", ENGINE, str(port), str(pidfile)], "stand-in", port=port, seconds=30) as url:
        assert url == f"http://127.0.0.1:{port}" and read(url + "/health") == "ok"
        worker = int(pidfile.read_text().split()[0])
        assert alive(worker)
    assert gone(worker)  # the whole process group was stopped, not only the server


def test_a_unix_socket_server_is_reached_through_the_relay(tmp_path):
    path, pidfile = tmp_path / "engine.sock", tmp_path / "worker.pid"
    with serve([sys.executable, "-c", ENGINE, str(path), str(pidfile)], "stand-in", socket_path=path,
               seconds=30) as url:
        assert read(url + "/health") == "ok"
        worker = int(pidfile.read_text().split()[0])
    assert gone(worker)


@pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
def test_an_isolated_server_runs_in_a_namespace_of_its_own(tmp_path):
    """Its network namespace is not this process's, and the relay still reaches it."""
    path, pidfile = tmp_path / "engine.sock", tmp_path / "worker.pid"
    with serve([sys.executable, "-c", ENGINE, str(path), str(pidfile)], "stand-in", socket_path=path, seconds=30,
               isolate=netns.command) as url:
        theirs = read(url + "/where").removeprefix("namespace:")
        worker = int(pidfile.read_text().split()[0])
    assert theirs != os.readlink("/proc/self/ns/net")
    assert gone(worker)


OWNER = r"""
import os, signal, sys
from kvevict.audit.launch import free_port, serve
port = free_port()
with serve([sys.executable, "-c", sys.argv[1], str(port), sys.argv[2]], "stand-in", port=port, seconds=30):
    os.kill(os.getpid(), signal.SIGKILL)  # its owner dies with no chance to stop it
"""


def test_a_server_whose_owner_is_killed_stops_too(tmp_path):
    """The process that started the server is SIGKILLed inside the block: the server is told to stop all the same
    (Linux's parent-death signal), instead of lingering with its memory."""
    import subprocess

    pidfile = tmp_path / "pids"
    done = subprocess.run([sys.executable, "-c", OWNER, ENGINE, str(pidfile)], timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    worker, server = map(int, pidfile.read_text().split())
    try:
        assert done.returncode == -9
        assert gone(server, seconds=10)
    finally:  # the stand-in does not stop its worker when told to stop (vLLM's server stops its own)
        for pid in (worker, server):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_server_that_exits_is_reported_in_one_line(tmp_path):
    port = free_port()
    with pytest.raises(KvevictError, match="stand-in exited with 3 before it served"):
        with serve([sys.executable, "-c", "raise SystemExit(3)"], "stand-in", port=port, seconds=30):
            pass


def test_an_isolated_server_needs_a_socket():
    with pytest.raises(KvevictError, match="through a Unix socket"):
        with serve(["true"], "stand-in", port=free_port(), isolate=netns.command):
            pass
