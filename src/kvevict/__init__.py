"""kvevict: KV-cache eviction policies for transformers, and an A/B harness to choose one.

The attention sinks (the first few tokens, which soak up most attention) decide whether
a bounded cache keeps perplexity in the tens or sends it into the thousands; kvevict
makes that measurable on your own model and text before you ship a policy.
"""

from .cache import EvictingCache, attach
from .data import load_text, load_tokens
from .errors import KvevictError
from .eval.compress import Compressed, compress, compress_prompt
from .eval.forward import cache_argument
from .eval.streaming import compare, streaming_ppl
from .loading import load_model
from .policies import Policy, parse_policy, register

__all__ = [
    "Compressed",
    "EvictingCache",
    "KvevictError",
    "Policy",
    "attach",
    "cache_argument",
    "compare",
    "compress",
    "compress_prompt",
    "load_model",
    "load_text",
    "load_tokens",
    "parse_policy",
    "register",
    "streaming_ppl",
]
__version__ = "0.1.0"
