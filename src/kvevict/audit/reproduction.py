"""The audit against the reproduction: the deployment's own token stream through kvevict's `llamacpp` preset.

The audit sees llama-server from outside; kvevict's `llamacpp:keep=K,bos=B` preset rebuilds its context shift
inside (docs/engines.md). Both are read on the same tokens (the prompt and the deployment's generation),
each against its own full cache, at the generated positions only:

* the shift points: exact (both follow llama-server's arithmetic on the same token count);
* top-1 disagreement with the full cache after the first shift: exact on both sides (a top-1 needs no tail);
* mean KL after the first shift: the audit's is the top-k KL of `fidelity.py` (a lower bound), the
  reproduction's the exact full-vocabulary KL.

How close they must be is `agrees`'s to say (its docstring states the tolerance and why).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .stream import StreamResult

#: top-1 disagreement after the first shift may differ by this much, absolute (`agrees`)
DISAGREE_SLACK = 0.05
#: the audit's top-k KL is a lower bound of the full KL: it may exceed the reproduction's by the arithmetic slack
KL_OVER = (1.25, 0.005)
#: ... and must hold at least this share of it (the bound's looseness, measured on llama-server: docs/audit.md)
KL_LOWEST_SHARE = 1 / 3


@dataclass(frozen=True)
class Reproduction:
    """Both sides on one stream, over the generated tokens from the first shift on."""

    shifts_audit: tuple[int, ...]
    shifts_kvevict: tuple[int, ...]
    disagree_audit: float
    disagree_kvevict: float
    kl_audit: float
    kl_kvevict: float
    floor_disagree: float  # the audit's top-1 disagreement before the first shift (server vs local arithmetic)

    def agrees(self) -> bool:
        """The same shift points, exactly; top-1 disagreement after the first shift within `DISAGREE_SLACK` plus the
        A/A floor's own (top-1 is exact on both sides; the server's quantized arithmetic may flip a near-tie the
        local float32 does not, which the floor measures); and the audit's top-k KL a lower bound of the
        reproduction's full KL: not above it beyond the arithmetic (`KL_OVER`: 25% and 0.005 nats; the two sides'
        weights differ by the GGUF's quantization), and holding at least `KL_LOWEST_SHARE` of it. Coarse-graining
        to the top-k loses most where the deployment's distribution spreads widest: it held 49% of the full KL
        after llama-server --keep 0 lost its sink, 90% at --keep 4."""
        if self.shifts_audit != self.shifts_kvevict:
            return False
        if abs(self.disagree_audit - self.disagree_kvevict) > DISAGREE_SLACK + self.floor_disagree:
            return False
        factor, slack = KL_OVER
        return KL_LOWEST_SHARE * self.kl_kvevict <= self.kl_audit <= factor * self.kl_kvevict + slack

    def as_dict(self) -> dict:
        return {"shifts_audit": list(self.shifts_audit), "shifts_kvevict": list(self.shifts_kvevict),
                "disagree_audit": self.disagree_audit, "disagree_kvevict": self.disagree_kvevict,
                "kl_audit": self.kl_audit, "kl_kvevict": self.kl_kvevict, "floor_disagree": self.floor_disagree,
                "agrees": self.agrees()}


def reproduce(model, result: StreamResult, chunk: int = 16) -> Reproduction:
    """Stream `result`'s prompt and generation through `llamacpp:keep=K,bos=B` at the deployment's context on
    `model` (kvevict's cache, the same weights), and set its fidelity beside the audit's."""
    import torch

    from ..eval.streaming import compare
    from ..llamacpp.check import ShiftRecorder
    from ..position_modes import SHIFTED

    plan = result.plan
    prompt = len(plan.prompt)
    keep = plan.keep - int(plan.add_bos)
    tokens = torch.tensor(list(plan.prompt) + result.tokens, dtype=torch.long)
    recorder = ShiftRecorder()
    rows, _ = compare(model, tokens, [f"llamacpp:keep={keep},bos={int(plan.add_bos)}"], plan.n_ctx, SHIFTED.name,
                      progress=False, chunk=chunk, observers=[recorder])
    row = rows[0]
    generated = slice(prompt - 1, prompt - 1 + len(result.tokens))  # prediction i is of token i + 1
    kl = row.kl[generated].double().numpy()
    disagree = 1.0 - row.agree[generated].double().numpy()
    # the recorder counts tokens seen at a shift; the audit's step j is the first computed after it: seen - prompt + 1
    shifts = tuple(s - prompt + 1 for s in recorder.shifts if s - prompt + 1 < len(result.tokens))
    first = result.verdict.events[0] if result.verdict.events else len(result.tokens)
    series = result.series
    return Reproduction(
        shifts_audit=tuple(result.verdict.events), shifts_kvevict=shifts,
        disagree_audit=float(series["disagree"][first:].mean()), disagree_kvevict=float(np.mean(disagree[first:])),
        kl_audit=float(series["kl"][first:].mean()), kl_kvevict=float(np.mean(kl[first:])),
        floor_disagree=float(series["disagree"][:first].mean()),
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
