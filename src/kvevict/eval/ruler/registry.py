"""Every task of the grid by name: RULER's synthetic tasks (scripts/synthetic.yaml) and kvevict's own.

A new task is one file and one line here: RULER's in `TASKS` (what `all` names), others in `OWN_TASKS`.
"""

from __future__ import annotations

from ...errors import KvevictError
from .conversation_tasks import TASKS as CONVERSATION
from .cwe import CommonWords
from .fwe import FrequentWords
from .niah import TASKS as NIAH
from .vt import VariableTracking

TASKS = {task.name: task for task in [*NIAH, VariableTracking(), CommonWords(), FrequentWords()]}
#: kvevict's own workloads, run by the same grid and protocols (not part of `all`)
OWN_TASKS = {task.name: task for task in [*CONVERSATION]}
_EVERY = {**TASKS, **OWN_TASKS}


def several_keys() -> list[str]:
    """Tasks with several keys in one context: what the `multi` protocol asks about one by one."""
    return [name for name, task in _EVERY.items() if task.asks_several]


def get_task(name: str):
    try:
        return _EVERY[name]
    except KeyError:
        raise KvevictError(f"unknown RULER task '{name}': use one of {', '.join(_EVERY)}") from None


def parse_tasks(text: str) -> list[str]:
    """`niah_single_1,vt`, `all` (RULER's tasks), or a family (`niah`: every niah task; `conversation`),
    checked against the registry."""
    names = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "all":
            names += list(TASKS)
        elif part not in _EVERY and any(task.family == part for task in _EVERY.values()):
            names += [name for name, task in _EVERY.items() if task.family == part]
        else:
            names.append(get_task(part).name)
    if not names:
        raise KvevictError(f"no RULER task in '{text}': use e.g. niah_single_1,vt or all")
    return list(dict.fromkeys(names))
