"""`import kvevict.lmeval` registers `--model kvevict` with lm-eval (the README's promise).

The model lives in `kvevict.integrations.lmeval`; this module only imports it.
"""

from .integrations.lmeval import KvevictLM, evaluate

__all__ = ["KvevictLM", "evaluate"]
