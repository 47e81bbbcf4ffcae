"""The command line starts without the heavy libraries: `kvevict --help` and every subcommand's `--help` import
neither torch, transformers, scipy nor matplotlib (benchmarks/startup.py measures what that is worth),
`import kvevict` does not either until a public name is read, and `kvevict ruler` checks its whole grid before
its model load without the engine (transformers' cache machinery, HQQ and torch's compiler behind it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvevict.cli import COMMANDS

HEAVY = ["torch", "transformers", "scipy", "matplotlib", "hqq", "ray", "lm_eval"]

# every `--help` in one fresh process, then the heavy modules it holds
_HELP_ALL = """
import json, sys
from kvevict.cli import COMMANDS, main
names = [c.__name__.replace("_", "-") for c in COMMANDS]
for argv in [["--help"], *([n, "--help"] for n in names)]:
    try:
        main(argv)
    except SystemExit as done:
        assert done.code == 0, (argv, done.code)
print(json.dumps({"helped": len(names), "heavy": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)}))
"""


#: what the engine (`kvevict.cache.cache`) imports with it: seconds a command should not pay before its model load
ENGINE = ["kvevict.cache.cache", "transformers.cache_utils", "hqq", "torch._dynamo", "torch._inductor"]

# `kvevict ruler` up to its model load (the load stubbed to stop there, as benchmarks/startup.py does), then the
# engine modules it holds
_RULER_TO_LOAD = """
import json, sys
import kvevict.loading as loading
def reached(*args, **kwargs):
    engine = sorted(m for m in sys.modules if any(m == e or m.startswith(e + ".") for e in ENGINE))
    print(json.dumps({"engine": engine}))
    raise SystemExit(0)
loading.load_model = loading.load_tokenizer = reached
from kvevict.cli import main
main(sys.argv[1:])
"""


def fresh(script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\nENGINE = {ENGINE!r}\n{script}", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_help_imports_no_heavy_library():
    seen = fresh(_HELP_ALL)
    assert seen["helped"] == len(COMMANDS)
    assert seen["heavy"] == []


def test_import_kvevict_is_light_until_a_name_is_read():
    seen = fresh("""
import json, sys
import kvevict
light = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
cache = kvevict.EvictingCache
print(json.dumps({"light": light, "then": "torch" in sys.modules, "name": cache.__name__}))
""")
    assert seen == {"light": [], "then": True, "name": "EvictingCache"}


@pytest.mark.parametrize("extra", [
    [],
    ["--protocol", "aware", "--policies", "snapkv,adakv:h2o,kvzip"],
    ["--protocol", "multi", "--form", "aware-requests", "--tasks", "niah_multikey_1", "--policies", "h2o"],
    ["--protocol", "stream", "--policies", "llamacpp,q4+h2o"],
])
def test_ruler_checks_its_grid_before_the_load_without_the_engine(tmp_path, extra):
    """Every refusal before the model load (tasks, protocol, policies, budgets, the run folder) is made without
    `kvevict.cache.cache`: it imports transformers' cache machinery, and with it HQQ and torch's compiler stack
    (seconds), which the model load imports anyway."""
    seen = fresh(_RULER_TO_LOAD, "ruler", "--tasks", "niah_single_1", "--lengths", "500", "--budgets", "50%",
                 "--samples", "1", "--out", str(tmp_path), *extra)
    assert seen == {"engine": []}
