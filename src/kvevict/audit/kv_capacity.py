"""What a KV setting buys: the KV capacity a server declares, beside kvevict's capacity arithmetic for it.

vLLM declares its KV cache at start (its log: "CPU KV cache size: 23,296 tokens, Maximum concurrency for
1,024 tokens per request: 22.75x") and in `/metrics`: the gauge `vllm:cache_config_info`, whose labels carry
the cache's dtype (`cache_dtype`: `auto` is the model's own), its page (`block_size` tokens), the pages it
holds (`num_gpu_blocks`, its CPU build's too), the memory it was given (`kv_cache_memory_bytes`) and the
tokens they make (`kv_cache_size_tokens`). kvevict's arithmetic (`capacity.kv_tokens`) counts the same memory
in whole pages of the same size at the declared dtype's bytes per element (`fp8`, `fp8_e4m3`, `fp8_e5m2`: 1;
`auto`: the audited model's own dtype). The audit states both: where they differ, the server counts or holds its
cache otherwise than its dtype says (scales, padding, another dtype than the model's, or a hybrid model's pages:
vLLM gives each group of layers of one kind its own pages and counts Gemma 3's sliding layers as needing more
pages than its full ones at a context of 1,024, docs/audit.md).

A setting's gain is its capacity over the unquantized cache's in the same memory: the one the twin or the
reference server declares where either does (`--floor-url`, `--reference-url`: the same engine unquantized),
else kvevict's arithmetic at the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capacity import DTYPE_BYTES, KvShape, kv_tokens
from .identity import cache_labels

#: bytes per element of vLLM's `--kv-cache-dtype` names (`auto`, the model's own dtype, aside)
KV_DTYPE_BYTES = {**DTYPE_BYTES, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class Declared:
    """A server's KV cache as it declares it: dtype, tokens per page, pages, bytes given, tokens held."""

    kv_dtype: str
    block_size: int
    blocks: int
    memory: int
    tokens: int


def declared(metrics: str) -> Declared | None:
    """The KV cache `metrics` (a Prometheus text page) declares; None where it has no `vllm:cache_config_info`."""
    labels = cache_labels(metrics)
    try:
        return Declared(labels["cache_dtype"], int(labels["block_size"]), int(labels["num_gpu_blocks"]),
                        int(labels["kv_cache_memory_bytes"]), int(labels["kv_cache_size_tokens"]))
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class Capacity:
    """A declared cache beside kvevict's arithmetic for the same memory, page and bytes per element; `dtype` its
    name (`auto` read as the model's own dtype)."""

    declared: Declared
    dtype: str
    element_bytes: int
    arithmetic: int  # KV tokens by kvevict's arithmetic

    @property
    def agrees(self) -> bool:
        return self.arithmetic == self.declared.tokens

    def as_dict(self) -> dict:
        d = self.declared
        return {"kv_dtype": self.dtype, "block_size": d.block_size, "blocks": d.blocks, "memory": d.memory,
                "tokens": d.tokens, "element_bytes": self.element_bytes, "arithmetic": self.arithmetic,
                "agrees": self.agrees}


def capacity(found: Declared, shape: KvShape, model_dtype: str) -> Capacity:
    """`found` beside kvevict's count: `shape` (the audited model's, whose own dtype is `model_dtype`) at the
    declared dtype."""
    dtype = model_dtype if found.kv_dtype == "auto" else found.kv_dtype
    element = KV_DTYPE_BYTES.get(dtype, shape.element_bytes)
    at = KvShape(shape.full_layers, shape.sliding_layers, shape.kv_heads, shape.head_dim, shape.window, element)
    return Capacity(found, dtype, element, kv_tokens(at, found.memory, found.block_size))


def arithmetic_only(like: Declared, shape: KvShape, model_dtype: str) -> Capacity:
    """The model's own dtype in `like`'s memory and pages, by kvevict's arithmetic alone (no server declared it)."""
    tokens = kv_tokens(shape, like.memory, like.block_size)
    found = Declared("auto", like.block_size, tokens // like.block_size, like.memory, tokens)
    return Capacity(found, model_dtype, shape.element_bytes, tokens)


def buys_line(buys: Buys, kl: float, outcome: str) -> str:
    """What the setting costs and buys, in one line: `fp8 KV: KL 0.002, inside; 4.00x the sequences of float32 KV
    (93,184 KV tokens in 1.000 GiB against 23,296; kvevict's arithmetic: 93,184 and 23,296)`."""
    deployment, baseline = buys.deployment, buys.baseline
    a, b = deployment.declared, baseline.declared
    line = (f"{deployment.dtype} KV: KL {kl:.3g}, {outcome}; {a.tokens / b.tokens:.2f}x the sequences of "
            f"{baseline.dtype} KV ({a.tokens:,} KV tokens in {a.memory / 2**30:.3f} GiB against {b.tokens:,}; "
            f"kvevict's arithmetic: {deployment.arithmetic:,} and {baseline.arithmetic:,})")
    if not (deployment.agrees and baseline.agrees):
        line += ("; the server and kvevict's arithmetic differ: it counts or holds its cache otherwise (another dtype, "
                 "scales, or a hybrid model's pages per group of layers)")
    return line


@dataclass(frozen=True)
class Buys:
    """The deployment's declared capacity and the unquantized cache's in the same memory (`source`: where it came
    from), each beside kvevict's arithmetic."""

    deployment: Capacity
    baseline: Capacity
    source: str  # who declared the unquantized cache: a server's URL, "the deployment", or "kvevict's arithmetic"

    def as_dict(self) -> dict:
        return {"deployment": self.deployment.as_dict(), "baseline": self.baseline.as_dict(), "source": self.source,
                "gain": self.deployment.declared.tokens / self.baseline.declared.tokens}


def _declared_by(client) -> Declared | None:
    from .client import ServerError

    try:
        return declared(client.get_text("/metrics"))
    except ServerError:  # no /metrics (llama-server without --metrics): nothing declared
        return None


def what_it_buys(client, others, model: str) -> Buys | None:
    """What the deployment's KV setting buys, where it declares its cache (`/metrics`; None where it does not):
    its capacity beside the unquantized cache's: its own where it is unquantized, else the first of `others` (clients
    of the twin, the reference) that declares one in the same memory and pages, else kvevict's arithmetic at
    `model`'s own dtype (its config, no weights loaded)."""
    from ..capacity import element_bytes_of, shape_of
    from ..loading import load_config

    found = _declared_by(client)
    if found is None:
        return None
    config = load_config(model)
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    dtype = dtype.removeprefix("torch.")
    shape = shape_of(config, element_bytes_of(dtype))
    if found.kv_dtype == "auto":  # unquantized itself: its own capacity is the baseline
        own = capacity(found, shape, dtype)
        return Buys(own, own, "the deployment")
    for other in others:
        base = _declared_by(other)
        if base is not None and base.kv_dtype == "auto" and (base.memory, base.block_size) == (found.memory,
                                                                                               found.block_size):
            return Buys(capacity(found, shape, dtype), capacity(base, shape, dtype), other.endpoint.base)
    return Buys(capacity(found, shape, dtype), arithmetic_only(found, shape, dtype), "kvevict's arithmetic")
