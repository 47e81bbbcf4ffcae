"""kvevict's attention function: SDPA for the output, plus the statistics policies need.

Registered in transformers' `AttentionInterface` as `"kvevict"`. The cache layer that
was just updated left itself in the attention kwargs the model hands over (`LAYER_KEY`),
so two caches can run in two threads at once. The function hands the call to that layer:
a chunk that evicts token by token inside itself (and every forward of a per-head layer)
is the layer's `replay`; anything else is `SlotLayer.attend`, which asks the layer's
policies what they need (`plan`), computes the output with `scaled_dot_product_attention`
(grouped-query, no `repeat_kv`; by hand for a decode step whose every row wants that
query's attention, H2O, so the probabilities are kept) and hands the queries back
(`finish`). The mask is built there, not by transformers: after eviction the cache's slots
are no longer contiguous positions. transformers' eager attention / `output_attentions` is
not involved. A padding mask is refused by the mask hook below, because a left-padded row
would need per-row positions and budgets.
"""

from __future__ import annotations

import threading

import torch

from ..errors import KvevictError
from .inputs import padded_batch_error
from .layers.interface import LAYER_KEY, NAME
from .layers.sliding import band
from .statistics.probabilities import causal, sdpa


def kvevict_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query `[B, H_q, q, D]`, key/value `[B, H_kv, n + q, D]` -> output `[B, q, H_q, D]`."""
    layer = kwargs.pop(LAYER_KEY, None)
    handoff = getattr(module, HANDOFF, None)
    if layer is None and handoff is not None:  # a model that hands the cache no kwargs (GPT-NeoX)
        layer, handoff.layer = getattr(handoff, "layer", None), None
    refuse_logit_changes(module, kwargs)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if layer is None:  # no EvictingCache: plain SDPA, with the caller's mask if any
        out = plain_attention(query, key, value, attention_mask, scaling, kwargs.get("sliding_window"))
    elif attention_mask is not None:
        raise KvevictError(
            "a prepared 4-D attention mask cannot be combined with EvictingCache (its slots are not positions): "
            "pass no attention_mask, the cache builds the right one"
        )
    elif layer.replays(query.shape[2]):  # a chunk that evicts token by token inside itself
        out = layer.replay(query, kwargs, scaling)
    else:  # SDPA over `[kept | new]` around the layer's hooks (`SlotLayer.attend`)
        out = layer.attend(query, key, value, scaling, kwargs)
    return out.transpose(1, 2).contiguous(), None


def plain_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    scaling: float, sliding_window: int | None,
) -> torch.Tensor:
    """Attention without kvevict's cache: the caller's own 4-D mask (plain SDPA semantics), else causal, a
    sliding-window layer's band over contiguous keys. Shapes as `kvevict_attention`'s, output `[B, H_q, q, D]`."""
    q_len, kv_len = query.shape[2], key.shape[2]
    mask, is_causal = attention_mask, False
    if attention_mask is None:
        mask, is_causal = causal(q_len, kv_len, query.device)
        if sliding_window:
            mask, is_causal = band(q_len, kv_len, sliding_window, query.device), False
    return sdpa(query, key, value, mask, is_causal, scaling)


def refuse_logit_changes(module: torch.nn.Module, kwargs: dict) -> None:
    """Logit soft-capping (Gemma 2) and learned sink logits (GPT-OSS) change the softmax
    that SDPA computes; kvevict's attention does not implement them, so it refuses them
    rather than silently attend without them. (The scaling factor, e.g. Gemma's
    `query_pre_attn_scalar`, arrives as `scaling` and is honoured.)"""
    if kwargs.get("softcap") is not None:
        raise KvevictError(
            f"{type(module).__name__} soft-caps its attention logits (softcap={kwargs['softcap']}), which kvevict's "
            "attention does not implement: use a model without attn_logit_softcapping (Gemma 3, not Gemma 2)"
        )
    if kwargs.get("s_aux") is not None:
        raise KvevictError(
            f"{type(module).__name__} adds learned attention-sink logits (s_aux, GPT-OSS), which kvevict's "
            "attention does not implement: use a model without learned sinks"
        )


def kvevict_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """transformers' mask hook: only used to refuse padding; the real mask is built above."""
    if attention_mask is not None and attention_mask.dtype == torch.bool and not bool(attention_mask.all()):
        raise padded_batch_error()
    if attention_mask is not None and attention_mask.dtype != torch.bool and not bool((attention_mask != 0).all()):
        raise padded_batch_error()
    return None


#: attribute of an attention module holding its thread-local hand-off slot
HANDOFF = "_kvevict_handoff"


def handoffs(model) -> dict[int, threading.local]:
    """Per layer index, a thread-local slot on that layer's attention module.

    Most models hand their attention kwargs to `cache.update`, where the layer leaves
    itself for the attention function. GPT-NeoX does not, so the layer leaves itself in
    this slot instead and the attention function reads it off the module it is given.
    Thread-local, so two caches in two threads on one model never see each other's layer.
    """
    slots = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and type(module).__name__.endswith("Attention"):
            if not isinstance(getattr(module, HANDOFF, None), threading.local):
                module.__dict__[HANDOFF] = threading.local()
            slots[index] = module.__dict__[HANDOFF]
    return slots


def attach(model) -> None:
    """Route `model`'s attention through kvevict (idempotent). transformers' interfaces live with its modeling
    code, which a loaded model has imported already: importing them here keeps the engine's import light."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, kvevict_attention)
    AttentionMaskInterface.register(NAME, kvevict_mask)
    if getattr(model.config, "_attn_implementation", None) != NAME:
        model.set_attn_implementation(NAME)
