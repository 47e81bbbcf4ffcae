"""Policy spec strings, parsed in one place for the API and the CLI.

Grammar: `[qB[:options]+][sinkN+][adakv[:alpha=A]:]name[:key=value,...]`, e.g. `window`,
`sink4+h2o:recent=0.25`, `snapkv:window=32,kernel=7,pooling=max`, `adakv:snapkv`,
`sink4+adakv:alpha=0.1:snapkv:window=16`. `adakv:` (head-wise budgets, `adakv.py`) is a
wrapper like `sinkN+`: its own options come first, as the `:`-field that holds `=`;
the rest is the inner policy's spec. Options may also be separated by `;`
(`snapkv:window=32;kernel=7`), for places that split at commas themselves (lm-eval's
`model_args`). Aliases: `streamingllm` = `sink4+window`,
`local` / `fifo` = `window`. A storage prefix holds the kept entries in a registered storage form
(`storage_forms.FORMS`): `qB+` (`q8+`, `q4+`, `q2+`) as B-bit codes (options `group`, `residual`,
`keys`, e.g. `q4:group=64,residual=32+sink4+h2o`), `fp8+` as float8 (option `scale`), `q8_0+`, `q4_0+`,
`f16+` as llama.cpp's KV types (option `rot`), `vllmfp8+` as vLLM's CPU fp8 cache holds them (options `format`,
`kscale`, `vscale`).
A new policy registers its class here; its options are read off its constructor, so the parser
and the error messages never go stale.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

from ..errors import KvevictError
from ..position_modes import ORIGINAL, check_positions
from ..storage_forms import FORMS
from .adakv import AdaKV
from .base import Policy
from .expected_attention import ExpectedAttention
from .full import Full
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import KNorm
from .kvzip import KVzip
from .lagkv import LagKV
from .llamacpp import LlamaCpp, Ollama
from .paged import Paged
from .pyramidkv import PyramidKV
from .quantized import Quantized
from .random_subset import Random
from .sinkauto import SinkAuto
from .sinks import SinkPinned
from .sliding_engines import HfSinkCache, Mlc, TrtLlm, VllmSlidingWindow
from .snapkv import SnapKV
from .tova import TOVA
from .truncation import KeepHead, KeepTail
from .window import Window

REGISTRY: dict[str, Callable[..., Policy]] = {
    "full": Full,
    "window": Window,
    "random": Random,
    "h2o": H2O,
    "snapkv": SnapKV,
    "tova": TOVA,
    "knorm": KNorm,
    "keydiff": KeyDiff,
    "pyramidkv": PyramidKV,
    "lagkv": LagKV,
    "expected-attention": ExpectedAttention,
    "kvzip": KVzip,
    # serving engines' own rules (docs/engines.md)
    "llamacpp": LlamaCpp,
    "ollama": Ollama,
    "trtllm": TrtLlm,
    "mlc": Mlc,
    "hf-sinkcache": HfSinkCache,
    "vllm-swa": VllmSlidingWindow,
    "vllm-truncate": KeepTail,
    "sglang-truncate": KeepHead,
}
ALIASES = {"streamingllm": "sink4+window", "local": "window", "fifo": "window"}
_SINK = re.compile(r"^sink(\d+)\+(.+)$")
_SINKAUTO = re.compile(r"^sinkauto(\d*)\+(.+)$")
_ADAKV = "adakv"
# a storage form's prefix: family word, width, variant (ggml's `_0`, joined to the family: `q_0`), options
_STORED = re.compile(r"^([a-z]+)(\d+)(_\d+)?(?::([^+]*))?\+(.+)$")
# page-granular eviction, an option of the whole spec wherever it is written (`sink4+snapkv:page=32`)
_PAGE_OPTION = re.compile(r"(?<=[:,;])(page|pagescore)=([^,;:+]*)")


def register(name: str, factory: Callable[..., Policy]) -> None:
    """Make `name` available to spec strings (for policies defined outside kvevict)."""
    REGISTRY[name] = factory


def known_specs() -> str:
    return ", ".join([*REGISTRY, *ALIASES, "sinkN+<policy>", "sinkauto+<policy>", "adakv:<policy>", "<policy>:page=N",
                      "q8+<policy>", "q4+<policy>", "q2+<policy>", "fp8+<policy>", "q8_0+<policy>", "q4_0+<policy>",
                      "f16+<policy>", "vllmfp8+<policy>"])


def parse_policy(spec: str | Policy) -> Policy:
    """Build a policy from its spec string; a `Policy` passes through unchanged."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise KvevictError(f"empty policy spec: use one of {known_specs()}")
    text = spec.strip().lower()
    paging = dict(_PAGE_OPTION.findall(text))
    if paging:
        return _parse_paged(spec, text, paging)
    text = ALIASES.get(text, text)
    stored = _STORED.match(text)
    if stored and _family(stored) in FORMS:
        return _parse_stored(spec, stored)
    if stored and stored.group(3):
        raise KvevictError(f"'{spec}': {stored.group(1)}{stored.group(2)}{stored.group(3)} is not a KV type kvevict "
                           "holds: llama.cpp's are q8_0+<policy>, q4_0+<policy> and f16+<policy>")
    if re.match(r"^q\d+(_\d+)?(:|$)", text):
        raise KvevictError(f"cannot parse '{spec}': quantized storage is written qB+<policy>, e.g. q4+sink4+h2o "
                           "or q8_0+full")
    auto = _SINKAUTO.match(text)
    if auto:
        return SinkAuto(int(auto.group(1) or 4), parse_policy(auto.group(2)))
    sink = _SINK.match(text)
    if sink:
        return SinkPinned(int(sink.group(1)), parse_policy(sink.group(2)))
    if text.startswith("sink"):
        raise KvevictError(f"cannot parse '{spec}': sink pinning is written sinkN+<policy>, e.g. sink4+h2o")
    name, _, options = text.partition(":")
    if name == _ADAKV:
        return _parse_adakv(spec, options)
    if name in ALIASES and not options:
        return parse_policy(ALIASES[name])
    if name not in REGISTRY:
        raise KvevictError(f"unknown policy '{name}' in spec '{spec}': use one of {known_specs()}")
    factory = REGISTRY[name]
    return factory(**_parse_options(factory, name, options))


