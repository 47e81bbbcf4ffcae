"""Random-weight models at the attention shapes teams run, for the scale and decode benchmarks.

Weights of 8B-12B models cannot be had here, but their attention shapes can: the real hidden size,
query heads, KV heads, head dim, rotary settings and (Gemma 3) sliding window and layer pattern, with
one or two layers, a small MLP and a small vocabulary. At that shape what a long stream costs is
attention and the cache's own work; the MLP and the LM head are a small fixed share per token.

`scale` divides the hidden size and the head counts (head dim and window kept) for a smoke run in CI.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers as tf

from kvevict.loading.dtypes import cast_weights

#: the MLP and vocabulary of every shape: small, so attention and the cache are what is measured
INTERMEDIATE, VOCAB = 1024, 1024


@dataclass(frozen=True)
class Shape:
    """One model's attention shape; `layers` the default depth (Gemma 3: one sliding and one global layer)."""

    name: str
    family: str  # "llama", "qwen3", "gemma3"
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int = 1
    window: int | None = None  # Gemma 3's sliding window

    def config(self, layers: int | None = None, scale: int = 1):
        """The transformers config: `layers` (default `self.layers`), hidden size and heads divided by `scale`."""
        layers = layers or self.layers
        common = dict(
            vocab_size=VOCAB, hidden_size=self.hidden // scale, intermediate_size=INTERMEDIATE // scale,
            num_hidden_layers=layers, num_attention_heads=max(1, self.heads // scale),
            num_key_value_heads=max(1, self.kv_heads // scale), head_dim=self.head_dim,
            max_position_embeddings=131072,
        )
        if self.family == "llama":  # Llama 3.1's rotary: llama3 scaling of a 500K base
            return tf.LlamaConfig(**common, rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        if self.family == "qwen3":  # its query and key norms come with the config
            return tf.Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        # Gemma 3: five sliding layers to each global one; any depth keeps at least one of each
        kinds = ["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
                 for i in range(layers)]
        return tf.Gemma3TextConfig(
            **common, sliding_window=self.window, layer_types=kinds, query_pre_attn_scalar=self.head_dim,
            final_logit_softcapping=None, attn_logit_softcapping=None,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
        )


SHAPES = {s.name: s for s in (
    Shape("llama-3.1-8b", "llama", 4096, 32, 8, 128),
    Shape("qwen3-8b", "qwen3", 4096, 32, 8, 128),
    Shape("gemma-3-12b", "gemma3", 3840, 16, 8, 256, layers=2, window=1024),
)}
CLASSES = {"llama": tf.LlamaForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "gemma3": tf.Gemma3ForCausalLM}


def build(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32, layers: int | None = None,
          scale: int = 1, seed: int = 0):
    """The random-weight model of shape `name` on `device`, parameters in `dtype` (RoPE buffers float32)."""
    shape = SHAPES[name]
    torch.manual_seed(seed)
    model = CLASSES[shape.family](shape.config(layers, scale)).eval()
    cast_weights(model, dtype)
    return model.to(device)


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def random_ids(tokens: int, seed: int = 0) -> torch.Tensor:
    """`[tokens]` random token ids (the cost does not depend on the text)."""
    return torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(seed))
