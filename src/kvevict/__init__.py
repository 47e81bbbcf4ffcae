"""kvevict: KV-cache eviction policies for transformers, and an A/B harness to choose one.

The attention sinks (the first few tokens, which soak up most attention) decide whether
a bounded cache keeps perplexity in the tens or sends it into the thousands; kvevict
makes that measurable on your own model and text before you ship a policy.

The public names are imported on first use (PEP 562), so `import kvevict` and the
command line start without torch and transformers; `kvevict.EvictingCache` loads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import exports

# public name -> the module that defines it
_EXPORTS = {
    "Compressed": ".eval.compress",
    "EvictingCache": ".cache",
    "KvevictError": ".errors",
    "Policy": ".policies",
    "attach": ".cache",
    "cache_argument": ".eval.forward",
    "compare": ".eval.streaming",
    "compress": ".eval.compress",
    "compress_prompt": ".eval.compress",
    "load_model": ".loading",
    "load_text": ".data",
    "load_tokens": ".data",
    "parse_policy": ".policies",
    "register": ".policies",
    "streaming_ppl": ".eval.streaming",
}

if TYPE_CHECKING:
    from .cache import EvictingCache, attach
    from .data import load_text, load_tokens
    from .errors import KvevictError
    from .eval.compress import Compressed, compress, compress_prompt
    from .eval.forward import cache_argument
    from .eval.streaming import compare, streaming_ppl
    from .loading import load_model
    from .policies import Policy, parse_policy, register


__getattr__, __dir__ = exports(__name__, _EXPORTS)

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
