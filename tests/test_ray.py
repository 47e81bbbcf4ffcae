"""Sweeps on Ray: the same cells and numbers as a local run, a SIGKILLed worker retried, failures reported and
finished by a rerun, and every bad input one line (Ray's absence and an unreachable address included).

The Ray tests share one local Ray session (2 CPUs, 2 workers, the tiny model): Ray's start-up is the slow part.
They skip, saying why, when the `ray` extra is not installed; `make test` installs it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from kvevict.ab import SweepConfig, run_sweep
from kvevict.ab.executors import LocalExecutor

from helpers import cli, cli_error

SRC = str(Path(__file__).resolve().parents[1] / "src")
needs_ray = pytest.mark.skipif(find_spec("ray") is None, reason="the ray extra is not installed: pip install "
                               "kvevict[ray] (make test installs it)")
TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 30
# what a cell measured; timing and memory differ between any two runs and are left out
NUMBERS = ("ppl", "nll_mean", "kl_to_full", "top1_agreement", "sink_loss", "max_kept", "curve", "sink_lost_at",
           "n_predictions", "full_ppl_same_tokens")


def numbers(path: Path) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {d["key"]: {k: d.get(k) for k in NUMBERS} for d in lines}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray-text") / "text.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance for the module; workers import kvevict from this checkout."""
    if find_spec("ray") is None:
        pytest.skip("the ray extra is not installed: pip install kvevict[ray]")
    import ray

    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


