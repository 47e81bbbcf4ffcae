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
DISAGREE_SLACK = 0.10
#: the mean KL after the first shift may differ by this factor either way (`agrees`)
KL_FACTOR = 2.0


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
        """Same shift points; top-1 disagreement after the first shift within `DISAGREE_SLACK` plus the A/A floor's
        own disagreement (the server's quantized arithmetic flips near-ties the local float32 does not); mean KL
        within a factor `KL_FACTOR` (the audit's top-k KL drops the tail beyond both top-k, and after a shift the
        two sides' near-ties resolve differently, so the streams' losses match in size, not token by token)."""
        if self.shifts_audit != self.shifts_kvevict:
            return False
        if abs(self.disagree_audit - self.disagree_kvevict) > DISAGREE_SLACK + self.floor_disagree:
            return False
        low, high = sorted((max(self.kl_audit, 1e-9), max(self.kl_kvevict, 1e-9)))
        return high / low <= KL_FACTOR

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
