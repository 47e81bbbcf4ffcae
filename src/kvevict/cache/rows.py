"""Rows of a batch and the policies that run in them.

The A/B harness runs several policies as rows of one batch at the same budget: the
weights are read once per step for all of them. `RowLayout` binds policies to rows at
the first forward (when the batch size is known) and groups rows that share a policy
object, so each policy scores all its rows in one call.
"""

from __future__ import annotations

import torch

from ..errors import KvevictError
from ..policies import Policy


class Rows:
    """A subset of batch rows, taken with a slice when they are contiguous."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        self.index = torch.tensor(rows, dtype=torch.long)
        self.contiguous = rows == list(range(rows[0], rows[0] + len(rows)))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        if self.contiguous:
            if self.rows[0] == 0 and len(self.rows) == x.shape[0]:
                return x
            return x[self.rows[0] : self.rows[0] + len(self.rows)]
        return x.index_select(0, self.index.to(x.device))

    def put(self, dest: torch.Tensor, value: torch.Tensor) -> None:
        if self.contiguous:
            dest[self.rows[0] : self.rows[0] + len(self.rows)] = value
        else:
            dest.index_copy_(0, self.index.to(dest.device), value)


class RowGroup(Rows):
    """Rows of the batch that run the same policy object."""

    def __init__(self, policy: Policy, rows: list[int]) -> None:
        super().__init__(rows)
        self.policy = policy


class RowLayout:
    """Which policy runs in which row. Empty until `bind` at the first forward."""

    def __init__(self, policies: list[Policy]) -> None:
        self.policies = policies
        self.groups: list[RowGroup] = []
        self._shared: dict[tuple[int, ...], tuple[Rows, list[Rows]]] = {}

    def rows_for(self, batch: int) -> int:
        """Rows the cache holds when the first forward has `batch` rows.

        With one policy per row, a first forward of one row stands for all of them: the
        rows hold the same tokens until the first eviction, so the shared prefix is
        computed once.
        """
        return len(self.policies) if batch == 1 else batch

    def bind(self, batch: int) -> bool:
        """Assign policies to rows; True if this call bound them (the first forward)."""
        if self.groups:
            return False
        policies = self.policies * batch if len(self.policies) == 1 else self.policies
        if len(policies) != batch:
            raise KvevictError(
                f"{len(self.policies)} policies given for a batch of {batch} rows: give one policy, or one per row"
            )
        self._group(policies)
        return True

    def _group(self, policies: list[Policy]) -> None:
        """One `RowGroup` per policy object, from the policy of each row."""
        by_object: dict[int, list[int]] = {}
        for row, p in enumerate(policies):
            by_object.setdefault(id(p), []).append(row)
        self.groups = [RowGroup(policies[rows[0]], rows) for rows in by_object.values()]
        self._shared = {}

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the bound rows `rows` (in that order), numbered `0..len(rows)-1` from now on.
        The policies are not reset: they go on where they were."""
        policies = self.row_policies()
        kept = [policies[row] for row in rows]
        if len(self.policies) > 1:
            self.policies = kept
        self._group(kept)

    def evict_to(self, budget: int, held: int) -> int | None:
        """Entries each row keeps when a layer holds `held` after a forward (None: keep all). Rows share
        one count (a layer stores one), which the cache checked: a policy with its own schedule
        (`Policy.own_schedule`) runs alone or beside copies of itself."""
        return self.policies[0].evict_to(budget, held)

    def row_policies(self) -> list[Policy]:
        """The policy of each row (after the first forward)."""
        rows: dict[int, Policy] = {}
        for group in self.groups:
            rows.update({row: group.policy for row in group.rows})
        return [rows[i] for i in sorted(rows)]

    @property
    def reconstructed(self) -> list[str]:
        """The statistics of the rows scored by reconstruction (`Policy.reconstructs`), sorted."""
        return sorted({name for g in self.groups if g.policy.reconstructs for name in g.policy.stats})

    def merge(self, parts: list[torch.Tensor | None], batch: int, heads: int, total: int) -> torch.Tensor:
        """One `[B, H, n]` score tensor from each group's scores (`parts[i]` for `groups[i]`).

        One group's scores are used as they are; several are written into a float64
        buffer (policies may score in different dtypes). A group whose part is None
        keeps zeros.
        """
        if len(self.groups) == 1 and parts[0] is not None:
            return parts[0]
        device = next(p.device for p in parts if p is not None)
        scores = torch.zeros(batch, heads, total, dtype=torch.float64, device=device)
        for group, part in zip(self.groups, parts):
            if part is not None:
                group.put(scores, part)
        return scores

    def shared_rows(self, asking: tuple[int, ...]) -> tuple[Rows, list[Rows]]:
        """The rows of the groups `asking`, and where each group sits among them (memoized)."""
        if asking not in self._shared:
            rows = sorted(row for i in asking for row in self.groups[i].rows)
            where = {row: k for k, row in enumerate(rows)}
            parts = [Rows([where[row] for row in self.groups[i].rows]) for i in asking]
            self._shared[asking] = (Rows(rows), parts)
        return self._shared[asking]
