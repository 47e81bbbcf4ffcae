"""Serving engines started on loopback, the deployments of the audit's tests and benchmark: the one way any of
them is started, waited for and stopped.

Each engine's module builds its command line and environment (`llama_launch.py`: llama.cpp's llama-server;
`vllm_launch.py`: vLLM's OpenAI-compatible server); `serve` runs it as the leader of a process group of its
own, so the engine and every worker process it forks are one group, waits until its `/health` answers 200,
yields the base URL, and at the end stops the whole group (SIGTERM, then SIGKILL after `STOP_SECONDS`): no
engine process outlives the `with` block, whatever it forked. On Linux the server is also told to stop when this
process dies without a chance to (killed, or out of memory: `PR_SET_PDEATHSIG`), so it never lingers holding its
memory.

A server may listen on a Unix socket instead of a port (`socket_path`): then it can run in a network namespace
of its own that holds only loopback (`isolate`: a function of the command line, as the tests' `netns.command`),
so nothing it sends can leave the machine, and `relay.unix_relay` reaches it from a port on 127.0.0.1 here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..errors import KvevictError
from .relay import unix_relay

#: seconds a stopped server's process group gets to exit before it is killed
STOP_SECONDS = 20.0
#: prctl's option: the signal a process gets when the thread that forked it exits (linux/prctl.h)
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, process: subprocess.Popen, name: str, seconds: float, log: Path | None) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if process.poll() is not None:
            raise KvevictError(f"{name} exited with {process.returncode} before it served"
                               + (f": its log is {log}" if log else ""))
        with contextlib.suppress(urllib.error.URLError, ConnectionError, OSError):
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        time.sleep(0.2)
    raise KvevictError(f"{name} did not answer /health within {seconds:.0f} s")


def _dies_with_parent() -> Callable[[], None] | None:
    """The child's hook before it runs the server: SIGTERM it when the thread that started it ends (Linux; None
    elsewhere), so `serve` belongs in a thread that lives as long as the server should. The function is looked up
    here, in the parent: the child only calls it (nothing imported between fork and exec)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group, SIGKILL to what is left after `STOP_SECONDS`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # workers the server left behind, or the server itself
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextlib.contextmanager
def serve(argv: Sequence[str], name: str, port: int | None = None, socket_path: Path | None = None,
          env: dict[str, str] | None = None, log: Path | None = None, seconds: float = 120.0,
          isolate: Callable[[list[str]], list[str]] | None = None) -> Iterator[str]:
    """Run `argv` (a server listening on 127.0.0.1:`port`, or on the Unix socket `socket_path`), wait for its
    `/health`, yield its base URL on loopback; stop its process group at the end. `env`: variables set on top of
    this process's; `log`: where its stdout and stderr go; `isolate`: the command line rewritten to run it in a
    network namespace of its own (a socket path only: a port there is not reachable from here)."""
    if (port is None) == (socket_path is None):
        raise KvevictError("a server listens on a port or on a Unix socket: give one of them")
    if isolate is not None and socket_path is None:
        raise KvevictError("an isolated server is reached through a Unix socket: give socket_path")
    command = isolate(list(argv)) if isolate else list(argv)
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, **(env or {})}, preexec_fn=_dies_with_parent())
    try:
        with contextlib.ExitStack() as stack:
            if socket_path is not None:
                port = stack.enter_context(unix_relay(socket_path))
            url = f"http://127.0.0.1:{port}"
            _wait(url, process, name, seconds, log)
            yield url
    finally:
        _stop(process)
        if log:
            out.close()
