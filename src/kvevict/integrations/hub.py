"""Keeping lm-eval's Hugging Face libraries off the network while kvevict runs it.

What they reach for, found by running `kvevict lm-eval` on local task files under the
test suite's socket guard (huggingface_hub 2.4, datasets 5.2, evaluate 0.4.6, lm-eval 0.4.13):

* datasets: every dataset load, a local JSON file included, sends a HEAD request to an
  S3 address to count the load (`load.increase_load_count`) unless the hub is offline or
  `HF_UPDATE_DOWNLOAD_COUNTS` is off; a Hub dataset is looked up on the Hub (its
  revision) even when it is in the local cache;
* evaluate: a metric lm-eval does not have itself is fetched from the Hub
  (`lm_eval.api.registry.get_metric`), and its load counted the same way;
* huggingface_hub: every request, and telemetry where a caller sends it;
* lm-eval itself: nothing at import; some of its task files call `nltk.download` when
  loaded (ifeval and others), which no switch stops.

Each library reads its switches (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`, ...) once, at
import, into module constants. So `quiet_hub` sets the variables for libraries that are
not imported yet and the constants of those that are (transformers has imported
huggingface_hub by now), and puts both back afterwards, as `models.py` does for
loading a model.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec

#: (variable, value, the module constants it stands for: module, attribute, value) while offline
OFFLINE = (
    ("HF_HUB_OFFLINE", "1", (("huggingface_hub.constants", "HF_HUB_OFFLINE", True),
                             ("datasets.config", "HF_HUB_OFFLINE", True))),
    ("HF_DATASETS_OFFLINE", "1", (("datasets.config", "HF_DATASETS_OFFLINE", True),)),
    ("HF_EVALUATE_OFFLINE", "1", (("evaluate.config", "HF_EVALUATE_OFFLINE", True),)),
)
#: switched off whether or not downloading is allowed, unless the user set one of `TELEMETRY_SET`
TELEMETRY = (
    ("HF_HUB_DISABLE_TELEMETRY", "1", (("huggingface_hub.constants", "HF_HUB_DISABLE_TELEMETRY", True),)),
)
TELEMETRY_SET = ("HF_HUB_DISABLE_TELEMETRY", "DISABLE_TELEMETRY", "DO_NOT_TRACK")
#: download counting (a request per dataset or metric load), off unless the user set the variable
COUNTS = (
    ("HF_UPDATE_DOWNLOAD_COUNTS", "0", (("datasets.config", "HF_UPDATE_DOWNLOAD_COUNTS", False),
                                        ("evaluate.config", "HF_UPDATE_DOWNLOAD_COUNTS", False))),
)


def switches(allow_download: bool, environ=None) -> list[tuple[str, str, tuple]]:
    """The switches `quiet_hub` sets: offline unless `allow_download` (then the user's own
    settings stand); telemetry and download counts off unless the user chose them."""
    environ = os.environ if environ is None else environ
    chosen: list[tuple[str, str, tuple]] = [] if allow_download else list(OFFLINE)
    if not any(name in environ for name in TELEMETRY_SET):
        chosen += TELEMETRY
    chosen += [s for s in COUNTS if s[0] not in environ]
    return chosen


@contextmanager
def quiet_hub(allow_download: bool = False) -> Iterator[None]:
    """While lm-eval runs: the Hugging Face libraries offline (unless `allow_download`), no
    telemetry, no download counting. Variables and constants are put back afterwards."""
    if "datasets" not in sys.modules and find_spec("datasets") is not None:
        importlib.import_module("datasets")  # so its constants are switched and put back, not read once
    saved_env: dict[str, str | None] = {}
    saved_constants: list[tuple[object, str, object]] = []
    for variable, value, constants in switches(allow_download):
        saved_env.setdefault(variable, os.environ.get(variable))
        os.environ[variable] = value
        for module_name, attribute, constant in constants:
            module = sys.modules.get(module_name)
            if module is not None and hasattr(module, attribute):
                saved_constants.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, constant)
    try:
        yield
    finally:
        for module, attribute, before in reversed(saved_constants):
            setattr(module, attribute, before)
        for variable, before in saved_env.items():
            if before is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = before
