"""A port on 127.0.0.1 relayed to a Unix socket: how a server in a network namespace of its own is reached.

A namespace that holds only loopback (`unshare --net`) keeps everything a server sends on this machine, but
its loopback is not this one's: a port it binds cannot be reached from here. A Unix socket is a file, seen
from both sides, so the server listens on one and this relay accepts connections on a free loopback port and
copies bytes both ways between each of them and a fresh connection to the socket (a thread per direction).
A connection made before the server listens is closed at once, as a refused one would be.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

#: bytes copied per read
CHUNK = 1 << 16


def _pump(source: socket.socket, target: socket.socket) -> None:
    """Copy until `source` ends, then end `target`'s writing side (the other direction may still be open)."""
    with contextlib.suppress(OSError):
        while data := source.recv(CHUNK):
            target.sendall(data)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)


def _serve(client: socket.socket, path: Path) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(str(path))
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


@contextlib.contextmanager
def unix_relay(path: Path) -> Iterator[int]:
    """Relay a free port on 127.0.0.1 to the Unix socket `path` while the block runs; yields the port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            threading.Thread(target=_serve, args=(client, path), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()
