"""What the audit learns about a server before it sends a workload, and the refusals that follow from it.

* its context (`n_ctx`: llama-server's `/props`; `max_model_len`: vLLM's `/v1/models`) and, for
  llama-server, the `n_keep` it keeps by default and whether it adds BOS (it keeps one more then);
* its engine and identity (`identity.py`): what the audit keys its records by;
* the model names it serves (`/v1/models`), against the name the user gave (a mismatch is refused);
* whether its tokenizer is the audit's: token ids round-tripped through `/tokenize` and `/detokenize`
  (llama-server's and vLLM's), against the local tokenizer's (a disagreement is refused: the two sides
  would not see the same token ids).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KvevictError
from .client import Client, ServerError
from .identity import ServerIdentity, engine_of, identify

#: the text whose ids both tokenizers must agree on (words, punctuation, a non-ASCII letter)
PROBE_TEXT = "The audit checks these tokens twice: once forward, once back (naïve tokenizers differ here)."


@dataclass(frozen=True)
class Server:
    """What a server says about itself. None: it does not say."""

    url: str
    n_ctx: int | None
    n_keep: int | None
    add_bos: bool | None
    models: tuple[str, ...]
    native: bool  # llama-server's native routes answer (/props)
    identity: ServerIdentity = ServerIdentity("openai")

    @property
    def engine(self) -> str:
        """How the audit names this server's engine in a sentence: llama-server, vLLM, an OpenAI-compatible server."""
        return self.identity.engine


def describe(client: Client) -> Server:
    """Ask `/props` (llama-server) and `/v1/models` (every OpenAI-compatible server), either of which may be
    missing; where it is not llama-server, `/version`, and vLLM's `/metrics` (`identity.py`)."""
    props = _optional(client, "/props")
    listing = _optional(client, "/v1/models")
    version = _optional(client, "/version") if props is None else None
    kind = engine_of(props, listing, version)
    metrics = _optional(client, "/metrics", text=True) if kind == "vllm" else None
    models = tuple(str(m.get("id")) for m in (listing or {}).get("data", []) if isinstance(m, dict))
    n_ctx = n_keep = add_bos = None
    if props:
        settings = props.get("default_generation_settings") or {}
        n_ctx = settings.get("n_ctx") or props.get("n_ctx")
        n_keep = (settings.get("params") or {}).get("n_keep")
        add_bos = bool(props.get("bos_token")) and props.get("add_bos_token", None)
    if n_ctx is None and listing:  # vLLM: max_model_len per model
        lengths = [m.get("max_model_len") for m in listing.get("data", []) if isinstance(m, dict)]
        n_ctx = next((x for x in lengths if x), None)
    if props is None and listing is None:
        raise KvevictError(f"{client.endpoint.base} answers neither /props nor /v1/models: is it llama-server or "
                           "an OpenAI-compatible server (vLLM, SGLang, trtllm-serve, Ollama)?")
    return Server(client.endpoint.base, n_ctx, n_keep, add_bos, models, props is not None,
                  identify(kind, props, listing, version, metrics))


def _optional(client: Client, path: str, text: bool = False):
    """The route's answer (JSON, or plain text where `text`); None where the server has no such route (404, 405,
    501), any other error raised."""
    try:
        return client.get_text(path) if text else client.get(path)
    except ServerError as exc:
        if exc.status in (404, 405, 501):
            return None
        raise


def check_model(server: Server, model: str | None) -> None:
    """A model name the server does not list is refused (one line naming what it serves)."""
    if model and server.models and model not in server.models:
        raise KvevictError(f"{server.url} serves {', '.join(server.models)}, not '{model}': pass --served-model with "
                           "one of those names")


def check_tokenizer(client: Client, tokenizer, model: str | None = None, text: str = PROBE_TEXT) -> bool:
    """Round-trip `text`'s ids: the server's ids of `text` must be the local ones, and the server's text of the
    local ids must tokenize back to them. False where the server has no tokenize route (nothing checked)."""
    local = tokenizer(text, add_special_tokens=False)["input_ids"]
    try:
        answer = client.post("/tokenize", {"content": text, "prompt": text, "model": model, "add_special": False,
                                           "add_special_tokens": False})
    except ServerError as exc:
        if exc.status in (404, 405):
            return False
        raise
    theirs = [t["id"] if isinstance(t, dict) else int(t) for t in answer.get("tokens", [])]
    back = client.post("/detokenize", {"tokens": local, "model": model})
    text_back = back.get("content", back.get("prompt"))
    again = tokenizer(text_back, add_special_tokens=False)["input_ids"] if isinstance(text_back, str) else None
    if theirs != local or again != local:
        first = next((i for i, (a, b) in enumerate(zip(theirs, local, strict=False)) if a != b),
                     min(len(theirs), len(local)))
        raise KvevictError(f"the server's tokenizer disagrees with the local one (ids differ from token {first}: "
                           f"server {theirs[first:first + 3]}, local {local[first:first + 3]}): give the model the "
                           "server serves with --model (the same .gguf or folder)")
    return True