def _parse_paged(spec: str, text: str, paging: dict[str, str]) -> Policy:
    """`P:page=N[,pagescore=mean|max]`: the spec without its page options, wrapped in `Paged`."""
    rest = _PAGE_OPTION.sub("", text)
    rest = re.sub(r"([:,;])[,;]+", r"\1", rest).rstrip(":,;")
    if "page" not in paging:
        raise KvevictError(f"'{spec}' sets pagescore without page: write e.g. h2o:page=16,pagescore=max")
    try:
        page = int(paging["page"])
    except ValueError:
        raise KvevictError(f"option page needs a whole number of tokens, got '{paging['page']}' in '{spec}'") from None
    return Paged(parse_policy(rest), page, paging.get("pagescore", "mean"))


def _family(match: re.Match) -> str:
    """The registered family of a storage prefix: its word, with a variant joined (`q8_0`: `q_0`)."""
    return match.group(1) + (match.group(3) or "")


def _parse_stored(spec: str, match: re.Match) -> Policy:
    """`<family><width>[_variant][:options]+P`: P's entries held in the storage form registered for the family
    (`q4:group=G,residual=R+P`: `KvQuant`; `fp8:scale=head+P`: `Fp8`; `q8_0:rot=none+P`: `GgmlBlocks`); the
    width is the form's first field."""
    word, width, variant, options, inner = match.groups()
    form = FORMS[_family(match)]
    written = f"{word}{width}{variant or ''}"
    parsed = _parse_options(form, written, options or "")
    first = next(iter(inspect.signature(form).parameters))
    if first in parsed:
        raise KvevictError(f"'{spec}' sets {first} twice: the width is the number after {word} ({written})")
    return Quantized(form(int(width), **parsed), parse_policy(inner))


def _parse_adakv(spec: str, rest: str) -> Policy:
    """`adakv[:alpha=A]:P`: the wrapper's options (a `:`-field holding `=`), then the inner spec."""
    first, _, inner = rest.partition(":")
    options = ""
    if "=" in first:
        options = first
    else:
        inner = rest
    if not inner.strip():
        raise KvevictError(
            f"'{spec}' names no policy for adakv to allocate across heads: write adakv:<policy>, e.g. adakv:snapkv "
            "or adakv:alpha=0.1:h2o"
        )
    parsed = _parse_options(AdaKV, _ADAKV, options)
    if "inner" in parsed:
        raise KvevictError(f"unknown option 'inner' for adakv in '{spec}': its one option is alpha (adakv:alpha=0.2:P)")
    return AdaKV(inner=parse_policy(inner), **parsed)


