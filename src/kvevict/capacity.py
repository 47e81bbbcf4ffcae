"""Capacity: KV bytes per sequence at a deployment's context length, and how many sequences fit.

The arithmetic a team provisions with (the same count the cache makes of what it holds,
`cache.layer_interface.CacheLayer.memory`): one cached token of one layer costs
`KV heads x head_dim x 2 (key and value) x bytes per element`. A full-attention layer
holds `min(context, budget)` tokens; a sliding-window layer holds at most its window
less one (`window - 1`, as transformers' `DynamicSlidingWindowLayer` keeps, cache_utils.py)
whatever the budget; the full cache is the budget `None`. Concurrent sequences are the
accelerator's memory left after the weights, divided by one sequence's KV bytes, rounded
down (activations and the allocator's overhead are not counted: an upper bound).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from .cache.model_info import layer_kinds, text_config
from .errors import KvevictError
from .position_modes import DEFAULT_POSITIONS

#: bytes per element of the dtypes a KV cache is stored in; llama.cpp's quantized types (`--cache-type-k/-v`) hold
#: blocks of 32 values, each its codes and an fp16 scale (ggml's block sizes: q8_0 34 bytes, q4_0 18); `fp8`: vLLM's
#: --kv-cache-dtype fp8, e4m3 or e5m2, whose per-tensor scales are a few bytes per layer
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "q8_0": Fraction(34, 32), "q4_0": Fraction(18, 32)}
#: size units: decimal (GB = 10^9 bytes, as accelerators are sold) and binary (GiB = 2^30)
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class KvShape:
    """What one cached token costs: layers by kind, KV heads, head_dim, the sliding window, element bytes."""

    full_layers: int
    sliding_layers: int
    kv_heads: int
    head_dim: int
    window: int | None
    element_bytes: int | Fraction  # a Fraction for a block type (q8_0: 34/32)

    @property
    def token_layer_bytes(self) -> int:
        """One token of one layer: keys and values of every KV head (a block type's row of `kv_heads x head_dim`
        values as ggml sizes it, `ggml_row_size`: whole blocks)."""
        per = self.kv_heads * self.head_dim * 2 * self.element_bytes
        if per != int(per):
            raise KvevictError(f"{self.kv_heads} KV heads x {self.head_dim} head_dim is not a whole number of "
                               "32-value blocks: llama.cpp cannot hold it as q8_0 or q4_0; use float16")
        return int(per)

    def sequence_bytes(self, context: int, budget: int | None = None) -> int:
        """KV bytes of one sequence of `context` tokens under a cache of `budget` entries per full-attention
        layer and KV head (None: the full cache)."""
        full = context if budget is None else min(context, budget)
        sliding = context if self.window is None else min(context, self.window - 1)
        return self.token_layer_bytes * (self.full_layers * full + self.sliding_layers * sliding)

    def as_dict(self) -> dict:
        return dict(full_layers=self.full_layers, sliding_layers=self.sliding_layers, kv_heads=self.kv_heads,
                    head_dim=self.head_dim, window=self.window, element_bytes=_number(self.element_bytes))


def shape_of(config, element_bytes: int) -> KvShape:
    """The KV shape of a transformers config (multimodal ones through their text config)."""
    text = text_config(config)
    kinds = layer_kinds(text)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    sliding = kinds.count("sliding_attention")
    return KvShape(len(kinds) - sliding, sliding, kv_heads, head_dim,
                   getattr(text, "sliding_window", None) if sliding else None, element_bytes)


def element_bytes_of(dtype: str) -> int | Fraction:
    """Bytes per element of a dtype name (`bfloat16`, `torch.float16`, llama.cpp's `q8_0`, ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise KvevictError(f"--kv-dtype must be one of {', '.join(DTYPE_BYTES)}, got '{dtype}'")
    return DTYPE_BYTES[name]


def read_config(path: str, dtype: str = "") -> KvShape:
    """The KV shape from a model's `config.json` (no weights), in `dtype` or else the config's own dtype."""
    from transformers import AutoConfig

    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise KvevictError(f"--config-only '{path}': cannot read a JSON config ({exc}); give a model's "
                           "config.json or its folder") from None
    try:
        config = AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError) as exc:
        raise KvevictError(f"--config-only '{path}': transformers cannot build a config from it ({exc}); "
                           "it needs a known model_type") from None
    return shape_of(config, element_bytes_of(dtype or data.get("torch_dtype") or data.get("dtype") or "bfloat16"))


