"""RULER's long-context tasks, generated offline, under the compression protocols.

`registry.TASKS` holds the 11 synthetic tasks (one file per family: `niah`, `vt`, `cwe`,
`fwe`), `registry.OWN_TASKS` kvevict's own (`conversation_tasks`); `qa` reads a user's
own QA file. `sample.fit` makes a prompt of a target length in the model's tokenizer;
`protocol_kinds` holds the protocols as objects and `protocols` runs them on it; `grid`
is the grid.
"""
