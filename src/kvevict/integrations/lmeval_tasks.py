"""lm-eval's tasks and their data, found before the model loads.

`kvevict lm-eval` indexes the tasks it is asked for and loads each one's dataset first,
offline unless downloading was allowed (`hub.quiet_hub`), so an unknown task or a
dataset that is not on this machine is one line naming the fix, before the model loads
(lm-eval itself loads the model first, then the data).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import KvevictError

#: what a user can point --include-path at instead of a dataset on the Hub
LOCAL_DATA = "point --include-path at task YAML files that read local data (dataset_path: json, with data_files)"


def task_manager(manager_class, tasks: list[str], include_path: str | None, defaults: Path | None = None):
    """lm-eval's task index: of `include_path` alone when it holds every task asked for (indexing
    lm-eval's own thousands of task files takes ~10 s), else of both. With `defaults` (lm-eval's own
    task folder), a task named in none of its files is refused before that index is built: a text
    scan of its ~14,000 files takes ~1.5 s, so a typo is told at once."""
    local = None
    if include_path:
        local = manager_class(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    if defaults is not None:
        _refuse(unmentioned(defaults, [t for t in tasks if local is None or t not in local.all_tasks]))
    return manager_class(include_path=include_path)


def unmentioned(folder: Path, names: list[str]) -> list[str]:
    """The `names` that no task file under `folder` (YAML or Python) contains at all, so no index built
    from them can hold them; every name an lm-eval index holds (task, group, tag) is written in one."""
    left = set(names)
    for path in sorted(folder.rglob("*")):
        if not left:
            break
        if path.suffix in (".yaml", ".yml", ".py") and path.is_file():
            text = path.read_text(errors="ignore")
            left = {name for name in left if name not in text}
    return [name for name in names if name in left]


def check_names(manager, tasks: list[str]) -> None:
    _refuse([t for t in tasks if t not in manager.all_tasks])


def _refuse(missing: list[str]) -> None:
    if missing:
        raise KvevictError(f"unknown lm-eval task {', '.join(missing)}: check --tasks, or --include-path for "
                           "a folder of task YAML files")


def check_data(manager, tasks: list[str], allow_download: bool) -> None:
    """Build every task, which loads its dataset; one that cannot be loaded is one line naming it.

    Offline (the default), datasets raises `ConnectionError` ("Couldn't reach 'aps/super_glue'
    on the Hub") for a Hub dataset that is not in the local cache; a missing local file or an
    unknown dataset is a `FileNotFoundError`.
    """
    for name in tasks:
        try:
            manager.load([name])
        except (ConnectionError, FileNotFoundError) as exc:
            raise KvevictError(_data_error(name, exc, allow_download)) from None


def _data_error(task: str, exc: Exception, allow_download: bool) -> str:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    quoted = re.search(r"'([^'\s]+)'", first)  # the first quoted name without spaces (not "Couldn't reach")
    dataset = f"the dataset '{quoted.group(1)}'" if quoted else "its dataset"
    if isinstance(exc, ConnectionError) and not allow_download:
        return (f"lm-eval task {task} needs {dataset}, which is not in the local Hugging Face cache (datasets "
                "resolve offline): download it where there is a network (the same command with --allow-download; "
                f"library: evaluate(..., allow_download=True)), or {LOCAL_DATA}")
    return f"lm-eval task {task} cannot load {dataset} ({first}): check the task's data, or {LOCAL_DATA}"
