"""The `model_args` of `--model kvevict` (lm-eval), parsed and checked without importing lm-eval.

`kvevict lm-eval` checks them before lm-eval (seconds to import) or the model is
loaded, so a bad policy or budget is one line at once. The model itself is in
`kvevict.integrations.lmeval`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..defaults import DEFAULT_CHUNK
from ..errors import KvevictError
from ..loading.dtypes import DTYPES
from ..policies import check_policy
from ..policies.budget import Budget, parse_budget, resolve_budget
from ..policies.engine_defaults import run_positions, with_stream_start
from ..position_modes import check_positions

INSTALL = "pip install kvevict[lm-eval]"
#: lm-eval `model_args` this model takes (anything else lm-eval passes is listed in `IGNORED`)
ARGS = ("pretrained", "policy", "budget", "positions", "protocol", "batch_size", "max_gen_toks", "chunk",
        "allow_download", "dtype")
#: arguments lm-eval hands every model that mean nothing on kvevict's CPU path
IGNORED = ("device", "max_batch_size", "trust_remote_code")
PROTOCOLS = ("compress", "stream")


@dataclass
class Settings:
    """The parsed `model_args`: what the model evaluates, checked before the model is loaded."""

    pretrained: str = "smollm2-135m"
    policy: str = "full"
    budget: Budget = None
    positions: str | None = None  # None: the engine preset's own mode, else the stream's own positions
    protocol: str = "compress"
    batch_size: int = 16
    max_gen_toks: int = 256
    chunk: int = DEFAULT_CHUNK
    allow_download: bool = False
    dtype: str | None = None  # float32, bfloat16, float16; None: load_model's default (float32 on the CPU)

    @classmethod
    def parse(cls, args: dict) -> Settings:
        """`model_args` as lm-eval parsed them; a bad value is one `KvevictError` naming the fix."""
        unknown = sorted(set(args) - set(ARGS) - set(IGNORED))
        if unknown and ":" in str(args.get("policy", "")):
            raise KvevictError(
                f"unknown model_args {', '.join(unknown)} for --model kvevict: lm-eval splits model_args at commas, "
                f"so separate the policy's own options with ';' (policy={args['policy']};{unknown[0]}=...)"
            )
        if unknown:
            raise KvevictError(f"unknown model_args {', '.join(unknown)} for --model kvevict: use {', '.join(ARGS)}")
        known = {k: v for k, v in args.items() if k in ARGS and v is not None}
        if "budget" in known:
            known["budget"] = parse_budget(str(known["budget"]))
        if str(known.get("batch_size", "1")).startswith("auto"):
            known.pop("batch_size")
        for name in ("batch_size", "max_gen_toks", "chunk"):
            if name in known:
                try:
                    known[name] = int(known[name])
                except ValueError:
                    raise KvevictError(f"model_args {name} takes a whole number, got '{known[name]}'") from None
        if "allow_download" in known:
            known["allow_download"] = str(known["allow_download"]).lower() in ("1", "true", "yes")
        settings = cls(**{k: (str(v) if k in ("pretrained", "policy", "positions", "protocol", "dtype") else v)
                          for k, v in known.items()})
        if settings.dtype == "auto":  # lm-eval's spelling of "the default"
            settings.dtype = None
        if settings.dtype is not None and settings.dtype not in DTYPES:
            raise KvevictError(f"model_args dtype must be one of {', '.join(DTYPES)}, got '{settings.dtype}'")
        if settings.positions is not None:
            check_positions(settings.positions, "model_args positions")
        settings.positions = run_positions([settings.policy], settings.positions)
        check_policy(settings.policy, settings.budget if isinstance(settings.budget, int) else None,
                     settings.positions)
        if settings.protocol not in PROTOCOLS:
            raise KvevictError(f"model_args protocol must be one of {', '.join(PROTOCOLS)} (compress: compress the "
                               f"context, then score; stream: evict while reading it), got '{settings.protocol}'")
        if settings.protocol == "stream":
            settings.refuse_reconstruction("protocol=stream evicts each context as it reads it")
        return settings

    def refuse_reconstruction(self, what: str) -> None:
        """A policy scored by reconstructing a context once it is read (`kvzip`) cannot evict as a stream is
        read or generated: one line naming where it runs."""
        policy = check_policy(self.policy, None, self.positions)
        if policy.reconstructs:
            raise KvevictError(
                f"'{policy.spec()}' scores a context by reconstructing it once it is read, and {what}: run it on "
                "loglikelihood (multiple-choice) tasks with protocol=compress, or with kvevict ruler"
            )

    def settled(self, adds_bos: bool) -> Settings:
        """These settings on a model whose tokenizer does (`adds_bos`) or does not put BOS first
        (`data.stream_start`): a preset option that reads the model (llama.cpp's add-BOS) written out."""
        return replace(self, policy=with_stream_start([self.policy], adds_bos)[0])

    def entries(self, context_length: int) -> int | None:
        """The budget in entries for a context of `context_length` tokens (None: the full cache)."""
        if check_policy(self.policy, None, self.positions).unbounded:
            return None
        entries = resolve_budget(self.budget, context_length)
        if entries is None:
            raise KvevictError(f"policy '{self.policy}' evicts and needs a budget: add budget=20% or budget=256 "
                               "to model_args")
        return max(entries, int(check_policy(self.policy, None, self.positions).pinned) + 1)


def split_model_args(text: str) -> dict:
    """`key=value,key=value` as lm-eval reads it (split at commas, then at the first `=`)."""
    pairs = {}
    for item in (part for part in text.split(",") if part.strip()):
        key, sep, value = item.partition("=")
        if not sep:
            raise KvevictError(f"model_args item '{item}' is not key=value: write e.g. policy=h2o,budget=20%")
        pairs[key.strip()] = value.strip()
    return pairs
