"""What a server says it is: its engine, model, context, KV cache type and build as it reports them, and what the
user declares where it reports nothing.

Every answer the audit records is keyed by this (`records.request_key`): a server restarted at the same URL with
another model, context, KV type, build or keep is another system under test, and none of its earlier answers is
replayed for it. Only facts that stay put while a server runs are kept (never a timestamp, a request count or a
slot's state), so an unchanged server keys its answers alike on every run and a killed audit resumes.

The engine is told by what it answers:

* llama-server: `/props` with `default_generation_settings`: the model's path, alias and type, the context per
  slot, the slots, the build. It reports no KV cache type and not its `--keep` (`/props` shows the request
  default), so the user's `--server-keep` stands in for it;
* vLLM: `/v1/models` entries `owned_by: vllm`, or a `/version` where no other owner is named: the served name,
  the weights (`root`), `max_model_len`, the version, and from `/metrics` the `cache_config_info` labels (the
  KV cache dtype, whether its scales are calculated, prefix caching);
* anything else: an OpenAI-compatible server, known by its `/v1/models` entries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: engine kind -> how the audit names it in a sentence
ENGINES = {"llama-server": "llama-server", "vllm": "vLLM", "openai": "an OpenAI-compatible server"}
#: engine kind -> where its context is set (named in the refusal of a reference that would evict)
ENGINE_CONTEXT = {"llama-server": "llama-server --ctx-size", "vllm": "vLLM --max-model-len",
                  "openai": "the server's context setting"}

#: llama-server's /props fields that say what it serves and how (KV types where a build reports them)
LLAMA_PROPS = ("model_path", "model_alias", "model_ftype", "build_info", "total_slots", "bos_token", "cache_type_k",
               "cache_type_v")
#: /v1/models fields of each served model (never `created` or `permission`: they change per request)
MODEL_FIELDS = ("id", "root", "max_model_len", "owned_by")
#: vLLM's `cache_config_info` labels that change its arithmetic (never the block count: it follows free memory)
VLLM_CACHE = ("cache_dtype", "calculate_kv_scales", "enable_prefix_caching")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class ServerIdentity:
    """One server's engine `kind` (`ENGINES`) and `facts`: (name, value) pairs, sorted, values as text; the ones
    the user declared where the server reports nothing start `declared `."""

    kind: str
    facts: tuple[tuple[str, str], ...] = ()

    @property
    def engine(self) -> str:
        return ENGINES[self.kind]

    def fact(self, name: str) -> str | None:
        return dict(self.facts).get(name)

    def declared(self, **facts) -> ServerIdentity:
        """This identity with the user's declarations added (None: not declared)."""
        found = dict(self.facts) | {f"declared {k.replace('_', ' ')}": str(v) for k, v in facts.items()
                                    if v is not None}
        return ServerIdentity(self.kind, tuple(sorted(found.items())))

    def as_dict(self) -> dict:
        return {"kind": self.kind, **dict(self.facts)}

    def describe(self) -> str:
        """`vLLM 0.32.0: model smollm2, context 1024, KV cache fp8` (what it reports of these)."""
        model = self.fact("model_path") or self.fact("model root") or self.fact("model id")
        context = self.fact("n_ctx") or self.fact("model max_model_len")
        kv = self.fact("cache_dtype") or self.fact("cache_type_k")
        version = self.fact("version") or self.fact("build_info")
        parts = [f"model {model}"] if model else []
        parts += [f"context {context}"] if context else []
        parts.append(f"KV cache {kv}" if kv else "KV cache type not reported")
        return f"{self.engine}{f' {version}' if version else ''}: {', '.join(parts)}"


def engine_of(props: dict | None, listing: dict | None, version: dict | None) -> str:
    """llama-server, vLLM or another OpenAI-compatible server, by what it answered (module docstring)."""
    if props is not None and "default_generation_settings" in props:
        return "llama-server"
    owners = {m.get("owned_by") for m in _models(listing)} - {None, ""}
    if "vllm" in owners or (version is not None and "version" in version and not owners):
        return "vllm"
    return "openai"


def identify(kind: str, props: dict | None, listing: dict | None, version: dict | None,
             metrics: str | None) -> ServerIdentity:
    """The facts of a server of engine `kind` from its answers (None: the route was not there or not asked)."""
    facts: dict[str, str] = {}
    if props is not None:
        settings = props.get("default_generation_settings") or {}
        facts |= {name: props[name] for name in LLAMA_PROPS if props.get(name) not in (None, "")}
        facts["n_ctx"] = settings.get("n_ctx", props.get("n_ctx"))
        facts["n_keep"] = (settings.get("params") or {}).get("n_keep")
    for model in _models(listing):
        name = model.get("id")
        facts |= {f"model {field}" if len(_models(listing)) == 1 else f"model {name} {field}": model[field]
                  for field in MODEL_FIELDS if model.get(field) not in (None, "")}
    if version is not None and version.get("version"):
        facts["version"] = version["version"]
    if metrics:
        facts |= {k: v for k, v in cache_labels(metrics).items() if k in VLLM_CACHE}
    return ServerIdentity(kind, tuple(sorted((k, str(v)) for k, v in facts.items() if v is not None)))


def cache_labels(metrics: str) -> dict[str, str]:
    """The labels of vLLM's `vllm:cache_config_info` gauge in Prometheus text ({} where it is absent)."""
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(_LABEL.findall(line[line.index("{"):line.rindex("}")]))
    return {}


def differences(before: dict, now: dict) -> list[str]:
    """`n_ctx 128 -> 160` for every fact that differs between two `as_dict`s (absent on one side: `none`)."""
    names = sorted(set(before) | set(now))
    return [f"{n} {before.get(n, 'none')} -> {now.get(n, 'none')}" for n in names if before.get(n) != now.get(n)]


def _models(listing: dict | None) -> list[dict]:
    return [m for m in (listing or {}).get("data", []) if isinstance(m, dict)]
