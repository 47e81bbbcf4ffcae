"""kvevict as an lm-evaluation-harness model: `--model kvevict`, any policy at any budget.

Importing this module registers the model with lm-eval (the installed lm-eval, 0.4.x,
has no entry-point plugins for models, so the registration is this one import):

    import kvevict.lmeval  # noqa: F401  (registers --model kvevict)
    lm_eval.simple_evaluate(model="kvevict", model_args="pretrained=smollm2-135m,policy=sink4+h2o,budget=20%", ...)

or from the shell, `kvevict lm-eval --tasks copa --model-args ...` (it wraps
`simple_evaluate`). What each request type does:

* `loglikelihood` — context compression (`eval/compress.py`, the H2O / SnapKV
  protocol): the context is prefilled and compressed to the budget, then the
  continuation is scored through the compressed cache. Requests whose context and
  continuation have the same lengths run as rows of one batch (a policy scored by
  reconstruction, `kvzip`, compresses each context alone, with the model's tokenizer; it is
  refused by the two request types below and by `protocol=stream`, which evict as they read).
* `loglikelihood_rolling` — streaming eviction (`eval/streaming.py`): the document is
  read with the budget enforced from the first overflow, every token scored once.
* `generate_until` — the prompt is compressed, then decoded greedily with the policy
  still evicting at every step; prompts of one length run as one batch.

A budget is entries (`budget=256`) or a share of each request's context
(`budget=20%`, as in H2O), never below what the policy pins plus one entry.
lm-eval is an optional extra (`pip install kvevict[lm-eval]`), imported only here.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ..errors import KvevictError
from ..eval.compress import compress, greedy
from ..eval.forward import log_probs
from ..eval.streaming import compare
from ..policies import check_policy
from .hub import quiet_hub
from .lmeval_args import INSTALL, Settings, split_model_args
from .lmeval_tasks import check_data, check_names, task_manager


def import_lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise KvevictError(f"kvevict lm-eval needs lm-evaluation-harness, which is not installed: {INSTALL}") from None
    return lm_eval


def _groups(items: list, key) -> Iterable[list[int]]:
    """Indices of `items` grouped by `key(item)` (one batch per group), longest first."""
    groups: dict = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    for k in sorted(groups, key=lambda k: -sum(k) if isinstance(k, tuple) else -k):
        yield groups[k]


class _Requests:
    """kvevict's eviction policies behind lm-eval's three request types (see the module docstring).

    The whole body of the registered `KvevictLM`, kept at module level so that it reads as a class and not
    as one long function: lm-eval's `TemplateLM`, the base lm-eval requires, exists only once lm-eval is
    imported, so `_model_class` makes the class itself from this one and that base. It relies on what
    `TemplateLM` gives (`cache_hook`, `prefix_token_id`), and is never used without it."""

    def __init__(self, **args) -> None:
        super().__init__()
        from ..data import stream_start
        from ..loading import load_model

        settings = Settings.parse(args)
        self.model, self.tokenizer = load_model(settings.pretrained, allow_download=settings.allow_download,
                                                dtype=settings.dtype)
        self.settings = settings.settled(bool(stream_start(self.tokenizer)))

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos if eos is not None else 0)

    @property
    def max_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    def _batches(self, indices: list[int]) -> Iterable[list[int]]:
        size = self.settings.batch_size
        for lo in range(0, len(indices), size):
            yield indices[lo : lo + size]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        pairs = [(list(ctx), list(cont)) for _, ctx, cont in requests]
        for group in _groups(pairs, lambda p: (len(p[0]), len(p[1]))):
            for batch in self._batches(group):
                ctx = torch.tensor([pairs[i][0] for i in batch])  # [B, T]
                cont = torch.tensor([pairs[i][1] for i in batch])  # [B, L]
                for i, value in zip(batch, self.score(ctx, cont)):
                    out[i] = value
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], value)
        return out

    def score(self, context: torch.Tensor, continuation: torch.Tensor) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each row's continuation `[B, L]` after its context `[B, T]`."""
        s = self.settings
        if s.protocol == "stream":
            return [self._stream_score(c, k) for c, k in zip(context, continuation)]
        if context.shape[0] > 1 and check_policy(s.policy, None, s.positions).reconstructs:
            # a context scored by reconstruction is compressed one at a time (its repeat forwards are its own)
            return [v for i in range(context.shape[0]) for v in self.score(context[i : i + 1],
                                                                            continuation[i : i + 1])]
        state = compress(self.model, context, s.policy, s.entries(context.shape[1]), s.positions, self.tokenizer)
        with torch.inference_mode():
            first = log_probs(self.model, state.hidden[:, None])  # [B, 1, V]
            rest = state.feed(self.model, continuation[:, :-1])  # [B, L-1, H]
            lp = torch.cat([first, log_probs(self.model, rest)], dim=1) if rest.shape[1] else first
        return self._pack(lp, continuation)

    @staticmethod
    def _pack(lp: torch.Tensor, continuation: torch.Tensor) -> list[tuple[float, bool]]:
        """`lp` `[B, L, V]` log-probabilities at the continuation's positions."""
        chosen = lp.gather(-1, continuation[..., None])[..., 0].double().sum(-1)
        greedy_ = (lp.argmax(-1) == continuation).all(-1)
        return [(float(v), bool(g)) for v, g in zip(chosen, greedy_)]

    def _stream_score(self, context: torch.Tensor, continuation: torch.Tensor) -> tuple[float, bool]:
        """Context and continuation read as one stream, evicting as it goes; only the continuation is scored."""
        tokens = torch.cat([context, continuation])
        row = self._stream(tokens, self.settings.entries(context.numel()))
        tail = slice(-continuation.numel(), None)
        return float(-row.nll[tail].double().sum()), bool(row.hit[tail].all())

    def _stream(self, tokens: torch.Tensor, entries: int | None):
        """The `RowResult` of `tokens` streamed through the policy at `entries` (None: the full cache):
        `nll` `[T-1]` of `tokens[1:]`, `hit` `[T-1]` whether each was the top-1 prediction."""
        s = self.settings
        if entries is not None and entries >= tokens.numel():
            entries = None  # nothing would be evicted
        spec = "full" if entries is None else s.policy
        rows, _ = compare(self.model, tokens, [spec], entries or tokens.numel(), s.positions, reference=False,
                          progress=False, chunk=s.chunk)
        return rows[0]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        self.settings.refuse_reconstruction("loglikelihood_rolling evicts each document as it reads it")
        out = []
        for request in requests:
            (text,) = request.args
            tokens = torch.tensor([self.prefix_token_id] + self.tok_encode(text))
            value = float(-self._stream(tokens, self.settings.entries(tokens.numel())).nll.double().sum())
            out.append(value)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), value)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        s = self.settings
        s.refuse_reconstruction("generate_until keeps evicting at every generated token")
        prompts = [self.tok_encode(context) or [self.prefix_token_id] for context, _ in
                   (r.args for r in requests)]
        out: list[str | None] = [None] * len(requests)
        for group in _groups(prompts, len):
            for batch in self._batches(group):
                kwargs = [requests[i].args[1] for i in batch]
                until = [_until(k) for k in kwargs]
                limit = max(int(k.get("max_gen_toks", s.max_gen_toks)) for k in kwargs)
                ids = torch.tensor([prompts[i] for i in batch])
                for i, text, stops in zip(batch, self.generate(ids, limit, until), until):
                    for stop in stops:
                        text = text.split(stop)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, until: list[list[str]]) -> list[str]:
        """Greedy text after each prompt `[B, T]`: the prompt compressed, the policy evicting at every step.
        A row stops once its text holds one of its `until` strings (the caller cuts there)."""
        s = self.settings
        entries = s.entries(prompts.shape[1])
        if prompts.shape[1] > 1:
            state = compress(self.model, prompts[:, :-1], s.policy, entries, s.positions)
            state.feed(self.model, prompts[:, -1:])
        else:
            state = compress(self.model, prompts, s.policy, entries, s.positions)
        if entries is not None:
            state.cache.budget = entries  # compress froze the cache: generation keeps evicting
        def finished(row: int, ids: list[int]) -> bool:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            return any(stop in text for stop in until[row])

        new = greedy(self.model, state, max_new_tokens, [self.eot_token_id], finished)
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in new]