def check_policy(spec: str | Policy, budget: int | None, positions: str) -> Policy:
    """Parse `spec` and check it can run at `budget` (None: unbounded, nothing to check) in
    the position mode `positions`.

    The one place a (policy, budget) pair is validated, for the cache, the CLI and the
    sweep planner, so every entry point refuses the same inputs with the same words.
    """
    policy = parse_policy(spec)
    mode = check_positions(positions)
    _check_unwrapped(policy)
    engine = None if policy.position_mode is None else check_positions(policy.position_mode)
    if engine is not None and mode != engine:
        raise KvevictError(
            f"'{policy.spec()}' reproduces an engine whose positions are {engine.words}: the engine decides "
            f"positions, so run it with positions='{engine.name}' (leave --positions out, or give --positions "
            f"{engine.name})"
        )
    if policy.varies_by_head and not mode.per_head:
        raise KvevictError(
            f"'{policy.spec()}' gives each KV head its own number of entries, so positions='{positions}' would "
            f"need a position per head for every query: use positions='{ORIGINAL.name}' (--positions {ORIGINAL.name})"
        )
    if budget is not None and not policy.unbounded:
        if budget < 1:
            raise KvevictError(f"budget must be a positive number of entries, got {budget}")
        policy.check_budget(budget)
    return policy


def _check_unwrapped(policy: Policy) -> None:
    """A policy scored by reconstruction (`kvzip`) runs bare: it pins its own sinks and shares its budget
    across heads and layers itself, so a wrapper (`sinkN+`, `adakv:`, `qB+`, `:page=`) would change
    neither, or break its held-back selection."""
    inner = getattr(policy, "inner", None)
    while inner is not None:
        if inner.reconstructs:
            raise KvevictError(
                f"'{policy.spec()}' wraps '{inner.spec()}', which pins its own sinks (n_sink) and shares its budget "
                f"across heads and layers itself: run '{inner.spec().partition(':')[0]}' bare"
            )
        inner = getattr(inner, "inner", None)


def is_full_cache(spec: str | Policy) -> bool:
    """Whether `spec` is the full cache, the reference every policy is judged against: it never evicts and
    holds its entries as they are (`Capabilities.is_full_cache`; `q4+full` never evicts but is a storage form,
    measured as a row of its own). The one test of "is this the full cache?"."""
    return parse_policy(spec).capabilities.is_full_cache


def shared_batches(specs: list[str]) -> list[list[str]]:
    """`specs` split into batches that can run as rows of one cache (`Capabilities.batch_key`, the key of
    `capabilities.may_share_batch`): every
    policy with a uniform budget together, one batch per storage form (each quantized width, `q4+...`), the
    bounded ones before those that never evict (a quantized full cache grows while the bounded rows' caches
    do not); each policy that declares `own_batch` alone: a per-layer budget (`pyramidkv`) because a layer
    stores one budget for all its rows, per-head budgets (`adakv:P`) because its layers store ragged
    per-head segments and attend by hand, which would slow the uniform rows down."""
    capabilities = {s: parse_policy(s).capabilities for s in specs}
    by_key: dict = {}  # storage form -> grows -> specs, in the order they first come
    for s in specs:
        if not capabilities[s].own_batch:
            form, grows = capabilities[s].batch_key()
            by_key.setdefault(form, {}).setdefault(grows, []).append(s)
    batches = [part for form in by_key.values() for part in (form.get(False), form.get(True)) if part]
    return batches + [[s] for s in specs if capabilities[s].own_batch]


def _parse_options(factory: Callable[..., Policy], name: str, options: str) -> dict:
    params = {
        p.name: p for p in inspect.signature(factory).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD
    }
    valid = ", ".join(params) or "none"
    parsed: dict = {}
    for item in filter(None, (part.strip() for part in re.split(r"[,;]", options))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in params:
            raise KvevictError(f"unknown option '{item}' for policy '{name}': valid options are {valid} (key=value)")
        parsed[key] = _convert(name, key, raw.strip(), params[key].default)
    return parsed


#: the spellings a boolean option takes (anything else is refused, never read as False)
BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _convert(name: str, key: str, raw: str, default: object) -> object:
    if isinstance(default, bool):
        if raw.lower() not in BOOLEANS:
            raise KvevictError(
                f"option {name}:{key} is true or false, got '{raw}': write {key}=true or {key}=false "
                f"(also {'/'.join(BOOLEANS)})"
            )
        return BOOLEANS[raw.lower()]
    try:
        if isinstance(default, int) or (default is None and raw.lstrip("-").isdigit()):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        kind = type(default).__name__ if default is not None else "int"
        raise KvevictError(f"option {name}:{key} needs a {kind} value, got '{raw}'") from None
    return raw