def parse_size(text: str, option: str) -> int:
    """`80GB`, `79.6GiB`, `16000000000`: bytes (GB decimal, GiB binary)."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = found.group(2).lower() if found else None
    if found is None or unit not in UNITS:
        raise KvevictError(f"{option} takes a size such as 80GB, 79.6GiB or a byte count, got '{text}'")
    return int(float(found.group(1)) * UNITS[unit])


def concurrent(memory: int, weights: int, per_sequence: int) -> int:
    """Sequences whose KV caches fit in `memory` beside `weights` (0 when the weights alone do not fit)."""
    if per_sequence <= 0:
        raise KvevictError("a sequence holds no KV bytes: nothing to provision")
    return max(0, (memory - weights) // per_sequence)


def kv_tokens(shape: KvShape, memory: int, block: int = 1) -> int:
    """KV tokens `memory` holds in whole pages of `block` tokens, a page holding its tokens' keys and values in
    every layer: vLLM's paged count ("KV cache size: N tokens", `block_size` 16 on GPUs, 128 on its CPU build).
    The pool is shared by all layers, so a sliding layer's page counts as a full one's here."""
    if block < 1:
        raise KvevictError(f"a KV page holds at least one token, got {block}")
    per_page = shape.token_layer_bytes * (shape.full_layers + shape.sliding_layers) * block
    return memory // per_page * block


@dataclass(frozen=True)
class CapacityRow:
    """One configuration at the deployment's context: its KV bytes per sequence and the sequences that fit."""

    name: str
    budget: int | None
    sequence_bytes: int
    sequences: int
    full_bytes: int

    @property
    def share(self) -> float:
        return self.sequence_bytes / self.full_bytes


def capacity_rows(shape: KvShape, configs: list[tuple[str, int | None]], context: int, memory: int,
                  weights: int, held: dict[str, tuple[int, int]] | None = None) -> list[CapacityRow]:
    """The full cache first, then each named configuration (name, budget in entries; None: full).

    `held`: per configuration name, (KV bytes a measured cache held, the stream length it held them at). The
    shape's arithmetic counts every entry at the element size, which a quantized configuration does not hold
    (codes, scales and zero points: docs/quantization.md); where a measurement is given, the sequence's bytes
    are the measured ones, scaled by the arithmetic from the measured stream to the deployment's context (1 when
    both are beyond the budget and the sliding window: a bounded cache holds the same entries at any length)."""
    full = shape.sequence_bytes(context)
    rows = [("full cache", None)] + [c for c in configs if c[1] is not None]
    out = []
    for name, budget in rows:
        sequence = shape.sequence_bytes(context, budget)
        if held and name in held:
            measured, tokens = held[name]
            sequence = round(measured * sequence / shape.sequence_bytes(tokens, budget))
        out.append(CapacityRow(name, budget, sequence, concurrent(memory, weights, sequence), full))
    return out


def _number(value: int | Fraction) -> int | float:
    """Bytes per element as JSON and text take it: 2, or 1.0625 for q8_0."""
    return value if isinstance(value, int) else float(value)


def gib(value: int) -> str:
    return f"{value / 2**30:.3f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def arithmetic(shape: KvShape, context: int) -> str:
    """The formula with the model's numbers, written out (what config-only mode prints first)."""
    per = shape.token_layer_bytes
    text = (f"one token of one layer: {shape.kv_heads} KV heads x {shape.head_dim} head_dim x 2 (K, V) x "
            f"{_number(shape.element_bytes)} bytes = {per} bytes; full cache at {context} tokens: "
            f"{shape.full_layers} full-attention layers x {context}")
    if shape.sliding_layers:
        text += f" + {shape.sliding_layers} sliding layers x min({context}, {shape.window} - 1)"
    return text + f" tokens x {per} bytes = {gib(shape.sequence_bytes(context))}"


def budget_at(text: str, context: int) -> int | None:
    """A configuration's budget as written after `@`: entries, a share of the context (`25%`), or `full`."""
    from .policies.budget import parse_budget, resolve_budget

    return resolve_budget(parse_budget(text), context)


def named_configs(text: str, context: int) -> list[tuple[str, int | None]]:
    """`full,window@4096,h2o@25%`: each configuration as (name, budget in entries at `context`), every policy
    checked at its budget (an unknown one is one line naming the choices)."""
    from .policies import check_policy

    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        spec, at, budget = item.rpartition("@")
        if not at:
            spec, budget = item, "full"
        entries = budget_at(budget, context)
        if not check_policy(spec, entries, DEFAULT_POSITIONS).unbounded and entries is None:
            raise KvevictError(f"configuration '{item}' bounds nothing: write it as POLICY@BUDGET, e.g. window@4096")
        out.append((item, entries))
    if not out:
        raise KvevictError("--configs is empty: name configurations as POLICY@BUDGET, e.g. full,window@4096,h2o@25%")
    return out
