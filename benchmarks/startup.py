"""Start-up: `kvevict --help`, every subcommand's `--help`, `import kvevict`, and how long a model command
takes to reach its model load, against `import torch` measured beside it.

Each figure is the median of `--rounds` fresh processes, the arms taking turns, so a busy machine slows them
alike. A model command's figure is the time from interpreter start to its first `load_model` /
`load_tokenizer` call (the call is stubbed to exit there, so no weights are read), less the median `import
torch`: what kvevict itself adds before the work starts. Run it as CI's environment does:

    PYTHONDONTWRITEBYTECODE=1 .venv/bin/python benchmarks/startup.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

# a process that exits where a command first asks for its model or tokenizer, saying so
_TO_LOAD = """
import sys
import kvevict.loading as loading
def reached(*args, **kwargs):
    print("reached"); raise SystemExit(0)
loading.load_model = loading.load_tokenizer = reached
from kvevict.cli import main
main(sys.argv[1:])
"""

MODEL_COMMANDS = {
    "ppl": ["ppl", "--tokens", "64", "--budget", "32"],
    "compare": ["compare", "--tokens", "64", "--budget", "32", "--policies", "window"],
    "ruler": ["ruler", "--tasks", "niah_single_1", "--lengths", "500", "--budgets", "50%", "--samples", "1"],
}
HELP = ["ppl", "compare", "ab", "report", "demo", "needle", "generation", "sinks", "ruler", "lm-eval",
        "engine-check", "envelope", "audit"]


def seconds(argv: list[str]) -> float:
    """Wall seconds of one fresh process."""
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - start


def to_load(args: list[str]) -> float:
    """Seconds from a fresh interpreter's start until the command asks for its model (the process exits there)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _TO_LOAD, *args], capture_output=True, text=True)
    if done.returncode != 0 or "reached" not in done.stdout:
        raise SystemExit(f"{args[0]} did not reach its model load: {done.stderr.strip()[-400:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    cli = [sys.executable, "-m", "kvevict.cli"]
    arms: dict[str, Callable[[], float]] = {
        "import torch": lambda: seconds([sys.executable, "-c", "import torch"]),
        "import kvevict": lambda: seconds([sys.executable, "-c", "import kvevict"]),
        "kvevict --help": lambda: seconds([*cli, "--help"]),
        **{f"kvevict {c} --help": (lambda c=c: seconds([*cli, c, "--help"])) for c in HELP},
        **{f"{c}: to model load": (lambda a=a: to_load(a)) for c, a in MODEL_COMMANDS.items()},
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            times[name].append(arm())
    torch_s = statistics.median(times["import torch"])
    print(f"{'what':36} {'median s':>9} {'over import torch':>18}")
    for name, values in times.items():
        median = statistics.median(values)
        over = f"{median - torch_s:18.2f}" if name.endswith("model load") else ""
        print(f"{name:36} {median:9.2f} {over}")
    print(f"slowest --help: {max(statistics.median(v) for n, v in times.items() if n.endswith('--help')):.2f} s "
          f"(line: 1 s); slowest model command over import torch: "
          f"{max(statistics.median(v) for n, v in times.items() if n.endswith('model load')) - torch_s:.2f} s "
          "(line: 3 s)")


if __name__ == "__main__":
    main()
