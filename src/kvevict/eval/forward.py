"""One place that knows how to call a transformers causal LM with a cache.

transformers 5.x renamed `past_key_values` to `cache`; the functions here pick whichever the
installed version's forward accepts, and split the LM head off the body so a long
prefill never holds `[rows, tokens, vocab]` logits at once.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
from torch import nn


@cache
def _cache_kwarg(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_argument(model, cache) -> dict:
    """`{name: cache}` for the installed transformers: `cache=` from 5.24 on (where
    `past_key_values=` is deprecated), `past_key_values=` before. Use it as
    `model.generate(ids, **kvevict.cache_argument(model, cache))`."""
    return {_cache_kwarg(type(model)): cache}


def body(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """Final hidden states `[B, q, H]` after feeding `input_ids` through `cache`.

    `base_model` is the decoder body whatever the family calls it (`model`, `transformer`, `gpt_neox`).
    `input_ids` go to the model's device first (the hidden states come back there).
    """
    base = model.base_model
    kwargs = {_cache_kwarg(type(base)): cache, "use_cache": True}
    device = base.get_input_embeddings().weight.device
    if input_ids.device != device:  # prompts are built on the CPU; the model may sit on a GPU
        input_ids = input_ids.to(device)
    return base(input_ids=input_ids, **kwargs).last_hidden_state


# Up to this many rows, the head runs as `W @ h.T`, see `logits`.
FEW_ROWS = 16


def logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's logits for `hidden` `[..., H]`.

    For a handful of rows (a decode step of a batch of policies) `W @ h.T` is what the
    CPU does well: on the 2-core machine the 49K x 576 head takes ~7 ms for 6 rows that
    way, against ~26 ms through `F.linear` (which only matches it for 1 row).
    """
    head = model.get_output_embeddings()
    rows = hidden.reshape(-1, hidden.shape[-1])
    if not isinstance(head, nn.Linear) or rows.shape[0] > FEW_ROWS:
        out = head(hidden)
    else:
        out = torch.matmul(head.weight, rows.T).T
        if head.bias is not None:
            out = out + head.bias
        out = out.reshape(*hidden.shape[:-1], -1)
    return _softcap(model, out)


def _softcap(model, out: torch.Tensor) -> torch.Tensor:
    """Final-logit soft-capping (Gemma 2/3 configs may set it): what the model's own forward applies."""
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    return out if cap is None else torch.tanh(out / cap) * cap


def log_probs(model, hidden: torch.Tensor) -> torch.Tensor:
    """Log-softmax of the LM head over the vocabulary, float32."""
    return torch.log_softmax(logits(model, hidden).float(), dim=-1)