def sweep(tmp_path, tiny_dir, text_file, name: str) -> SweepConfig:
    return SweepConfig(model=str(tiny_dir), text=str(text_file), tokens=240, budgets=[16, 32],
                       policies=["window", "h2o", "sink2+window"], sinks=[0, 4], oracle_stride=20,
                       out=str(tmp_path / "runs"), name=name)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "kvevict.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def ray_servers() -> set[int]:
    """Process ids of Ray's GCS servers on this machine (one per running Ray instance)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"gcs_server" in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
        except OSError:
            continue
    return found


@needs_ray
def test_cli_ray_run_equals_local_run_and_resumes(tmp_path, tiny_dir, text_file):
    """`--executor ray` without an address starts a local Ray instance for the run and stops it; same cells, same
    numbers as the local executor; `kvevict report` redraws it; a rerun has nothing left to do."""
    common = ["ab", "--model", str(tiny_dir), "--text", str(text_file), "--tokens", "240", "--budgets", "16,32",
              "--policies", "window,h2o,sink2+window", "--sinks", "0,4", "--oracle-stride", "20",
              "--out", str(tmp_path / "runs")]
    local = _run(*common, "--name", "local")
    assert local.returncode == 0, local.stderr
    before = ray_servers()
    ray_run = _run(*common, "--name", "ray", "--executor", "ray", "--workers", "2")
    assert ray_run.returncode == 0, ray_run.stderr
    deadline = time.monotonic() + 15
    while ray_servers() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_servers() <= before  # the local instance the run started is stopped with it
    ours, theirs = numbers(tmp_path / "runs" / "ray" / "results.jsonl"), numbers(tmp_path / "runs" / "local" /
                                                                                 "results.jsonl")
    assert len(ours) == 1 + 2 * (1 + 3 + 2) and ours == theirs  # full; per budget the oracle, 3 policies, 2 sink rows
    for line in (tmp_path / "runs" / "ray" / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["seconds"] > 0 and record["tokens_per_s"] > 0 and record["peak_mb"] > 0
    again = _run(*common, "--name", "ray", "--executor", "ray")
    assert again.returncode == 0, again.stderr
    assert numbers(tmp_path / "runs" / "ray" / "results.jsonl") == ours  # nothing recomputed or appended
    report = cli("report", str(tmp_path / "runs" / "ray"), "--markdown")
    assert report.exit_code == 0 and report.stdout.startswith("## Verdict")


# --- bad input ----------------------------------------------------------------------------------------------


def test_unknown_executor_is_one_line(tmp_path):
    cli_error("ab", "--executor", "dask", "--out", str(tmp_path), needles=("--executor must be one of local, ray",
                                                                           "'dask'"))


def test_address_without_ray_executor_is_one_line(tmp_path):
    cli_error("ab", "--address", "10.0.0.5:6379", "--out", str(tmp_path), needles=("--executor ray",))


def test_missing_ray_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when it is not installed
    cli_error("ab", "--executor", "ray", "--out", str(tmp_path), needles=("pip install kvevict[ray]",))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_ray
@pytest.mark.parametrize("address", ["refused", "silent", "10.255.255.1:6379", "ray://10.255.255.1:10001",
                                     "nohost"])
def test_unreachable_ray_address_fails_fast_in_one_line(tmp_path, address):
    needles = ["is not HOST:PORT" if address == "nohost" else "cannot reach Ray at"]
    with socket.socket() as server:
        if address == "refused":
            address = f"127.0.0.1:{_closed_port()}"
        if address == "silent":  # a port that accepts the connection and never says a word: the wait is timed
            server.bind(("127.0.0.1", 0))
            server.listen(4)
            address = f"127.0.0.1:{server.getsockname()[1]}"
            needles.append("timed out")
        start = time.monotonic()
        # (before the tests that share a Ray session: this process must not be connected to Ray yet)
        cli_error("ab", "--executor", "ray", "--address", address, "--out", str(tmp_path),
                  needles=(*needles, f"'{address}'", "--address"))
        assert time.monotonic() - start < 30


class Killer:
    """Kills the worker a chosen batch was handed to, `delay` seconds later (inside the batch)."""

    def __init__(self, budget: int, times: int, delay: float = 0.3) -> None:
        self.budget, self.times, self.delay = budget, times, delay
        self.dispatched: list[tuple[str, int]] = []
        self.killed: list[int] = []

    def __call__(self, batch, pid: int) -> None:
        self.dispatched.append((batch.name, pid))
        if batch.kind == "rows" and batch.budget == self.budget and len(self.killed) < self.times:
            self.killed.append(pid)
            threading.Timer(self.delay, os.kill, (pid, signal.SIGKILL)).start()


@needs_ray
def test_sigkilled_worker_loses_only_its_batch_which_is_retried(ray_session, tmp_path, tiny_dir, text_file):
    from kvevict.integrations.ray_executor import RayExecutor

    killer = Killer(budget=16, times=1)
    executor = RayExecutor(workers=2, retries=2, on_dispatch=killer)
    run_sweep(sweep(tmp_path, tiny_dir, text_file, "killed"), progress=False, executor=executor)
    assert executor.failed == [] and len(killer.killed) == 1
    assert [name for name, _ in killer.dispatched].count("budget 16: rows") == 2  # handed out again once
    run_sweep(sweep(tmp_path, tiny_dir, text_file, "local"), progress=False, executor=LocalExecutor())
    runs = tmp_path / "runs"
    assert numbers(runs / "killed" / "results.jsonl") == numbers(runs / "local" / "results.jsonl")


@needs_ray
def test_worker_dying_every_time_is_reported_failed_and_a_rerun_finishes_it(ray_session, tmp_path, tiny_dir,
                                                                             text_file, capsys):
    from kvevict.cli.ab import run_ab
    from kvevict.integrations.ray_executor import RayExecutor

    config = sweep(tmp_path, tiny_dir, text_file, "failing")
    killer = Killer(budget=32, times=2)
    executor = RayExecutor(workers=2, retries=1, on_dispatch=killer)
    with pytest.raises(BaseException) as exit_:  # typer.Exit(1) after the report is written
        run_ab(config, executor=executor)
    assert getattr(exit_.value, "exit_code", None) == 1
    assert [(b.name, len(b.cells)) for b, _ in executor.failed] == [("budget 32: rows", 5)]
    err = capsys.readouterr().err
    assert "failed: budget 32: rows (window, h2o, sink2+window, window, sink4+window)" in err
    assert "rerun the same command to finish it" in err
    results = config.folder / "results.jsonl"
    assert not any("|32" in json.loads(line)["key"] and "oracle" not in line
                   for line in results.read_text().splitlines())
    assert (config.folder / "report.html").exists()
    run_sweep(config, progress=False, executor=RayExecutor(workers=2))  # the rerun
    run_sweep(sweep(tmp_path, tiny_dir, text_file, "reference"), progress=False)
    assert numbers(results) == numbers(tmp_path / "runs" / "reference" / "results.jsonl")


def test_core_runs_without_the_extras(tmp_path, tiny_dir):
    """With `ray` and `lm_eval` unimportable, kvevict imports, runs a local sweep, and names each install."""
    script = f"""
import sys
sys.modules["ray"] = None
sys.modules["lm_eval"] = None
import kvevict, kvevict.ab, kvevict.cli, kvevict.integrations.lmeval
from typer.testing import CliRunner
from kvevict.cli import app
run = CliRunner().invoke(app, ["ab", "--model", {str(tiny_dir)!r}, "--text", {str(Path(__file__))!r},
                               "--tokens", "80", "--budgets", "16", "--policies", "window", "--oracle-stride", "40",
                               "--out", {str(tmp_path)!r}, "--name", "core"])
assert run.exit_code == 0, run.output
for args in (["ab", "--executor", "ray", "--out", {str(tmp_path)!r}], ["lm-eval", "--tasks", "copa"]):
    run = CliRunner().invoke(app, args)
    print(run.exit_code, run.stderr.strip())
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    ray_line, lm_line = done.stdout.strip().splitlines()[-2:]
    assert ray_line == "2 error: --executor ray needs Ray, which is not installed: pip install kvevict[ray]"
    assert lm_line == ("2 error: kvevict lm-eval needs lm-evaluation-harness, which is not installed: "
                       "pip install kvevict[lm-eval]")
    assert (tmp_path / "core" / "results.jsonl").exists()
