"""kvevict's attention function: SDPA for the output, plus the statistics policies need.

Registered in transformers' `AttentionInterface` as `"kvevict"`. The cache layer that
was just updated left itself in the attention kwargs the model hands over (`LAYER_KEY`),
so two caches can run in two threads at once. The function asks that layer what its
policies need (`plan`), computes the output with `scaled_dot_product_attention`
(grouped-query, no `repeat_kv`), then hands the queries back (`finish`). One exception
to SDPA: a decode step where every row's policy wants that query's attention (H2O)
computes attention by hand once and keeps the probabilities, because SDPA cannot
return them and a second pass costs as much again. transformers' eager attention /
`output_attentions` is not involved.

The mask is built here, not by transformers: after eviction the cache's slots are no
longer contiguous positions, and the right mask is simply "every kept entry is visible,
the new tokens are causal among themselves". A padding mask is refused by the mask
hook below, because a left-padded row would need per-row positions and budgets.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ..errors import KvevictError
from .inputs import padded_batch_error
from .layer_interface import LAYER_KEY, NAME
from .probabilities import decode_attention
from .sliding import band


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
    q_len, kv_len = query.shape[2], key.shape[2]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if attention_mask is not None and layer is not None:
        raise KvevictError(
            "a prepared 4-D attention mask cannot be combined with EvictingCache (its slots are not positions): "
            "pass no attention_mask, the cache builds the right one"
        )
    if layer is not None and layer.replays(q_len):  # a chunk that evicts token by token inside itself
        return layer.replay(query, kwargs, scaling).transpose(1, 2).contiguous(), None
    query_positions = None
    if layer is not None:
        query, query_positions = layer.align_query(query, kwargs)
    mask = None
    is_causal = False
    if attention_mask is not None:
        mask = attention_mask  # a caller's own 4-D mask, without kvevict's cache: plain SDPA semantics
    elif q_len > 1:
        if kv_len == q_len:
            is_causal = True
        else:
            # bottom-right aligned: query i sees every cached entry and new tokens <= i
            cols = torch.arange(kv_len, device=query.device)
            rows = torch.arange(q_len, device=query.device) + (kv_len - q_len)
            mask = cols[None, :] <= rows[:, None]
    window = layer.window_mask(q_len) if layer is not None else None
    if layer is None and attention_mask is None and kwargs.get("sliding_window"):
        window = band(q_len, kv_len, kwargs["sliding_window"], query.device)  # no EvictingCache: contiguous keys
    if window is not None:  # a sliding-window layer: each query sees its own window only
        mask, is_causal = window, False
    probs = None
    wants_probs = layer.plan() if layer is not None else False  # the cache asks its policies first
    if wants_probs and q_len == 1:
        out, probs = decode_attention(query, key, value, scaling)
    else:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            is_causal=is_causal,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    if layer is not None:
        layer.finish(query, query_positions, scaling, probs)
    return out.transpose(1, 2).contiguous(), None


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
