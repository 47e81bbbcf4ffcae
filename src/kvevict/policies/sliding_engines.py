"""Engines that slide a window over the stream, some with sinks: `trtllm`, `mlc`,
`hf-sinkcache`, `vllm-swa`. Sources and releases read: `docs/engines.md`.

All four count the token being processed inside the window: with a window of `W`
(the budget here) a token attends to at most `W` entries, itself included. So between
forwards the cache holds `W - 1`: one entry per step goes once the window is full, the
oldest one outside the sinks. They differ in the sinks and in positions:

* TensorRT-LLM's cyclic KV cache (`max_attention_window_size`): `sink_token_length` sinks
  (default 0). Plain cyclic cache: keys keep their stream positions. With the `streamingllm`
  flag positions are counted within the cache. The sink "bubble" (the sinks padded to a
  whole block) is memory only: it changes nothing that attention sees.
* MLC-LLM (`sliding_window_size`, `attention_sink_size`, 4 in its Mistral config): RoPE is
  applied inline at positions within the cache.
* transformers' `SinkCache(window_length, num_sink_tokens)`: keys re-rotated to positions
  within the cache.
* vLLM's sliding-window layers: no sinks, stream positions; whole blocks are freed once
  no future query can see them, which bounds memory, not what attention sees.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KvevictError
from ..position_modes import ORIGINAL, SHIFTED
from .engine_preset import EnginePreset


@dataclass(eq=False)
class SlidingWindowPreset(EnginePreset):
    """`head()` sinks plus the most recent tokens; the window `W` (the budget) includes the query."""

    def check_budget(self, budget: int) -> None:
        if budget <= self.head() + 1:
            raise KvevictError(
                f"'{self.spec()}' keeps {self.head()} sinks inside a window of {budget} that also holds the token "
                f"being processed: raise --budget above {self.head() + 1} or use fewer sinks"
            )

    def evict_to(self, budget: int, held: int) -> int | None:
        return budget - 1 if held > budget - 1 else None


@dataclass(eq=False)
class TrtLlm(SlidingWindowPreset):
    sink: int = 0
    streamingllm: bool = False

    def __post_init__(self) -> None:
        _check_sinks(self.sink, "trtllm:sink")

    @property
    def position_mode(self) -> str | None:
        return (SHIFTED if self.streamingllm else ORIGINAL).name

    def spec(self) -> str:
        return f"trtllm:sink={self.sink}" + (",streamingllm=1" if self.streamingllm else "")

    def head(self) -> int:
        return self.sink


@dataclass(eq=False)
class Mlc(SlidingWindowPreset):
    sinks: int = 4

    def __post_init__(self) -> None:
        _check_sinks(self.sinks, "mlc:sinks")

    def spec(self) -> str:
        return f"mlc:sinks={self.sinks}"

    def head(self) -> int:
        return self.sinks


@dataclass(eq=False)
class HfSinkCache(SlidingWindowPreset):
    sinks: int = 4

    def __post_init__(self) -> None:
        _check_sinks(self.sinks, "hf-sinkcache:sinks")

    def spec(self) -> str:
        return f"hf-sinkcache:sinks={self.sinks}"

    def head(self) -> int:
        return self.sinks


@dataclass(eq=False)
class VllmSlidingWindow(SlidingWindowPreset):
    engine_positions = ORIGINAL.name

    def spec(self) -> str:
        return "vllm-swa"


def _check_sinks(count: int, option: str) -> None:
    if count < 0:
        raise KvevictError(f"{option} must be a number of sink tokens >= 0, got {count}")
