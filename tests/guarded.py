"""Programs the Ray tests run in a loopback-only network namespace (`netns.py`), under the socket guard.

* `python guarded.py serve SOCKET` — the Ray host: starts one local Ray instance the way
  `kvevict ab --executor ray` does (`RayExecutor.opened`), then runs the calls a test
  sends over the Unix socket SOCKET (`Host.call`): a module-level function of a test
  module, its arguments and result pickled. Every Ray test shares this one instance.
* `python guarded.py cli ARGS...` — `kvevict ARGS`, exiting 3 when the guard refused a
  socket (even one the code caught).

The namespace stops what the guard cannot see (Ray's C++ sockets, its dashboard's
metadata probe); the guard makes a Python-level attempt to leave a failure, not a quiet
refusal by the kernel.
"""

from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys
import time
import traceback
from contextlib import redirect_stderr
from multiprocessing.connection import Client, Listener
from pathlib import Path

import netns
from netguard import GUARD

KEY_VARIABLE = "KVEVICT_RAY_HOST_KEY"
#: seconds a test waits for one call in the Ray host (a small sweep takes seconds)
CALL_TIMEOUT = 300


def serve(path: str) -> None:
    """Start Ray, then answer calls until told to stop (or the test process goes away)."""
    GUARD.install()
    from kvevict.integrations.ray_executor import RayExecutor

    key = bytes.fromhex(os.environ[KEY_VARIABLE])
    with RayExecutor(workers=2).opened(), Listener(path, family="AF_UNIX", authkey=key) as listener:
        with listener.accept() as conn:
            while True:
                try:
                    message = conn.recv()
                except EOFError:
                    return
                if message is None:
                    conn.send(("ok", None, GUARD.take(), ""))
                    return
                module, name, args = message
                err = io.StringIO()
                try:
                    with redirect_stderr(err):
                        result = getattr(importlib.import_module(module), name)(*args)
                    conn.send(("ok", result, GUARD.take(), err.getvalue()))
                except BaseException:  # noqa: B036 - anything a test body raises goes back to the test
                    conn.send(("error", traceback.format_exc(), GUARD.take(), err.getvalue()))


def cli(args: list[str]) -> int:
    GUARD.install()
    from kvevict.cli import main

    code = 0
    try:
        main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    refused = GUARD.take()
    if refused:
        print("network guard: " + "; ".join(dict.fromkeys(refused)), file=sys.stderr)
        return 3
    return code


class Host:
    """The test side of `serve`: a Ray host in its own namespace, started once, called many times."""

    def __init__(self, folder: Path, env: dict) -> None:
        self.path = str(folder / "host.sock")
        key = os.urandom(16)
        self.log = folder / "host.log"
        argv = [sys.executable, str(Path(__file__).resolve()), "serve", self.path]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(netns.command(argv), stdout=log, stderr=log,
                                            env={**env, KEY_VARIABLE: key.hex()})
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the Ray host did not start: {self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.conn = Client(self.path, family="AF_UNIX", authkey=key)

    def call(self, function, *args):
        """`function(*args)` run in the host; its result, or an AssertionError carrying the host's traceback.
        A socket the guard refused in the host during the call (or Ray's start) fails it too."""
        self.conn.send((function.__module__, function.__name__, args))
        if not self.conn.poll(CALL_TIMEOUT):
            raise AssertionError(f"the Ray host did not answer {function.__name__} within {CALL_TIMEOUT} s: "
                                 f"{self.log.read_text()[-3000:]}")
        status, value, refused, stderr = self.conn.recv()
        if refused:
            raise AssertionError("network guard (Ray host): " + "; ".join(dict.fromkeys(refused)))
        if status == "error":
            raise AssertionError(f"in the Ray host:\n{value}")
        return value, stderr

    def close(self) -> None:
        try:
            self.conn.send(None)
            self.conn.recv()
            self.conn.close()
        except (OSError, EOFError):
            pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(cli(sys.argv[2:]))
