"""Independent references used by the tests: plain transformers, no kvevict code."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def attn(model, implementation: str):
    """Temporarily run `model` with another attention implementation."""
    before = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def nll_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """NLL of tokens[1:] from logits[:-1] (one sequence)."""
    lp = torch.log_softmax(logits.float(), dim=-1)[:-1]
    return -lp.gather(-1, tokens[1:, None])[:, 0]


def plain_nll(model, tokens: torch.Tensor) -> torch.Tensor:
    with attn(model, "sdpa"), torch.inference_mode():
        return nll_from_logits(model(tokens[None]).logits[0], tokens)


def band_sink_nll(model, tokens: torch.Tensor, budget: int, sinks: int) -> torch.Tensor:
    """One full-sequence forward where query i sees key j iff j <= i and (j < sinks or i - j <= budget - sinks)."""
    n = tokens.numel()
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    visible = (j <= i) & ((j < sinks) | (i - j <= budget - sinks))
    with attn(model, "sdpa"), torch.inference_mode():
        logits = model(tokens[None], attention_mask=visible[None, None]).logits[0]
    return nll_from_logits(logits, tokens)