def _model_class():
    """The lm-eval model class, built and registered once, when this module is imported: `_Requests` in
    front of lm-eval's `TemplateLM`, which cannot be named before lm-eval is imported."""
    import_lm_eval()
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    @register_model("kvevict")
    class KvevictLM(_Requests, TemplateLM):
        """kvevict's eviction policies behind lm-eval's three request types (see the module docstring)."""

    return KvevictLM


def _until(kwargs: dict) -> list[str]:
    until = kwargs.get("until") or []
    return [until] if isinstance(until, str) else list(until)


def evaluate(model_args: str, tasks: list[str], num_fewshot: int | None = None, limit: int | None = None,
             include_path: str | None = None, batch_size: int | None = None, seed: int = 0,
             log_samples: bool = False, allow_download: bool = False) -> dict:
    """`lm_eval.simple_evaluate` with `--model kvevict`. `model_args` are checked before anything is
    loaded, the tasks and their datasets before the model. The Hugging Face libraries stay offline
    unless `allow_download` or `allow_download=true` in `model_args` (either lets the datasets and
    the model be downloaded), and never count downloads or send telemetry the user did not ask for
    (`hub.quiet_hub`)."""
    allow_download = allow_download or Settings.parse(split_model_args(model_args)).allow_download
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager

    registered()
    extra = {} if batch_size is None else {"batch_size": batch_size}
    with quiet_hub(allow_download):
        manager = task_manager(TaskManager, tasks, include_path, Path(lm_eval.tasks.__file__).parent)
        check_names(manager, tasks)
        check_data(manager, tasks, allow_download)
        return lm_eval.simple_evaluate(model="kvevict", model_args=model_args, tasks=tasks, num_fewshot=num_fewshot,
                                       limit=limit, task_manager=manager, random_seed=seed, numpy_random_seed=seed,
                                       torch_random_seed=seed, fewshot_random_seed=seed, log_samples=log_samples,
                                       **extra)


def registered():
    """The registered model class; one line naming the install when lm-eval is absent."""
    if KvevictLM is None:
        import_lm_eval()
    return KvevictLM


# Importing this module registers `--model kvevict` when lm-eval is installed (and is harmless when not).
try:
    KvevictLM = _model_class()
except KvevictError:
    KvevictLM = None
