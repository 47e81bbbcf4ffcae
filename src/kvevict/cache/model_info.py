"""What the engine reads off a model's config: its decoder config, the kind of each layer,
and whether kvevict can bound its cache at all (`check_model`).

Introspection, not loading: it takes a model or config that is already built, so the
engine (`cache.py`, `layers/sliding.py`) and the protocols that size a stream (`eval/`) read
configs here without importing how models are found and loaded (`kvevict.loading`).
"""

from __future__ import annotations

from ..errors import KvevictError


def check_model(model):
    """The config of `model` if kvevict can bound its cache; a KvevictError naming the fix otherwise."""
    config = getattr(model, "config", None)
    if config is None:
        raise KvevictError("not a transformers model: pass a model from AutoModelForCausalLM / kvevict.load_model")
    if getattr(config, "is_encoder_decoder", False):
        raise KvevictError(
            f"{type(model).__name__} is an encoder-decoder (its cross-attention cache is not a stream): {_SUPPORTED}"
        )
    text = text_config(config)
    layer_kinds(text, type(model).__name__)
    if not getattr(model, "_supports_attention_backend", False):
        raise KvevictError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface "
            f"(state-space models, older architectures), so kvevict cannot attach to it: {_SUPPORTED}"
        )
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise KvevictError(
            f"{type(model).__name__} soft-caps its attention logits (attn_logit_softcapping="
            f"{text.attn_logit_softcapping}), which kvevict's attention does not implement: {_SUPPORTED}"
        )
    return config


#: the architectures the test matrix covers (tests/test_architectures.py), named in refusals
_SUPPORTED = (
    "kvevict supports decoder-only causal LMs whose attention goes through AttentionInterface "
    "(Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, GPT-NeoX, GPT-2, OPT)"
)
#: kinds of layers kvevict has a layer class for (layer_setup.LAYER_KINDS); the rest hold no KV cache to bound
ATTENTION_KINDS = ("full_attention", "sliding_attention")


def layer_kinds(text, name: str = "this model") -> list[str]:
    """The kind of each layer (`config.layer_types`; a model-wide `sliding_window` makes
    every layer sliding), or a KvevictError for kinds no budget can bound."""
    layers = text.num_hidden_layers
    kinds = getattr(text, "layer_types", None)
    if not kinds:
        kinds = ["sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"] * layers
    other = sorted(set(kinds) - set(ATTENTION_KINDS))
    if other:
        raise KvevictError(
            f"{name} has {', '.join(other)} layers (state-space or linear attention keep a fixed-size state, "
            f"not a KV cache), so no budget can bound them: {_SUPPORTED}"
        )
    if "full_attention" not in kinds:
        raise KvevictError(
            f"every layer of {name} is sliding-window (window {text.sliding_window}), so a budget would bound "
            "nothing: set config.sliding_window=None to run it with full attention, or use a model with "
            "full-attention layers"
        )
    return list(kinds)


def text_config(model_or_config):
    """The decoder's text config of a model or a config.

    Multimodal configs nest the language model's settings (layer count, heads, context
    length) in a sub-config; plain decoder configs are their own text config. Every
    reader of those settings goes through here so that the two cases are told apart once.
    """
    config = model_or_config if hasattr(model_or_config, "get_text_config") else getattr(
        model_or_config, "config", model_or_config
    )
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
