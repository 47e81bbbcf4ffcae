"""Tiny randomly initialised models of every family the architecture matrix covers, from configs (no download).

Each is small (2-4 layers, head_dim 16) with a wide initialisation so attention is
peaky and evicting the wrong entry changes the output. `positions` says which
position modes the family supports: absolute positions (GPT-2, OPT) have no rotation
to shift.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers as tf

VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, initializer_range=0.3)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
#: Gemma 3's local layers: small enough that a 60-token stream slides past it
GEMMA_WINDOW = 7


@dataclass(frozen=True)
class Arch:
    name: str
    positions: tuple[str, ...]

    def build(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        """The model with weights drawn in float32 and then rounded to `dtype`; buffers (RoPE's
        `inv_freq`) stay float32, as `from_pretrained(..., dtype=dtype)` leaves them."""
        torch.manual_seed(seed)
        model = BUILDERS[self.name]().eval()
        for param in model.parameters():
            param.data = param.data.to(dtype)
        return model


def _llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        **COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ))


def _mistral():
    return tf.MistralForCausalLM(tf.MistralConfig(
        **COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, sliding_window=None, rope_parameters=ROPE,
    ))


def _qwen2():
    config = tf.Qwen2Config(**COMMON, num_hidden_layers=2, num_key_value_heads=2, rope_parameters=ROPE)
    return tf.Qwen2ForCausalLM(config)


def _qwen3():
    return tf.Qwen3ForCausalLM(tf.Qwen3Config(
        **COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, rope_parameters=ROPE,
    ))


def _gemma3():
    config = tf.Gemma3TextConfig(
        **COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=GEMMA_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=32, final_logit_softcapping=None, attn_logit_softcapping=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    )
    return tf.Gemma3ForCausalLM(config)


def _phi3():
    return tf.Phi3ForCausalLM(tf.Phi3Config(
        **COMMON, num_hidden_layers=2, num_key_value_heads=2, sliding_window=None, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ))


def _gpt_neox():
    return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        **COMMON, num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ))


def _gpt2():
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.3,
    ))


def _opt():
    return tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=64, init_std=0.3,
    ))


BUILDERS = {
    "llama3": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "gemma3": _gemma3, "phi3": _phi3,
    "gpt_neox": _gpt_neox, "gpt2": _gpt2, "opt": _opt,
}
ROTARY = ("original", "cache")
ARCHS = [Arch(name, ROTARY) for name in ("llama3", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "gpt_neox")] + [
    Arch(name, ("original",)) for name in ("gpt2", "opt")
]
