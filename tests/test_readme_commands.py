"""Every `kvevict ...` command README.md shows runs as written, on both embedded models.

The commands are read out of the README itself (inline code in its tables, and `bash`
blocks, continuation lines joined), so a command the README gains is tested without an
edit here. Each runs through the CLI with its own options, plus `--model` (one embedded
model per half) and, to stay cheap, a few size options made small (`SMALL`: the README's
`--tokens 3000` runs as `--tokens 160`); the placeholders the README asks the reader to
fill in (`path/to/model`, `my-documents/`, `runs/mine`) are given the embedded model, the
embedded text and a run written by the README's own `ab` command. A command that needs an
optional extra (`engine-check`: llama.cpp, `lm-eval`) is skipped where the extra is absent,
naming it; `lm-eval`'s tasks read their datasets from the Hub, so only its own tests (local
tasks) run it. `demo` runs a fixed two-minute sweep (`make demo`), so only its `--help` runs here.
The Gemma 3 half is marked `readme_gemma` (it loads the larger model once per command).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from support import cli

README = Path(__file__).resolve().parents[1] / "README.md"
MODELS = ("smollm2-135m", "gemma3-270m")

#: size options made small, each to a value that keeps the command valid (budgets below the stream)
SMALL = {
    "--tokens": "160", "--budget": "48", "--budgets": "48,64", "--lengths": "400", "--length": "200",
    "--trials": "1", "--samples": "1", "--sinks": "0,4", "--needle-trials": "1",
}
#: options a command's README line leaves at a default that would cost minutes here, made small when absent
ADDED = {
    "ruler": ["--samples", "1", "--max-new-tokens", "4"],
    "needle": ["--trials", "1", "--depths", "0.5"],
    "generation": ["--trials", "1", "--max-new-tokens", "8"],
}
#: percentages stay as written: they are shares of whatever length runs
KEEP_PERCENT = re.compile(r"^\d+%(,\d+%)*$")
#: what a placeholder in the README stands for here
PLACEHOLDERS = {"path/to/model": None, "my-documents/": "pg-essays"}
#: commands that need an optional extra, and the module that extra installs
EXTRAS = {"engine-check": "llama_cpp", "lm-eval": "lm_eval"}
#: commands that cannot run offline as written, and why (their own tests run local equivalents)
OFFLINE = {"lm-eval": "lm-eval's tasks read their datasets from the Hugging Face Hub (test_lmeval.py runs local "
                      "tasks through --include-path)"}


def readme_commands(text: str) -> list[str]:
    """Every `kvevict ...` command in the README: inline code spans and lines of fenced shell blocks."""
    found: list[str] = []
    for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("#", 1)[0].strip().removeprefix("$ ")
            if line.startswith("kvevict "):
                found.append(line)
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [span.strip() for span in re.findall(r"`(kvevict [^`]+)`", outside)]
    return list(dict.fromkeys(found))


def cheap(command: str, model: str, out: Path) -> list[str]:
    """The command's arguments with the model, the output folder and small sizes filled in."""
    words = shlex.split(command)[1:]
    name = words[0]
    args: list[str] = []
    for i, word in enumerate(words):
        previous = words[i - 1] if i else ""
        if previous in SMALL and not KEEP_PERCENT.match(word):
            word = SMALL[previous]
        if word in PLACEHOLDERS:
            word = PLACEHOLDERS[word] or model
        if word.startswith("runs/"):
            word = str(out / word.removeprefix("runs/"))
        args.append(word)
    if "--help" in args or name == "report":
        return args
    if "--model" not in args:
        args += ["--model", model]
    for option, value in zip(ADDED.get(name, [])[::2], ADDED.get(name, [])[1::2]):
        if option not in args:
            args += [option, value]
    if name in ("ab", "ruler"):
        args += ["--out", str(out)]
    if name == "sinks":
        args = [str(out / a) if a.endswith(".png") else a for a in args]
    return args


COMMANDS = readme_commands(README.read_text()) if README.exists() else []


def _cases():
    for model in MODELS:
        marks = [pytest.mark.model] + ([pytest.mark.readme_gemma] if model == "gemma3-270m" else [])
        for command in COMMANDS:
            yield pytest.param(command, model, marks=marks, id=f"{model}: {command}")


def test_the_readme_shows_commands():
    assert len(COMMANDS) >= 5, "README.md shows too few `kvevict` commands to be a user's guide"


@pytest.mark.parametrize("command,model", list(_cases()))
def test_readme_command_runs(command, model, tmp_path_factory, monkeypatch):
    name = shlex.split(command)[1]
    if name == "demo" and "--help" not in command:
        command += " --help"  # `make demo`'s fixed sweep: its options are checked, not its two minutes
    if name in OFFLINE and "--help" not in command:
        pytest.skip(OFFLINE[name])
    module = EXTRAS.get(name)
    if module and "--help" not in command and importlib.util.find_spec(module) is None:
        pytest.skip(f"`kvevict {name}` needs the {module} extra, not installed here")
    out = tmp_path_factory.getbasetemp() / f"readme-{model}"  # shared: `report runs/mine` reads `ab`'s run
    out.mkdir(exist_ok=True)
    monkeypatch.chdir(out)  # what a command writes beside the user (report-compare.html) stays in the scratch folder
    if name == "report":
        _ensure_runs(command, model, out)
    result = cli(*cheap(command, model, out))
    assert result.exit_code == 0, f"{command}\n{result.output}"


def _ensure_runs(command: str, model: str, out: Path) -> None:
    """The runs a README `report` command names, made by a small `ab` under each name it uses."""
    for word in shlex.split(command):
        if word.startswith("runs/") and not (out / word.removeprefix("runs/") / "results.jsonl").exists():
            made = cli("ab", "--model", model, "--tokens", "64", "--budgets", "16", "--policies", "window",
                       "--out", str(out), "--name", word.removeprefix("runs/"))
            assert made.exit_code == 0, made.output
