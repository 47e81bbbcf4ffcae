"""The recompute oracle: StreamingLLM's "sliding window with re-computation".

Each scored token is predicted by a fresh forward over exactly its previous `budget`
tokens, so nothing is evicted and no position is ever shifted: the best any policy
holding `budget` entries could hope for, at O(N x budget) cost. `stride` scores every
K-th token after the first `budget` (those earlier ones see their whole past, which is
the full cache). Windows of several targets run as rows of one batch.
"""

from __future__ import annotations

import time

import torch

from ..errors import KvevictError
from ..position_modes import DEFAULT_POSITIONS
from ..progress import bars
from .forward import log_probs
from .row_result import RowResult
from .streaming import Reference

# Tokens per batched forward: bounds activation memory of the oracle's windows.
TOKENS_PER_BATCH = 4096


def oracle_undefined(model_or_config) -> str | None:
    """Why the oracle is not defined for a model (or its config), or None.

    On a hybrid model (Gemma 3) eviction bounds only the full-attention layers and the
    sliding layers keep the model's own window; re-computing from the last `budget`
    tokens would bound every layer, so it would not be the oracle of the policies beside it.
    Takes a config too, so a sweep decides before any weights load.
    """
    config = getattr(model_or_config, "config", model_or_config).get_text_config()
    kinds = getattr(config, "layer_types", None) or []
    if "sliding_attention" in kinds:
        window = getattr(config, "sliding_window", None)
        return (f"not defined on this hybrid model: eviction bounds its {kinds.count('full_attention')} "
                f"full-attention layers while its {kinds.count('sliding_attention')} sliding layers keep their own "
                f"window of {window}, and re-computing from the last budget tokens would bound them all")
    return None


def oracle_refusal(model) -> str | None:
    """The one-line refusal of the oracle on `model` (see `oracle_undefined`), or None."""
    why = oracle_undefined(model)
    return f"the recompute oracle is {why}; rerun with --oracle-stride 0" if why else None


def recompute_oracle(
    model, tokens: torch.Tensor, budget: int, stride: int, reference: Reference, progress=True
) -> RowResult:
    """NLL (NaN where not scored), KL to the full cache and top-1 agreement of the oracle."""
    if stride < 1:
        raise ValueError("stride must be >= 1")
    refusal = oracle_refusal(model)
    if refusal:
        raise KvevictError(refusal)
    targets = tokens[1:]
    steps = targets.numel()
    nll = torch.full((steps,), float("nan"))
    kl = torch.full((steps,), float("nan"))
    agree = torch.zeros(steps, dtype=torch.bool)
    head = min(budget, steps)
    # predictions 0..budget-1 see their whole past: exactly the full cache
    nll[:head] = reference.result.nll[:head]
    kl[:head] = 0.0
    agree[:head] = True
    scored = list(range(budget, steps, stride))
    rows = max(1, TOKENS_PER_BATCH // budget)
    t0 = time.perf_counter()
    with torch.inference_mode(), bars(progress) as bar:
        task = bar.add_task(f"recompute oracle (window {budget}, stride {stride})", total=len(scored))
        for lo in range(0, len(scored), rows):
            batch = scored[lo : lo + rows]
            # prediction p is for token p+1 from tokens p+1-budget .. p
            windows = torch.stack([tokens[p + 1 - budget : p + 1] for p in batch])
            hidden = model.base_model(input_ids=windows, use_cache=False).last_hidden_state[:, -1]
            lp = log_probs(model, hidden)
            index = torch.tensor(batch)
            nll[index] = -lp.gather(-1, targets[index][:, None])[:, 0]
            ref = reference.at(index)
            kl[index] = (ref.exp() * (ref - lp)).sum(-1)
            agree[index] = lp.argmax(-1) == ref.argmax(-1)
            bar.advance(task, len(batch))
        bar.remove_task(task)
    mask = ~torch.isnan(nll)
    result = RowResult(
        policy="oracle", budget=budget, positions=DEFAULT_POSITIONS, nll=nll, kl=kl, agree=agree,
        max_kept=budget, mean_kept=budget, seconds=time.perf_counter() - t0, scored=mask, head=head,
    )
    # A strided sample's PPL is noisy: the full cache on the very same predictions is its fair baseline.
    result.baseline_nll = result.mean(reference.result.nll)
    return result
