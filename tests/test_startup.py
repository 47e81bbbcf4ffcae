"""The command line starts without the heavy libraries: `kvevict --help` and every subcommand's `--help` import
neither torch, transformers, scipy nor matplotlib (benchmarks/startup.py measures what that is worth), and
`import kvevict` does not either until a public name is read."""

from __future__ import annotations

import json
import subprocess
import sys

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


def fresh(script: str) -> dict:
    done = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{script}"], capture_output=True, text=True,
                          timeout=120)
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
