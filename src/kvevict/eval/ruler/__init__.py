"""RULER's long-context tasks, generated offline, under four compression protocols.

`registry.TASKS` holds the 11 synthetic tasks (one file per family: `niah`, `vt`, `cwe`,
`fwe`); `qa` reads a user's own QA file. `sample.fit` makes a prompt of a target length
in the model's tokenizer; `protocols` runs the policies on it; `run` is the grid.
"""
