"""A stand-in for llama-server (or vLLM, or another OpenAI-compatible server) on 127.0.0.1: its routes and
answer shapes, a synthetic model whose next-token distribution depends on whether the first token is still in
the cache, and llama-server's context shift.

The synthetic model: after token t, the top-k ids are `(t * 7 + i * 13 + c) % 1000 + 10` with log-probabilities
from a fixed ladder (most likely first); `c` is 0 while the cache still holds the prompt's first token and
`SINK_LOST` once a shift discarded it. A reference (a context that never shifts) and a deployment that keeps
its first token therefore agree token for token; one that drops it departs at the first shift. `kv_loss`
stands for a lossy KV cache (quantized): every token's ladder is flattened by that much from the first, the
top-1 unchanged, so the loss has no eviction point. Failures a real server shows (503/429 before answering, no
log-probabilities, another model name, another tokenizer, a redirect) are switched on by `FakeConfig`.

`/props` answers as llama-server's does: the request defaults (`n_keep` 0 whatever `--keep` is), the context
per slot, the model's path and the build; never the KV cache type. As vLLM (`kind="vllm"`): no `/props`, a
`/version`, `/v1/models` owned by vllm with `max_model_len` (and a `created` time that changes per request),
`/metrics` with `cache_config_info`, and a request past the context refused rather than shifted.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SINK_LOST = 5
LADDER = [-0.5] + [-2.0 - 0.5 * i for i in range(19)]  # top-20 mass about 0.95: a tail remains


@dataclass
class FakeConfig:
    n_ctx: int = 128
    keep: int = 0
    name: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    logprobs: bool = True
    busy: int = 0  # answer 503 to this many requests first
    limited: int = 0  # answer 429 with Retry-After: 0 to this many requests first
    key: str | None = None  # the bearer token it requires
    truncate: bool = False  # cut a prompt beyond the context to its last half instead of refusing it
    shift_tokenizer: bool = False  # answer every token id plus one (another tokenizer)
    kind: str = "llama-server"  # or "vllm", or "openai" (another OpenAI-compatible server: no /tokenize either)
    kv_loss: float = 0.0  # the lossy KV cache's flattening of every token's ladder (module docstring)
    kv_type: str = "auto"  # vLLM's cache_dtype, in /metrics
    build: str = "b11434-cpu"  # llama-server's build_info, vLLM's version
    redirect: str | None = None  # answer 307 to this base URL (the same path) instead of serving
    requests: list = field(default_factory=list)  # (path, body, headers) of every request received


def top(last: int, sink_lost: bool, k: int, kv_loss: float = 0.0) -> list[tuple[int, float]]:
    c = SINK_LOST if sink_lost else 0
    ladder = [LADDER[0] - kv_loss] + [lp + kv_loss / 4 for lp in LADDER[1:]]
    return [((last * 7 + i * 13 + c) % 1000 + 10, ladder[i]) for i in range(min(k, len(LADDER)))]


def generate(cfg: FakeConfig, prompt: list[int], n_predict: int, k: int, n_keep: int) -> tuple[list, bool]:
    """llama-server's loop over the synthetic model: (the generated tokens' entries, whether it shifted)."""
    held = list(prompt)
    first = prompt[0]
    out, shifted = [], False
    for j in range(n_predict):
        if j > 0:
            if len(held) + 1 >= cfg.n_ctx:
                keep = min(cfg.n_ctx - 4, n_keep)
                left = len(held) - keep
                discard = max(0, min(left // 2, left - 1))
                held = held[:keep] + held[keep + discard:]
                shifted = True
            held.append(out[-1]["id"])
        ranked = top(held[-1], held[0] != first, k, cfg.kv_loss)
        token = ranked[0][0]
        out.append({"id": token, "token": f"t{token}", "bytes": [], "logprob": ranked[0][1],
                    "top_logprobs": [{"id": i, "token": f"t{i}", "bytes": [], "logprob": lp} for i, lp in ranked]})
    return out, shifted


def _handler(cfg: FakeConfig, tokenizer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            return None

        def _send(self, status: int, found: dict, headers: dict | None = None) -> None:
            data = json.dumps(found).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def _gate(self, body: dict | None) -> bool:
            cfg.requests.append((self.path, body, dict(self.headers)))
            if cfg.redirect:
                self._send(307, {}, {"Location": cfg.redirect + self.path})
                return False
            if cfg.key and self.headers.get("Authorization") != f"Bearer {cfg.key}":
                self._send(401, {"error": {"message": "Invalid API Key"}})
                return False
            if cfg.busy:
                cfg.busy -= 1
                self._send(503, {"error": {"message": "Loading model"}})
                return False
            if cfg.limited:
                cfg.limited -= 1
                self._send(429, {"error": {"message": "slow down"}}, {"Retry-After": "0"})
                return False
            return True

        def do_GET(self):  # noqa: N802
            if not self._gate(None):
                return
            llama = cfg.kind == "llama-server"
            if self.path == "/props" and llama:
                self._send(200, {"default_generation_settings": {"n_ctx": cfg.n_ctx, "params": {"n_keep": 0}},
                                 "model_path": cfg.name, "build_info": cfg.build, "total_slots": 1,
                                 "is_sleeping": False})
            elif self.path == "/v1/models":
                owner = {"llama-server": "llamacpp", "vllm": "vllm", "openai": "organization-owner"}[cfg.kind]
                model = {"id": cfg.name, "object": "model", "owned_by": owner, "created": time.time_ns()}
                if cfg.kind != "llama-server":
                    model.update(max_model_len=cfg.n_ctx, **({"root": f"/models/{cfg.name}"} if cfg.kind == "vllm"
                                                             else {}))
                self._send(200, {"object": "list", "data": [model]})
            elif self.path == "/version" and cfg.kind == "vllm":
                self._send(200, {"version": cfg.build})
            elif self.path == "/metrics" and cfg.kind == "vllm":
                data = (f'vllm:cache_config_info{{block_size="16",cache_dtype="{cfg.kv_type}",'
                        f'calculate_kv_scales="False",num_gpu_blocks="{time.time_ns() % 997}"}} 1.0\n').encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self._send(404, {"error": {"message": "File Not Found"}})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if not self._gate(body):
                return
            if self.path == "/tokenize" and cfg.kind != "openai":
                ids = tokenizer(body["content"], add_special_tokens=False)["input_ids"]
                self._send(200, {"tokens": [i + int(cfg.shift_tokenizer) for i in ids]})
            elif self.path == "/detokenize" and cfg.kind != "openai":
                text = tokenizer.decode(body["tokens"])
                self._send(200, {"content": text} if cfg.kind == "llama-server" else {"prompt": text})
            elif self.path == "/v1/completions" or (self.path == "/completion" and cfg.kind == "llama-server"):
                self._complete(body)
            elif self.path == "/v1/chat/completions":  # replies with the first 7-digit number stated
                numbers = [w.strip(".,") for m in body["messages"] for w in m["content"].split()
                           if len(w.strip(".,")) == 7 and w.strip(".,").isdigit()]
                reply = f"It is {numbers[0]}." if numbers else "I do not know."
                self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                              "finish_reason": "stop"}], "usage": {"prompt_tokens": 0}})
            else:
                self._send(404, {"error": {"message": "File Not Found"}})

        def _complete(self, body: dict) -> None:
            prompt = body["prompt"]
            if cfg.kind != "llama-server":  # vLLM: a sequence past max_model_len is refused, never shifted
                if len(prompt) + (body.get("max_tokens") or 16) > cfg.n_ctx:
                    self._send(400, {"error": {"message": f"This model's maximum context length is {cfg.n_ctx} "
                                                          "tokens"}})
                    return
            elif len(prompt) >= cfg.n_ctx and cfg.truncate:  # old llama-server: keep the last half, say truncated
                prompt = prompt[-(cfg.n_ctx // 2):]
            elif len(prompt) >= cfg.n_ctx:
                self._send(400, {"error": {"message": "the request exceeds the available context size"}})
                return
            native = self.path == "/completion"
            k = body.get("n_probs", 0) if native else body.get("logprobs") or 0
            n = body.get("n_predict") if native else body.get("max_tokens")
            slot = cfg if cfg.kind == "llama-server" else replace(cfg, n_ctx=1 << 30)  # vLLM never shifts
            entries, shifted = generate(slot, prompt, n, max(k, 1), body.get("n_keep", cfg.keep))
            if body.get("prompt_logprobs"):  # vLLM: each prompt token's top-k and itself, given what precedes it
                found = {"choices": [{"text": "", "prompt_logprobs": self._scored(prompt, body["prompt_logprobs"])}]}
                self._send(200, found)
                return
            tokens = [e["id"] for e in entries]
            if native:
                found = {"content": " ".join(e["token"] for e in entries), "tokens": tokens, "truncated": shifted,
                         "tokens_evaluated": len(prompt), "tokens_predicted": n}
                if k and cfg.logprobs:
                    found["completion_probabilities"] = entries
            else:
                found = {"choices": [{"text": "", "index": 0, "logprobs": {"content": entries} if k and cfg.logprobs
                                      else None, "finish_reason": "length"}],
                         "usage": {"prompt_tokens": len(prompt), "completion_tokens": n}, "model": cfg.name}
            self._send(200, found)

        @staticmethod
        def _scored(prompt: list[int], k: int) -> list:
            out = [None]
            for i in range(1, len(prompt)):
                ranked = dict(top(prompt[i - 1], False, k))
                entry = {str(t): {"logprob": lp, "rank": r + 1} for r, (t, lp) in enumerate(ranked.items())}
                entry.setdefault(str(prompt[i]), {"logprob": -20.0, "rank": 1000})
                out.append(entry)
            return out

    return Handler


class FakeServer:
    """Serve `FakeConfig` on 127.0.0.1 (a free port) from a thread; a context manager."""

    def __init__(self, cfg: FakeConfig, tokenizer) -> None:
        self.cfg = cfg
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(cfg, tokenizer))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

