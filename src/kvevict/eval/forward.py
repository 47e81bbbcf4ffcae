"""One place that knows how to call a transformers causal LM with a cache.

transformers 5.x renamed `past_key_values` to `cache`; the helpers pick whichever the
installed version's forward accepts, and split the LM head off the body so a long
prefill never holds `[rows, tokens, vocab]` logits at once.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch


@cache
def _cache_kwarg(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def body(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """Final hidden states `[B, q, H]` after feeding `input_ids` through `cache`."""
    base = model.model
    kwargs = {_cache_kwarg(type(base)): cache, "use_cache": True}
    return base(input_ids=input_ids, **kwargs).last_hidden_state


def log_probs(model, hidden: torch.Tensor) -> torch.Tensor:
    """Log-softmax of the LM head over the vocabulary, float32."""
    logits = model.get_output_embeddings()(hidden)
    return torch.log_softmax(logits.float(), dim=-1)


def forward_kwargs(model, cache) -> dict:
    return {_cache_kwarg(type(model)): cache, "use_cache": True}
