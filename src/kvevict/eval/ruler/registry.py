"""Every RULER synthetic task by name (RULER's scripts/synthetic.yaml); a new task is one line here."""

from __future__ import annotations

from ...errors import KvevictError
from .cwe import CommonWords
from .fwe import FrequentWords
from .niah import TASKS as NIAH
from .vt import VariableTracking

TASKS = {task.name: task for task in [*NIAH, VariableTracking(), CommonWords(), FrequentWords()]}

#: tasks with several keys in one context: what the `multi` protocol asks about one by one
MULTI = ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multiquery")


def get_task(name: str):
    try:
        return TASKS[name]
    except KeyError:
        raise KvevictError(f"unknown RULER task '{name}': use one of {', '.join(TASKS)}") from None


def parse_tasks(text: str) -> list[str]:
    """`niah_single_1,vt` or `all` or `niah` (every niah task), checked against the registry."""
    names = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "all":
            names += list(TASKS)
        elif part == "niah":
            names += [n for n in TASKS if n.startswith("niah_")]
        else:
            names.append(get_task(part).name)
    if not names:
        raise KvevictError(f"no RULER task in '{text}': use e.g. niah_single_1,vt or all")
    return list(dict.fromkeys(names))
