"""The audit's records: one JSON line per request answered, keyed by the request, through `records/store.py`.

A key is a hash of everything that decides the answer: the server's URL (no credentials ever reach it),
what the server says it is (`identity.py`: engine, model, context, KV type, build, and the keep the user
declares where the server does not report it), the route, the model name and the request's fields. An
audit killed at any moment (kill -9 included) and run again against the same server reads the keys it holds
and sends only the requests it lacks; a server restarted at the same URL with another configuration keys
its answers apart, so none of the old ones is replayed for it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict
from pathlib import Path

from ..records.store import ResultStore
from .api import Ask, Generation, Step


def request_key(url: str, route: str, model: str | None, ask: Ask, server: dict) -> str:
    """A stable key of one request to the server `server` describes (`ServerIdentity.as_dict`): sha256 of its
    JSON, 24 hex digits."""
    found = json.dumps({"url": url, "server": server, "route": route, "model": model, "ask": asdict(ask)},
                       sort_keys=True)
    return hashlib.sha256(found.encode()).hexdigest()[:24]


def step_json(step: Step) -> dict:
    return {"token": step.token, "logprob": step.logprob, "ids": list(step.ids), "logprobs": list(step.logprobs)}


def step_of(found: dict) -> Step:
    return Step(int(found["token"]), float(found["logprob"]), tuple(found["ids"]), tuple(found["logprobs"]))


class Records:
    """The append-only answers of one audit folder (`results.jsonl`); safe to append from several threads."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.store = ResultStore(folder / "results.jsonl")
        self._by_key = {r["key"]: r for r in self.store.records()}
        self._lock = threading.Lock()

    def get(self, key: str) -> dict | None:
        return self._by_key.get(key)

    def put(self, record: dict) -> None:
        with self._lock:
            self.store.append([record])
            self._by_key[record["key"]] = record

    def step(self, key: str, ask: Ask) -> Step | None:  # noqa: ARG002 (the endpoint reference's `cached`)
        found = self.get(key)
        return None if found is None else step_of(found["steps"][0])

    def keep_step(self, key: str, ask: Ask, step: Step) -> None:
        self.put({"key": key, "kind": "reference-step", "prefix": len(ask.ids), "steps": [step_json(step)]})

    def generation(self, key: str) -> Generation | None:
        found = self.get(key)
        if found is None:
            return None
        return Generation(found.get("text", ""), tuple(step_of(s) for s in found["steps"]), found.get("truncated"),
                          found.get("prompt_tokens"))

    def keep_generation(self, key: str, kind: str, generation: Generation, **extra) -> None:
        self.put({"key": key, "kind": kind, "text": generation.text, "truncated": generation.truncated,
                  "prompt_tokens": generation.prompt_tokens, "steps": [step_json(s) for s in generation.steps],
                  **extra})
