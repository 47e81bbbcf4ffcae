"""What a recorded policy declares about itself, read from its spec string.

The report groups and sorts rows by what a policy is (does it steer by attention? how
many leading tokens does it pin?), never by substrings of its name: `parse_policy`
rebuilds the policy from the canonical spec stored in each record and the answer is
whatever that policy declares. A spec this process cannot parse (a policy registered
by another program with `kvevict.register`) is an error naming it: guessing "pins
nothing" would rank it wrongly in the verdict.
"""

from __future__ import annotations

from functools import lru_cache

from ..errors import KvevictError
from ..policies import Policy, parse_policy


@lru_cache(maxsize=256)
def _policy(spec: str) -> Policy:
    try:
        return parse_policy(spec)
    except KvevictError as exc:
        raise KvevictError(
            f"the results name policy '{spec}', which this kvevict cannot read ({exc}): redraw the report in a "
            "program that registers it first (kvevict.register(name, cls), then kvevict.report.html.render)"
        ) from None


def needs_attention(spec: str) -> bool:
    """The policy chooses by the attention its slots received (h2o, snapkv, sinkauto, their sink wrappers)."""
    policy = _policy(spec)
    return bool(policy.needs_attention)


def content_driven(spec: str) -> bool:
    """The policy chooses by what slots hold (attention or keys), so it can keep token 0 on
    some heads and lose it on others (h2o, snapkv, tova, knorm, keydiff, ...)."""
    policy = _policy(spec)
    return bool(policy.needs_attention or policy.reads_keys)


def pinned(spec: str) -> int:
    """Leading tokens the policy always keeps (`sinkK+window`: K; `window`: 0)."""
    policy = _policy(spec)
    return int(policy.pinned)


def is_preset(spec: str) -> bool:
    """The policy is a serving engine's own rule (`llamacpp`, `trtllm`, ...): a sink wrapper refuses it, so
    its sinks are set through the engine's own option."""
    return bool(_policy(spec).preset)


def kv_width(spec: str) -> str | None:
    """The storage width of a row held in a storage form (`q4+h2o`: `q4`, `fp8+h2o`: `fp8`); None where
    entries are held as they are. Rows of different widths are what equal-bytes comparisons compare."""
    storage = _policy(spec).kv_storage
    return None if storage is None else storage.width
