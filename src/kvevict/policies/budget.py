"""Budgets as users write them: a number of entries (`256`), a share of the context (`25%`),
or `full`; parsed here, beside `check_policy`, for the CLI, the protocols and lm-eval.
"""

from __future__ import annotations

import math

from ..errors import KvevictError

Budget = int | str | None


def parse_budget(text: str | int | None) -> Budget:
    """A budget as the user wrote it: entries (`256`), a share (`25%`), or `full`/None.

    Validates the form only; `resolve_budget` turns it into entries for a context.
    """
    if text is None or isinstance(text, int):
        if isinstance(text, int) and text < 1:
            raise KvevictError(f"budget must be a positive number of entries or a percentage such as 25%, got {text}")
        return text
    raw = text.strip().lower()
    if raw in ("full", "none", ""):
        return None
    if raw.endswith("%"):
        try:
            share = float(raw[:-1])
        except ValueError:
            share = math.nan
        if not 0 < share <= 100:
            raise KvevictError(f"budget '{text}' is not a percentage in (0, 100]: write e.g. 25%")
        return f"{share:g}%"
    try:
        value = int(raw)
    except ValueError:
        raise KvevictError(f"budget '{text}' is neither a number of entries nor a percentage such as 25%") from None
    return parse_budget(value)


def resolve_budget(budget: Budget, context_length: int) -> int | None:
    """Entries per layer and KV head for a context of `context_length` tokens (None = full)."""
    budget = parse_budget(budget)
    if budget is None or isinstance(budget, int):
        return budget
    share = float(budget[:-1]) / 100.0
    return max(1, int(round(share * context_length)))


def budget_label(budget: Budget) -> str:
    """How a budget is shown in tables and records: `256`, `25%` or `full`."""
    budget = parse_budget(budget)
    return "full" if budget is None else str(budget)
