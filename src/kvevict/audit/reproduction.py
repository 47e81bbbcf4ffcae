"""The audit against a reproduction: the deployment's own token stream through any kvevict spec.

The audit sees the server from outside; a kvevict spec rebuilds its rule inside: `llamacpp` (llama-server's
context shift, docs/engines.md; bare, it takes the deployment's own keep and BOS), `vllmfp8+full` (vLLM's fp8
KV cache, `storage_forms/vllm_fp8.py`), `fp8+full` (a calibrated e4m3 cache), or any other. Both are read on
the same tokens (the prompt and the deployment's generation), each against its own full cache, at the
generated positions only, from the first eviction event on (the whole stream where there is none):

* the eviction points: exact (the preset follows the engine's arithmetic on the same token count; a spec
  that evicts nothing has none, as a server that never evicts);
* top-1 disagreement with the full cache: exact on both sides (a top-1 needs no tail);
* mean KL: the audit's is the top-k KL of `fidelity.py` (a lower bound), the reproduction's the exact
  full-vocabulary KL.

How close they must be is `agrees`'s to say (its docstring states the tolerance and why).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .stream import StreamResult

#: top-1 disagreement after the first event may differ by this much, absolute (`agrees`)
DISAGREE_SLACK = 0.05
#: the audit's top-k KL is a lower bound of the full KL: it may exceed the reproduction's by 25% and this many nats
#: beyond the audit's own A/A floor (`agrees`)
KL_OVER = (1.25, 1e-4)
#: ... and must hold at least this share of it (the bound's looseness, measured on llama-server: docs/audit.md)
KL_LOWEST_SHARE = 1 / 3
#: the spec whose options the deployment's own plan fills in (`spec_for`)
PRESET = "llamacpp"


@dataclass(frozen=True)
class Reproduction:
    """Both sides on one stream, over the generated tokens from the first event on (all of them without one)."""

    spec: str
    shifts_audit: tuple[int, ...]
    shifts_kvevict: tuple[int, ...]
    disagree_audit: float
    disagree_kvevict: float
    kl_audit: float
    kl_kvevict: float
    floor_disagree: float  # the audit's top-1 disagreement before the first event (0 without one)
    floor_kl: float = 0.0  # the audit's top-k KL before the first event (0 without one)

    def agrees(self) -> bool:
        """The same eviction points, exactly; top-1 disagreement within `DISAGREE_SLACK` plus the A/A floor's own
        (top-1 is exact on both sides; a server's quantized arithmetic may flip a near-tie the local float32 does
        not, which the floor measures); and the audit's top-k KL a lower bound of the reproduction's full KL: not
        above it beyond the arithmetic (`KL_OVER`: 25% and 1e-4 nats, plus the audit's A/A floor where the stream
        has one: llama-server's Q4_1 arithmetic against kvevict's float32 leaves ~7e-4 nats a token there, vLLM's
        float32 ~1e-11), and holding at least `KL_LOWEST_SHARE` of it. Coarse-graining to the top-k loses most
        where the deployment's distribution spreads widest: it held 49% of the full KL after llama-server --keep 0
        lost its sink, 90% at --keep 4, 78% of vLLM's fp8 KV loss. A rule that loses less than the deployment
        does is told apart by the bound: kvevict's calibrated `fp8+full` loses 0.0008 nats a token on SmolLM2
        where vLLM's fp8 KV shows 0.0020 from outside (docs/audit.md)."""
        if self.shifts_audit != self.shifts_kvevict:
            return False
        if abs(self.disagree_audit - self.disagree_kvevict) > DISAGREE_SLACK + self.floor_disagree:
            return False
        factor, slack = KL_OVER
        return KL_LOWEST_SHARE * self.kl_kvevict <= self.kl_audit <= factor * self.kl_kvevict + slack + self.floor_kl

    def line(self) -> str:
        """`reproduced inside by vllmfp8+full: KL 0.0021 beside the audit's 0.0019, top-1 miss 0.010 beside 0.012;
        agrees`."""
        events = "" if self.shifts_audit == self.shifts_kvevict else (
            f"; evictions at {list(self.shifts_kvevict)[:4]} against the audit's {list(self.shifts_audit)[:4]}")
        return (f"reproduced inside by {self.spec}: KL {self.kl_kvevict:.3g} beside the audit's {self.kl_audit:.3g}, "
                f"top-1 miss {self.disagree_kvevict:.3f} beside {self.disagree_audit:.3f}{events}; "
                + ("agrees" if self.agrees() else "does NOT agree: the deployment runs another rule"))

    def as_dict(self) -> dict:
        return {"spec": self.spec, "shifts_audit": list(self.shifts_audit),
                "shifts_kvevict": list(self.shifts_kvevict), "disagree_audit": self.disagree_audit,
                "disagree_kvevict": self.disagree_kvevict, "kl_audit": self.kl_audit, "kl_kvevict": self.kl_kvevict,
                "floor_disagree": self.floor_disagree, "floor_kl": self.floor_kl, "agrees": self.agrees()}


def spec_for(spec: str, result: StreamResult) -> str:
    """The spec run: bare `llamacpp` takes the deployment's keep and BOS from the stream's plan (llama-server adds
    the BOS to n_keep, `events.effective_keep`); any other spec runs as written."""
    if spec.strip().lower() != PRESET:
        return spec
    plan = result.plan
    return f"{PRESET}:keep={plan.keep - int(plan.add_bos)},bos={int(plan.add_bos)}"


def check_spec(spec: str, n_ctx: int | None) -> str:
    """`spec` parsed and checked at the deployment's context (None: not known yet, no budget checked) before any
    model loads, one line where it cannot run; returns the position mode it runs in (an engine preset's own,
    else kvevict's default)."""
    from ..policies import check_policy
    from ..policies.engine_defaults import run_positions

    bare = f"{PRESET}:keep=0" if spec.strip().lower() == PRESET else spec
    positions = run_positions([bare], None)
    check_policy(bare, n_ctx, positions)
    return positions


def reproduce(model, result: StreamResult, spec: str = PRESET, chunk: int = 16) -> Reproduction:
    """Stream `result`'s prompt and generation through `spec` (`spec_for`) at the deployment's context on `model`
    (kvevict's cache, the same weights), and set its fidelity beside the audit's."""
    import torch

    from ..eval.streaming import compare
    from ..llamacpp.check import ShiftRecorder

    plan = result.plan
    run = spec_for(spec, result)
    positions = check_spec(run, plan.n_ctx)
    prompt = len(plan.prompt)
    tokens = torch.tensor(list(plan.prompt) + result.tokens, dtype=torch.long)
    recorder = ShiftRecorder()
    rows, _ = compare(model, tokens, [run], plan.n_ctx, positions, progress=False, chunk=chunk, observers=[recorder])
    row = rows[0]
    generated = slice(prompt - 1, prompt - 1 + len(result.tokens))  # prediction i is of token i + 1
    kl = row.kl[generated].double().numpy()
    disagree = 1.0 - row.agree[generated].double().numpy()
    # the recorder counts tokens seen at a shift; the audit's step j is the first computed after it: seen - prompt + 1
    shifts = tuple(s - prompt + 1 for s in recorder.shifts if s - prompt + 1 < len(result.tokens))
    first = result.verdict.events[0] if result.verdict.events else 0
    series = result.series
    return Reproduction(
        spec=run, shifts_audit=tuple(result.verdict.events), shifts_kvevict=shifts,
        disagree_audit=float(series["disagree"][first:].mean()), disagree_kvevict=float(np.mean(disagree[first:])),
        kl_audit=float(series["kl"][first:].mean()), kl_kvevict=float(np.mean(kl[first:])),
        floor_disagree=float(series["disagree"][:first].mean()) if first else 0.0,
        floor_kl=float(series["kl"][:first].mean()) if first else 0.0,
    )


def spec_fidelity(model, result: StreamResult, spec: str, chunk: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """`result`'s prompt and generation streamed through kvevict's `spec` (any spec: a storage form such as
    `q8_0+full`, an engine preset) at the deployment's context on `model`, against kvevict's full cache: per
    generated token the exact full-vocabulary KL(full ‖ spec) and the top-1 disagreement, `[G]` each, as
    float64. What the audit read from outside, read inside on the same tokens."""
    import torch

    from ..eval.streaming import compare
    from ..policies.engine_defaults import run_positions

    prompt = len(result.plan.prompt)
    tokens = torch.tensor(list(result.plan.prompt) + result.tokens, dtype=torch.long)
    row = compare(model, tokens, [spec], result.plan.n_ctx, run_positions([spec], None), progress=False,
                  chunk=chunk)[0][0]
    generated = slice(prompt - 1, prompt - 1 + len(result.tokens))  # prediction i is of token i + 1
    return row.kl[generated].double().numpy(), 1.0 - row.agree[generated].double().numpy()
